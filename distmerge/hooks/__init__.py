"""Hooks that run distmerge where users already are (docs/api.md): imported by the user's training script only,
never by the merge path (they may import the training library they hook into)."""
