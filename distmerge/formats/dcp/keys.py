"""Which entries of a DCP checkpoint are model weights, and under which names.

Trainers save more than the model: `dcp.save({"model": ..., "optimizer": ..., "train_state": ...})`
(accelerate, torchtitan, user code) flattens to `model.<param>`, `optimizer.state.<param>.exp_avg`, ...

torchtitan's EMA (components/optim/ema.py: an optimizer-shaped container the CheckpointManager saves under its
`ema` state key) keeps one copy of each tracked tensor (the parameters that require grad, and buffers it was told
to track) per configured decay, flattened by DCP to `ema.state.<fqn>.ema_params.<key>`, the key being
`decay_0p999` or `half_life_0p05` (its ema_key()); its converter, scripts/checkpoint_conversion/
convert_ema_to_hf.py --ema_key, exports one copy, and the tensors it does not track from the trained weights.
Here too: without --ema-key the live weights are merged (a note names the copies there), with it the copy's
tensors replace the live ones, a key the save does not hold is an error, and what the copy lacks is named.
"""

from __future__ import annotations

import re
from collections import defaultdict

from distmerge.errors import InputError
from distmerge.formats.base import FormatOption

# Top-level groups that are never model weights.
NOT_MODEL = ("optimizer", "optim", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader",
             "train_state", "rng", "rng_state", "extra_state", "trainer", "state", "param_groups", "ema")
WRAPPER = "model."
EMA_ENTRY = re.compile(r"^ema\.state\.(?P<fqn>.+)\.ema_params\.(?P<key>[^.]+)$")
EMA_KEY = FormatOption(flag="--ema-key", dest="ema_key", metavar="KEY",
                       help="DCP, torchtitan: merge the EMA copy KEY saved beside the live weights (torchtitan's "
                            "ema_params key, e.g. decay_0p999) instead of them; a KEY the save lacks is an error")


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


def ema_copies(fqns: list[str]) -> dict[str, dict[str, str]]:
    """EMA key -> {the tracked tensor's fqn: its entry}."""
    copies: dict[str, dict[str, str]] = defaultdict(dict)
    for fqn in fqns:
        if m := EMA_ENTRY.match(fqn):
            copies[m["key"]][m["fqn"]] = fqn
    return dict(copies)


def with_ema(names: dict[str, str], fqns: list[str], where: str, key: str) -> tuple[dict[str, str], dict[str, str],
                                                                                     list[str]]:
    """`names` (model_names') with each tensor the EMA copy `key` tracks read from that copy instead. Returns the
    names, {copy entry: the live fqn it replaces}, and the output names the copy does not track (read live)."""
    copies = ema_copies(fqns)
    if not copies:
        raise InputError(f"--ema-key {key}: {where} holds no EMA copy (no ema.state.*.ema_params.* entries): EMA was "
                         "off for this run, or this is a model-only export, which never holds one")
    if key not in copies:
        raise InputError(f"--ema-key {key}: {where} holds no EMA copy {key!r}; it holds {', '.join(sorted(copies))}")
    by_output = {out: fqn for fqn, out in names.items()}
    out, replaced = dict(names), {}
    for tracked, entry in sorted(copies[key].items()):
        live = tracked if tracked in names else by_output.get(tracked)
        if live is None:
            raise InputError(f"--ema-key {key}: {where} holds an EMA copy of {tracked}, which its model weights do not "
                             "hold: is it a save of one model?")
        out[entry] = out.pop(live)
        replaced[entry] = live
    untracked = sorted(v for k, v in out.items() if k not in replaced)
    return out, replaced, untracked
