"""Where a LoRA checkpoint's base weights W come from: the checkpoint itself (PEFT names, `.base_layer.`), or,
for a LoRA-only save, the --base-model folder (Hugging Face names; FamilyContext.base_weights).

    adapted module (PEFT name)                          its W
    base_model.model.model.layers.0.self_attn.q_proj    ...q_proj.base_layer.weight     in the checkpoint
                                                        model.layers.0.self_attn.q_proj.weight   in the folder

A folder that is not this adapter's base (a weight missing, or of another shape than B @ A) is refused
before any byte moves: fusing into, or loading the adapter onto, another model would be silently wrong.
"""

from __future__ import annotations

from distmerge.errors import InputError
from distmerge.families.base import FamilyContext, SourceMeta

PEFT_PREFIX = "base_model.model."
SAVES = "verl's save_lora_only, or the HF Trainer's DeepSpeed save of a PEFT model"


def find(modules: dict[str, dict[str, str]], sources: dict[str, SourceMeta], own: dict[str, SourceMeta],
         ctx: FamilyContext) -> tuple[dict[str, str], dict[str, SourceMeta]] | None:
    """(adapted module -> the source of its W, Hugging Face name -> source of every base weight), or None for a
    LoRA-only save without a base folder. `own`: the checkpoint's non-LoRA tensors by Hugging Face name."""
    inside = {m: f"{m}.base_layer.weight" for m in modules if f"{m}.base_layer.weight" in sources}
    if inside:
        if missing := [m for m in modules if m not in inside]:
            raise InputError(f"{missing[0]}: the LoRA base weight is missing; the checkpoint is incomplete")
        return inside, own
    if own:  # neither whole nor LoRA-only: never write half a base, never drop what the checkpoint holds
        raise InputError(f"the checkpoint holds some base weights ({next(iter(own))}, ...) but not those of the "
                         "adapted modules: the save is incomplete")
    if not ctx.base_weights:
        return None
    for module, ab in modules.items():
        check_fits(module, sources[ab["A"]], sources[ab["B"]], ctx.base_weights)
    return {m: ctx.base_weights[weight_name(m)].name for m in modules}, dict(ctx.base_weights)


def weight_name(module: str) -> str:
    return f"{module.removeprefix(PEFT_PREFIX)}.weight"


def check_fits(module: str, lora_a: SourceMeta, lora_b: SourceMeta, base: dict[str, SourceMeta]) -> None:
    """W must be there with the shape B @ A has: (B's rows, A's columns)."""
    name, want = weight_name(module), (lora_b.shape[0], lora_a.shape[1])
    if name not in base:
        raise InputError(f"--base-model has no {name}, the weight the LoRA adapter of {module} applies to: "
                         "not the base model of this adapter")
    if base[name].shape != want:
        raise InputError(f"--base-model's {name} has shape {list(base[name].shape)}, the LoRA adapter needs "
                         f"{list(want)}: not the base model of this adapter")


def notes(origin: dict[str, SourceMeta], ctx: FamilyContext) -> list[str]:
    if ctx.base_weights and origin == ctx.base_weights:
        return [f"LoRA-only save: base weights ({len(origin)} tensors) taken from --base-model"]
    return []
