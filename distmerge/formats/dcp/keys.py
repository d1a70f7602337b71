"""Which entries of a DCP checkpoint are model weights, and under which names.

Trainers save more than the model: `dcp.save({"model": ..., "optimizer": ..., "train_state": ...})`
(accelerate, torchtitan, user code) flattens to `model.<param>`, `optimizer.state.<param>.exp_avg`, ...
"""

from __future__ import annotations

from distmerge.errors import InputError

# Top-level groups that are never model weights.
NOT_MODEL = ("optimizer", "optim", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader",
             "train_state", "rng", "rng_state", "extra_state", "trainer", "state", "param_groups")
WRAPPER = "model."


def model_names(fqns: list[str], where: str) -> dict[str, str]:
    """fqn -> output name for the model's tensors; the `model.` wrapper is stripped when it is one."""
    kept = [f for f in fqns if f.split(".", 1)[0] not in NOT_MODEL and not f.endswith("_extra_state")]
    if not kept:
        shown = ", ".join(sorted(fqns)[:5]) or "nothing"
        raise InputError(f"{where} holds no model tensors (found: {shown}): it may be an optimizer-only checkpoint")
    dropped = len(kept) < len(fqns)
    if all(f.startswith(WRAPPER) for f in kept):
        inner = [f[len(WRAPPER) :] for f in kept]
        # {"model": state_dict} of a Hugging Face CausalLM gives model.model.* and model.lm_head.*
        if dropped or any(n.startswith(("model.", "lm_head.")) for n in inner):
            return dict(zip(kept, inner, strict=True))
    return {f: f for f in kept}
