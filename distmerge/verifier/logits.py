"""`distmerge verify --logits`: run the merged model and the reference weights on the same token ids.

What is compared is the forward's `.logits`: a language model's logits, or a value model's values (the
token-classification outputs of a critic, one per token; the family's traits say which).

Rank 0 only, and the only place verify imports transformers (that import alone costs seconds). Both
models live in this one process: this check is opt-in and meant for models that fit in memory.

The reference's weights are loaded into a copy of the merged model (its config.json), so the two runs
differ in their weights only, and a reference without a config.json (a bare state dict) works too.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from distmerge import dtypes
from distmerge.families import hub_names
from distmerge.verifier.blocks import figures
from distmerge.verifier.listing import Listing, VerifyOptions
from distmerge.verifier.report import Figures, LogitsCheck, judge
from distmerge.verifier.sides import TensorFiles

ROWS, SEQ = 2, 32


def compare_logits(listing: Listing, opts: VerifyOptions, device: torch.device) -> LogitsCheck:
    import transformers

    path = Path(opts.merged.location)  # a finished model: a local path (kinds.py)
    folder = path if path.is_dir() else path.parent
    dtype = _model_dtype(listing)
    auto_class = getattr(transformers, listing.traits.auto_class)  # the merged model's family says which
    encoding = listing.encoding  # encoded weights (merge --quantize): decoded by transformers as it loads them
    merged = encoding.load(auto_class, folder, transformers) if encoding else auto_class.from_pretrained(folder)
    merged = merged.to(device=device, dtype=dtypes.torch_dtype(dtype)).eval()
    reference = copy.deepcopy(merged)
    problem, unexpected = _load_reference(reference, listing, dtype)
    ids = _token_ids(merged.config)
    if problem:
        return _cannot_run(ids, dtype, problem)
    with torch.no_grad():
        got, want = merged(ids.to(device)).logits, reference(ids.to(device)).logits
    crit = opts.criteria
    default = encoding is not None and crit.exact_only  # encoded weights' logits are never exact: a stated criterion
    if default:
        crit = replace(crit, min_cosine=encoding.logits_cosine)
    exact, figs = figures(got, want, *crit.band())
    passed, _, reason = judge(dtype="", ref_dtype="", exact=exact, figs=figs, crit=crit)
    note = f"the reference's weights in the merged model's architecture, both in {dtypes.hf_dtype_name(dtype)}"
    if encoding:
        note = (f"{encoding.loaded}; {note}"
                + (f"; judged by cosine >= {encoding.logits_cosine} (--atol, --rtol or --min-cosine choose another)"
                   if default else ""))
    values = listing.traits.outputs == "values"  # a value head: one number per token, no distribution to compare
    if values:
        note = f"values ({auto_class.__name__}, one per token, no KL); {note}"
    if unexpected:
        note += f"; not used by the model: {', '.join(unexpected[:3])}"
    return LogitsCheck(passed=passed, reason=reason, input_shape=tuple(ids.shape), dtype=dtypes.hf_dtype_name(dtype),
                       figures=figs, kl=float("nan") if values else _kl(got, want), note=note)


def _model_dtype(listing: Listing) -> str:
    """The merged files' most common floating dtype: both models run in it, as the tensors were compared. Encoded
    weights (merge --quantize), decoded by transformers, are cast to the dtype they were encoded from."""
    if listing.encoding:
        return listing.model_dtype or "F32"
    counts = Counter(loc.dtype for loc in listing.merged.tensors.values() if dtypes.is_float(loc.dtype))
    return counts.most_common(1)[0][0] if counts else "F32"


def _load_reference(model: torch.nn.Module, listing: Listing, dtype: str) -> tuple[str, list[str]]:
    """Loads the reference's weights into `model`: (why it cannot run or "", names the model does not use).

    Loading is not strict so that the names can be reported; a parameter the reference lacks would keep
    the merged model's value and hide a difference, so any missing name (but a tied head) stops the run.
    """
    files = TensorFiles(listing.reference)
    try:
        state = {hub_names.to_module(n, listing.hub_rules): files.get(n) for n in listing.reference.tensors}
        state = {n: t.to(dtypes.torch_dtype(dtype)) if t.is_floating_point() else t for n, t in state.items()}
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape that does not fit
        return f"the reference's weights do not fit the merged model: {str(err).splitlines()[-1].strip()[:200]}", []
    finally:
        files.close()
    missing = sorted(set(result.missing_keys) - ({h for h, _ in listing.traits.tied_heads} if listing.ties else set()))
    if missing:
        return f"the reference has no {', '.join(missing[:3])}: it cannot run as the merged model", []
    return "", sorted(result.unexpected_keys)


def _token_ids(config) -> torch.Tensor:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    seq = min(SEQ, getattr(text, "max_position_embeddings", SEQ) or SEQ)
    return (torch.arange(ROWS * seq) % text.vocab_size).reshape(ROWS, seq)


def _kl(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over positions of KL(reference || merged), in float64 (float32 on a GPU)."""
    acc = torch.float64 if got.device.type == "cpu" else torch.float32
    log_p, log_q = torch.log_softmax(want.to(acc), -1), torch.log_softmax(got.to(acc), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def _cannot_run(ids: torch.Tensor, dtype: str, reason: str) -> LogitsCheck:
    nan = float("nan")
    figs = Figures(max_abs=nan, max_rel=nan, mean_abs=nan, cosine=nan, max_ref=nan, outside=0)
    return LogitsCheck(passed=False, reason=reason, input_shape=tuple(ids.shape), dtype=dtypes.hf_dtype_name(dtype),
                       figures=figs, kl=nan, note="not run")

