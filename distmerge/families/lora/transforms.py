"""A LoRA pair fused into its base weight (family.py's fused units name it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distmerge.families.transforms import Params


@dataclass(frozen=True)
class LoraFuse(Params):
    scale: float  # alpha / r


def lora_fuse(sources: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """W + (B @ A) * scale, computed in float32 and returned in W's dtype (PEFT's merge_and_unload order).

        W (out, in)   A (r, in)   B (out, r)     all whole tensors on the unit's owner

    Always on the CPU, even with --device cuda: cuBLAS sums the product in another order than the CPU does,
    and the merged bytes must not depend on the device.
    """
    base, lora_a, lora_b = (t.to("cpu", torch.float32) for t in sources)
    fused = base + (lora_b @ lora_a) * scale
    return [fused.to(sources[0].dtype)]
