"""The totals of a verify report (rank 0, from the records alone): how many tensors were compared, how many names
each side has of the other's (verl's merger guide asks for more than 99% of the names matched), and the least
cosine similarity, over all tensors and per kind of layer. Kinds and layer numbers are read from the names with
the KINDS table; the plot (plot.py) draws the same kinds. No I/O here."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from distmerge.verifier.report import Check, Criteria

# verl's merger guide: "more than 99% of names matched" (both ways, here).
COVERAGE_CRITERION = 0.99

# Kind of a tensor by its name: the first row whose pattern is found in the name. Norms come first, so that a
# norm inside attention (self_attn.q_norm, q_a_layernorm) counts as a norm. Names are the output's (Hugging Face)
# names: Megatron, DeepSpeed and torchtitan names were mapped by the family tables before verify sees them.
KINDS: tuple[tuple[str, str], ...] = (
    ("norms", r"norm|(^|\.)ln_"),
    ("embeddings/head", r"embed|(^|\.)(lm_head|wte|wpe|score|v_head)\."),
    ("attention", r"attn|attention"),
    ("MLP", r"mlp|feed_forward|experts|(^|\.)(moe|block_sparse_moe)\."),
)
OTHER = "other"
KIND_NAMES = ("attention", "MLP", "norms", "embeddings/head")  # the order the report and the plot show them
assert sorted(KIND_NAMES) == sorted(kind for kind, _ in KINDS)
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")  # model.layers.N., transformer.h.N., visual.blocks.N.
# outcomes of a name present on one side only (the tied head that the model re-creates is matched)
MERGED_ONLY = ("extra in merged", "not in reference")
REFERENCE_ONLY = ("missing in merged",)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), OTHER)


def layer_of(name: str) -> int | None:
    found = LAYER.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True, kw_only=True)
class Least:
    """The least cosine over some tensors, and whose it is."""

    cosine: float  # NaN when a compared tensor has NaN figures
    name: str
    tensors: int  # how many tensors it is the least of


@dataclass(frozen=True, kw_only=True)
class Coverage:
    reference_names: int
    merged_names: int
    matched: int  # names on both sides (a tied head the merged model re-creates counts)

    @property
    def reference_in_merged(self) -> float:
        return self.matched / self.reference_names if self.reference_names else 1.0

    @property
    def merged_in_reference(self) -> float:
        return self.matched / self.merged_names if self.merged_names else 1.0

    @property
    def met(self) -> bool:
        return min(self.reference_in_merged, self.merged_in_reference) > COVERAGE_CRITERION


@dataclass(frozen=True, kw_only=True)
class Totals:
    compared: int  # tensors whose values were compared (names and shapes matched)
    coverage: Coverage
    least: Least | None  # None when no tensor was compared
    by_kind: dict[str, Least]  # only the kinds that have compared tensors, in KINDS order
    min_cosine: float | None  # --min-cosine: the least cosine is then a pass/fail criterion

    @property
    def cosine_met(self) -> bool | None:
        if self.min_cosine is None or self.least is None:
            return None
        return self.least.cosine >= self.min_cosine  # False for NaN


def totals(checks: list[Check], crit: Criteria) -> Totals:
    compared = [c for c in checks if c.figures is not None]
    by_kind = {kind: _least(c for c in compared if kind_of(c.name) == kind) for kind in (*KIND_NAMES, OTHER)}
    return Totals(compared=len(compared), coverage=coverage(checks), least=_least(compared),
                  by_kind={k: v for k, v in by_kind.items() if v is not None}, min_cosine=crit.min_cosine)


def coverage(checks: list[Check]) -> Coverage:
    merged_only = sum(c.outcome in MERGED_ONLY for c in checks)
    reference_only = sum(c.outcome in REFERENCE_ONLY for c in checks)
    matched = len(checks) - merged_only - reference_only
    return Coverage(reference_names=matched + reference_only, merged_names=matched + merged_only, matched=matched)


def _least(checks: Iterable[Check]) -> Least | None:
    """The first (in the report's name order) of the least cosines, compared to 12 digits. The float64 sums behind
    a cosine follow torch's thread count, so a bit-exact tensor's is 1 or 1 - 1e-16 depending on the processes
    (compare.py): here it is 1, and the totals are the same however verify was launched."""
    rows = list(checks)
    if not rows:
        return None
    worst = min(rows, key=lambda c: -math.inf if math.isnan(_cosine(c)) else round(_cosine(c), 12))
    return Least(cosine=_cosine(worst), name=worst.name, tensors=len(rows))


def _cosine(check: Check) -> float:
    return 1.0 if check.bit_exact else check.figures.cosine


# -- what the report says ------------------------------------------------------------------------------
def percent(share: float) -> str:
    """Two decimals, never rounded up to 100.00% when a name is missing."""
    text = f"{share * 100:.2f}%"
    return ">99.99%" if share < 1 and text == "100.00%" else text


def totals_lines(t: Totals) -> list[str]:
    """The summary lines of the printed report (above the verdict line)."""
    cov = t.coverage
    names = (f"names: {cov.matched} of {cov.reference_names} reference names in merged "
             f"({percent(cov.reference_in_merged)}), {cov.matched} of {cov.merged_names} merged names in reference "
             f"({percent(cov.merged_in_reference)}); verl's criterion > {COVERAGE_CRITERION:.0%}: "
             f"{'met' if cov.met else 'NOT met'}")
    if t.least is None:
        return [names, "cosine: no tensor compared"]
    rule = ("not a criterion (--min-cosine C makes it one)" if t.cosine_met is None else
            f"--min-cosine {t.min_cosine:g}: {'met' if t.cosine_met else 'NOT met'}")
    kinds = ", ".join(f"{kind} {least.cosine:.6f}" for kind, least in t.by_kind.items())
    cosine = (f"least cosine of {t.compared} tensors compared: {t.least.cosine:.6f} ({t.least.name}), {rule}; "
              f"by kind: {kinds}")
    return [names, cosine]


def totals_json(t: Totals) -> dict:
    cov = t.coverage
    return {
        "tensors_compared": t.compared,
        "coverage": {"reference_names": cov.reference_names, "merged_names": cov.merged_names,
                     "matched": cov.matched, "reference_in_merged": cov.reference_in_merged,
                     "merged_in_reference": cov.merged_in_reference, "criterion": f"> {COVERAGE_CRITERION}",
                     "met": cov.met},
        "least_cosine": None if t.least is None else _least_json(t.least),
        "least_cosine_by_kind": {kind: _least_json(least) for kind, least in t.by_kind.items()},
        "min_cosine": t.min_cosine,
        "min_cosine_met": t.cosine_met,
    }


def _least_json(least: Least) -> dict:
    return {"cosine": least.cosine, "name": least.name, "tensors": least.tensors}
