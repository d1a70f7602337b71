"""What `distmerge verify` decides and says: the per-tensor record, pass/fail per tensor, the verdict line,
the table of the worst tensors and the JSON report. No I/O on checkpoints and no collectives here."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

TABLE_ROWS = 15
VERDICT_NAMES = 10  # failing tensors named in the verdict line; the rest are listed above it
CAST_HINT = ("hint: to accept a dtype change, give a tolerance (--atol 0 compares exactly after casting the "
             "reference to the merged dtype)")


@dataclass(frozen=True, kw_only=True)
class Criteria:
    """When a tensor passes. None = that test is off; with all off a tensor must be bit-exact."""

    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    accept_cast: bool = False  # `merge --dtype X --verify-against`: the cast was asked for

    @property
    def allclose(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def exact_only(self) -> bool:
        return not self.allclose and self.min_cosine is None

    @property
    def allows_cast(self) -> bool:
        """A merged dtype other than the reference's is a finding unless the user asked for a tolerance
        (or the merge cast on purpose): then the reference is cast to the merged dtype and compared."""
        return self.accept_cast or not self.exact_only

    def band(self) -> tuple[float, float]:
        return (self.atol or 0.0, self.rtol or 0.0)

    def describe(self) -> str:
        given = [f"--{k.replace('_', '-')} {v:g}" for k, v in (("atol", self.atol), ("rtol", self.rtol),
                                                                ("min_cosine", self.min_cosine)) if v is not None]
        return " ".join(given) or "bit-exact"


@dataclass(frozen=True, kw_only=True)
class Figures:
    """How far the merged tensor is from the reference (after any cast), over all elements."""

    max_abs: float
    max_rel: float  # over elements where the reference is non-zero
    mean_abs: float
    cosine: float
    max_ref: float  # max |reference|: the scale rtol is measured against
    outside: int  # elements outside atol + rtol * |reference| (torch.isclose)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One tensor name's result; the message a rank sends to rank 0."""

    name: str
    passed: bool
    # bit-exact | within tolerance | not in reference (an MTP layer) | missing in merged | extra in merged | shape |
    # dtype | values
    outcome: str
    reason: str  # why it failed, "" when it passed
    file: str | None  # the merged file that holds it
    shape: tuple[int, ...] | None
    reference_shape: tuple[int, ...] | None
    dtype: str | None
    reference_dtype: str | None
    cast: str | None = None  # "F32->BF16": the reference was cast to the merged dtype before comparing
    bit_exact: bool = False
    note: str = ""
    figures: Figures | None = None
    fp8_bound: float | None = None  # an encoded weight (bounded.py): the largest error / its bound, <= 1 passes


@dataclass(frozen=True, kw_only=True)
class LogitsCheck:
    """Both models run on the same token ids; judged like a tensor (exact unless tolerances are given)."""

    passed: bool
    reason: str
    input_shape: tuple[int, ...]
    dtype: str
    figures: Figures
    kl: float  # mean over positions of KL(reference || merged), in nats
    note: str


def judge(*, dtype: str, ref_dtype: str, exact: bool, figs: Figures, crit: Criteria) -> tuple[bool, str, str]:
    """(passed, outcome, reason) for a pair whose names and shapes match."""
    if dtype != ref_dtype and not crit.allows_cast:
        after = "equal after the cast" if exact else f"max abs {fmt(figs.max_abs)} after the cast"
        return False, "dtype", f"dtype {dtype}, reference {ref_dtype}, {after}"
    if exact:
        return True, "bit-exact", ""
    if crit.exact_only:
        return False, "values", f"values differ: max abs {fmt(figs.max_abs)}"
    reasons = []
    if crit.allclose and figs.outside:
        atol, rtol = crit.band()
        reasons.append(f"{figs.outside} element(s) outside atol {atol:g} + rtol {rtol:g} x |ref| "
                       f"(max abs {fmt(figs.max_abs)}, max |ref| {fmt(figs.max_ref)})")
    if crit.min_cosine is not None and not figs.cosine >= crit.min_cosine:  # `not >=` also catches NaN
        reasons.append(f"cosine {figs.cosine:.6f} < {crit.min_cosine:g}")
    if reasons:
        return False, "values", "values differ: " + "; ".join(reasons)
    return True, "within tolerance", ""


def fmt(x: float) -> str:
    return f"{x:.3g}"


def _outputs_word(logits: LogitsCheck) -> str:
    """A value head gives one number per token (no KL: one label has no distribution); else logits."""
    return "values" if math.isnan(logits.kl) else "logits"


def _kl_part(logits: LogitsCheck) -> str:
    return "" if math.isnan(logits.kl) else f", KL {fmt(logits.kl)}"


# -- the verdict ---------------------------------------------------------------------------------------
def verdict(checks: list[Check], logits: LogitsCheck | None) -> str:
    failed = [c for c in checks if not c.passed]
    bad_logits = logits is not None and not logits.passed
    tail = "" if logits is None else (f"; {_outputs_word(logits)} max abs {fmt(logits.figures.max_abs)}"
                                      f"{_kl_part(logits)}")
    if failed or bad_logits:
        named = [f"{c.name} ({c.reason})" for c in failed[:VERDICT_NAMES]]
        if len(failed) > VERDICT_NAMES:
            named.append(f"and {len(failed) - VERDICT_NAMES} more")
        if bad_logits:
            named.append(f"logits ({logits.reason})")
        return f"verify: FAIL {len(failed)} of {len(checks)} tensors: {', '.join(named)}"
    return f"verify: PASS {len(checks)} tensors {_pass_detail(checks)}{tail}"


def tally(checks: list[Check]) -> dict[str, int]:
    """The counts the verdict line states, and the JSON report with it (one definition for both)."""
    return {
        "tensors": len(checks),
        "passed": sum(c.passed for c in checks),
        "failed": sum(not c.passed for c in checks),
        "bit_exact": sum(c.outcome == "bit-exact" and not c.note for c in checks),
        "within_tolerance": sum(c.outcome == "within tolerance" and not c.note for c in checks),
        "within_fp8_bound": sum(c.passed and c.fp8_bound is not None and not c.note for c in checks),
        "tied_heads": sum(bool(c.note) for c in checks),
        "cast": sum(bool(c.cast) for c in checks),
        "not_in_reference": sum(c.passed and c.outcome == "not in reference" for c in checks),
    }


def _pass_detail(checks: list[Check]) -> str:
    counts = tally(checks)
    parts = [f"{counts['bit_exact']} bit-exact"] if counts["bit_exact"] else []
    if counts["within_tolerance"]:
        parts.append(f"{counts['within_tolerance']} within tolerance")
    # counts["within_fp8_bound"], by the kind of weight its outcome names ("within FP8 bound"), as they come
    for outcome in dict.fromkeys(c.outcome for c in checks if c.passed and c.fp8_bound is not None and not c.note):
        kind = outcome.removeprefix("within ").removesuffix(" bound")
        bounded = [c.fp8_bound for c in checks if c.outcome == outcome and not c.note]
        parts.append(f"{len(bounded)} {kind} weights within the {kind} bound, dequantized (at most "
                     f"{fmt(max(bounded))} of it)")
    if counts["not_in_reference"]:
        parts.append(f"{counts['not_in_reference']} not in the reference: its multi-token-prediction layer")
    tied = [c.name for c in checks if c.note]
    if tied:
        parts.append(f"{len(tied)} tied head ({', '.join(tied)})")
    casts = sorted({c.cast for c in checks if c.cast})
    if casts:
        parts.append(f"{counts['cast']} compared after casting the reference {', '.join(casts)}")
    if parts == [f"{len(checks)} bit-exact"]:
        return "bit-exact"
    return "(" + ", ".join(parts) + ")"


# -- the table -----------------------------------------------------------------------------------------
def worst(checks: list[Check], rows: int = TABLE_ROWS) -> list[Check]:
    """Failures first, then the largest max abs diff; bit-exact passes are not worth a row."""
    failed = [c for c in checks if not c.passed]
    inexact = [c for c in checks if c.passed and not c.bit_exact and c.figures is not None]
    inexact.sort(key=lambda c: -_sortable(c.figures.max_abs))
    failed.sort(key=lambda c: -_sortable(c.figures.max_abs) if c.figures else -math.inf)
    return (failed + inexact)[:rows]


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def table(checks: list[Check]):
    from rich.table import Table  # here, not at the top: a verify's rounds run without rich (as merge's do)

    t = Table(title=f"worst {len(checks)} tensor(s)", title_justify="left")
    t.add_column("tensor", no_wrap=True)  # names are what the user searches for: never broken
    for col in ("shape", "dtype", "max abs", "max rel", "mean abs", "cosine"):
        t.add_column(col, justify="right")
    t.add_column("result", no_wrap=True)
    for c in checks:
        f = c.figures
        numbers = [fmt(f.max_abs), fmt(f.max_rel), fmt(f.mean_abs), f"{f.cosine:.6f}"] if f else ["-"] * 4
        dtype = c.dtype or c.reference_dtype or "-"
        if c.cast:
            dtype = c.cast
        shape = c.shape if c.shape is not None else c.reference_shape
        result = f"[green]{c.outcome}[/]" if c.passed else f"[red]FAIL[/] {c.outcome}"  # the why: in the verdict
        t.add_row(_escape(c.name), "x".join(map(str, shape or ())) or "-", dtype, *numbers, result)
    return t


def _escape(text: str) -> str:
    return text.replace("[", r"\[")


def print_report(checks: list[Check], logits: LogitsCheck | None, *, quiet: bool, merged_from: str | None = None,
                 notes: tuple[str, ...] = (), reference_from: str | None = None,
                 reference_notes: tuple[str, ...] = (), totals: tuple[str, ...] = ()) -> None:
    """`merged_from`: the checkpoint's format when it was merged in memory, `notes` what that merge said;
    `reference_from`, `reference_notes`: the same of the reference when it was a checkpoint too; `totals`: the
    summary lines printed above the verdict (totals.py: names both ways, least cosine)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=max(120, Console().width))
    if (merged_from or reference_from) and not quiet:
        what = " and ".join([*([f"{merged_from} checkpoint"] if merged_from else []),
                             *([f"{reference_from} reference checkpoint"] if reference_from else [])])
        notes = (*notes, *(f"reference: {n}" for n in reference_notes))
        console.print(f"{what} merged in memory, nothing written" + ("; merge's notes:" if notes else ""),
                      markup=False, soft_wrap=True)
        for note in notes:
            console.print(f"note: {note}", markup=False, soft_wrap=True)
    rows = worst(checks)
    if rows and not quiet:
        shown = table(rows)
        if not console.is_terminal:  # a log file has no width: let the table take what it needs, unbroken
            wanted = Measurement.get(console, console.options.update_width(1000), shown).maximum
            console.width = max(console.width, wanted)
        console.print(shown)
    if logits is not None and not quiet:
        f = logits.figures
        console.print(f"{_outputs_word(logits)}: {logits.input_shape[0]}x{logits.input_shape[1]} tokens in "
                      f"{logits.dtype}: max abs {fmt(f.max_abs)}, cosine {f.cosine:.6f}{_kl_part(logits)}; "
                      f"{logits.note}", markup=False, soft_wrap=True)
    failed = [c for c in checks if not c.passed]
    if len(failed) > VERDICT_NAMES:
        for c in failed:
            console.print(f"fail: {c.name}: {c.reason}", markup=False, soft_wrap=True)
    if any(c.outcome == "dtype" for c in failed):
        console.print(CAST_HINT, markup=False, soft_wrap=True)
    for line in () if quiet else totals:
        console.print(line, markup=False, soft_wrap=True)
    console.print(verdict(checks, logits), markup=False, soft_wrap=True)


# -- JSON ----------------------------------------------------------------------------------------------
def report_json(*, merged: str, reference: str, crit: Criteria, checks: list[Check], logits: LogitsCheck | None,
                run: dict, totals: dict | None = None) -> str:
    """Every tensor's figures, and `totals` (totals.py's totals_json) when given. `run` (processes, device,
    seconds) is the only part that depends on how verify was launched."""
    data = {
        "verdict": "PASS" if all(c.passed for c in checks) and (logits is None or logits.passed) else "FAIL",
        "summary": verdict(checks, logits),
        "merged": merged,
        "reference": reference,
        "criteria": asdict(crit),
        "counts": tally(checks),
        **({"totals": totals} if totals is not None else {}),
        "tensors": [asdict(c) for c in checks],
        "logits": asdict(logits) if logits else None,
        "run": run,
    }
    return json.dumps(_finite(data), indent=2) + "\n"


def _finite(obj):
    """JSON has no NaN or infinity: write them as strings so any JSON reader accepts the report."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
