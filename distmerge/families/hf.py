"""Sources that already carry Hugging Face names (FSDP, DCP of HF models): one unit per tensor.

The only rule is the tied head: when config.json ties word embeddings, `lm_head.weight` is a copy of
the embedding in the state dict, and transformers 5 refuses to load a checkpoint that stores both.
"""

from __future__ import annotations

from typing import Any

from distmerge.errors import InputError
from distmerge.mapping import SourceMeta, Target, Unit, output_dtype

# Head -> the embedding it is tied to. The head is dropped when the config ties embeddings and the
# embedding is there with the same shape (the model re-creates the head from it).
TIED_HEADS = {"lm_head.weight": "model.embed_tokens.weight"}

# Names that give away another trainer's own naming: merging them as if they were Hugging Face names
# would write a model no library loads. Each maps to what is missing.
FOREIGN_NAMES = {
    "tok_embeddings.weight": "torchtitan's naming",
    "decoder.layers.": "Megatron-core's naming (merge the save with --format megatron-dist)",
    "embedding.word_embeddings.weight": "Megatron-core's naming (merge the save with --format megatron-dist)",
    "language_model.encoder.layers.": "legacy Megatron-LM's naming",
}


def check_names_are_hf(names: list[str]) -> None:
    for sign, what in FOREIGN_NAMES.items():
        if any(n.startswith(sign) for n in names):  # at the root only: BART has model.decoder.layers.*
            shown = ", ".join(sorted(names)[:4])
            raise InputError(
                f"the tensors use {what} ({shown}, ...), not Hugging Face names, and distmerge has no mapping "
                "for it in this format yet"
            )


def units(sources: dict[str, SourceMeta], config: dict[str, Any], cast: str | None) -> list[Unit]:
    drop = dropped_heads({n: s.shape for n, s in sources.items()}, config)
    return [
        Unit(sources=(s.name,), targets=(Target(name=s.name, shape=s.shape, dtype=output_dtype(s.dtype, cast)),))
        for s in sources.values()
        if s.name not in drop
    ]


def ties_embeddings(config: dict[str, Any]) -> bool:
    """transformers' default is to tie; a config saved by it writes the key whenever it differs."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def dropped_heads(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> set[str]:
    """Output names of heads that the config ties to an embedding present with the same shape."""
    if not ties_embeddings(config):
        return set()
    return {h for h, e in TIED_HEADS.items() if h in shapes and e in shapes and shapes[h] == shapes[e]}
