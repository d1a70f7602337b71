"""Sources that already carry Hugging Face names (FSDP, DCP of HF models): one unit per tensor.

The only rule is the tied head: when config.json ties word embeddings, `lm_head.weight` is a copy of
the embedding in the state dict, and transformers 5 refuses to load a checkpoint that stores both.
"""

from __future__ import annotations

from typing import Any

from distmerge.mapping import SourceMeta, Target, Unit, output_dtype

# Head -> the embedding it is tied to. The head is dropped when the config ties embeddings and the
# embedding is there with the same shape (the model re-creates the head from it).
TIED_HEADS = {"lm_head.weight": "model.embed_tokens.weight"}


def units(sources: dict[str, SourceMeta], config: dict[str, Any], cast: str | None) -> list[Unit]:
    drop = set()
    if ties_embeddings(config):
        drop = {h for h, e in TIED_HEADS.items() if h in sources and e in sources and _same_shape(sources, h, e)}
    return [
        Unit(sources=(s.name,), targets=(Target(name=s.name, shape=s.shape, dtype=output_dtype(s.dtype, cast)),))
        for s in sources.values()
        if s.name not in drop
    ]


def ties_embeddings(config: dict[str, Any]) -> bool:
    """transformers' default is to tie; a config saved by it writes the key whenever it differs."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _same_shape(sources: dict[str, SourceMeta], a: str, b: str) -> bool:
    return sources[a].shape == sources[b].shape
