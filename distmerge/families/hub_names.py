"""Vision-language models: the names `save_pretrained` writes are not the module's names.

transformers (4.52 and later) nests the language model of Qwen2-VL, Qwen2.5-VL and the LLaVA family under
`model.language_model.` and the vision tower under `model.visual.` / `model.vision_tower.`, so the state dict a
trainer saves (verl's FSDP rank files, DCP) carries those module names. `save_pretrained` maps them back to the
names the hub checkpoints use (`model.layers.*`, `visual.*`; `language_model.model.*`, `vision_tower.*`), which
older transformers, vLLM and other loaders expect. distmerge writes what `save_pretrained` writes, without
importing transformers: the prefixes are data here, and tests/test_hub_names.py checks every row against the
installed transformers' own `save_pretrained` of a tiny model of each type.

Each rule maps a module-name prefix to a hub-name prefix; the first that matches wins, and names that match
none (hub names already, from an older transformers, or `lm_head.weight` of Qwen2-VL) pass unchanged, so the
mapping is idempotent. Model types that keep their module names (Qwen3-VL) have no row.
"""

from __future__ import annotations

from typing import Any

Rules = tuple[tuple[str, str], ...]

_QWEN2_VL: Rules = (("model.language_model.", "model."), ("model.visual.", "visual."))
_LLAVA: Rules = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),
)

HUB_PREFIXES: dict[str, Rules] = {
    "qwen2_vl": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL,
    "llava": _LLAVA,
    "llava_next": _LLAVA,
    "llava_onevision": _LLAVA,
}


def rules_for(config: dict[str, Any]) -> Rules:
    return HUB_PREFIXES.get(str(config.get("model_type", "")), ())


def to_hub(name: str, rules: Rules) -> str:
    for module_prefix, hub_prefix in rules:
        if name.startswith(module_prefix):
            return hub_prefix + name[len(module_prefix):]
    return name


def to_module(name: str, rules: Rules) -> str:
    """The module's name of a hub name (names already the module's pass unchanged): loads a reference saved by
    `save_pretrained` into a live model."""
    if to_hub(name, rules) != name:
        return name  # a module name: some rule maps it
    for module_prefix, hub_prefix in rules:
        if name.startswith(hub_prefix):
            return module_prefix + name[len(hub_prefix):]
    return name
