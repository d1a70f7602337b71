"""`verify --plot PATH` (rank 0, after the comparison): a PNG of how far each layer's tensors are from the
reference, one series per kind (totals.py's KINDS), layer numbers from the names (model.layers.N...) on the x axis.

    top     max rel diff: max over the elements of |merged - ref| / |ref| (where ref != 0), the worst tensor of
            that kind in that layer: the --rtol that layer would need
    bottom  1 - cosine similarity, the least cosine of that kind in that layer (0 = same direction); with
            --min-cosine C, a dashed line at 1 - C: points above it fail

Both on a log scale; 0 (bit-exact) and anything below FLOOR is drawn on the FLOOR line, NaN as a red x at the
top. Tensors without a layer number sit at the ends: embeddings left ("embed"), the rest (final norm, head) right
("final"). Names on one side only have no figures and are not drawn: the title gives the name coverage.
matplotlib is optional (`pip install 'distmerge[plot]'`), imported here only, with the Agg canvas (no display)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from distmerge.errors import DistmergeError
from distmerge.verifier.report import Check, Criteria
from distmerge.verifier.totals import KIND_NAMES, OTHER, kind_of, layer_of, percent, totals

FLOOR = 1e-10
SIZE = (10.0, 6.4)  # inches, at DPI: a 1000 x 640 PNG
DPI = 100
DODGE = 0.06  # kinds side by side around each x, so that equal points (a clean merge: all on the floor) all show
COLORS = {"attention": "tab:blue", "MLP": "tab:orange", "norms": "tab:green", "embeddings/head": "tab:red",
          OTHER: "tab:gray"}
AT_START = r"embed|(^|\.)(wte|wpe)\."  # a tensor without a layer number drawn left of layer 0; the rest right


class PlotError(DistmergeError):
    """--plot cannot be drawn: matplotlib is missing, or the PNG cannot be written."""


def require_matplotlib() -> None:
    """Before the comparison (hours on a large model): say at once what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'distmerge[plot]'") from None


@dataclass(frozen=True, kw_only=True)
class Point:
    x: int
    kind: str
    max_rel: float
    gap: float  # 1 - cosine


def points(checks: list[Check]) -> tuple[list[Point], int]:
    """The worst figures per (position, kind), and the position of "final" (one past the last layer)."""
    compared = [c for c in checks if c.figures is not None]
    layers = [n for n in map(layer_of, (c.name for c in compared)) if n is not None]
    final = max(layers, default=-1) + 1
    worst: dict[tuple[int, str], Point] = {}
    for c in compared:
        layer = layer_of(c.name)
        x = layer if layer is not None else (-1 if re.search(AT_START, c.name) else final)
        kind = kind_of(c.name)
        new = Point(x=x, kind=kind, max_rel=c.figures.max_rel, gap=1.0 - c.figures.cosine)
        old = worst.get((x, kind))
        worst[(x, kind)] = new if old is None else Point(x=x, kind=kind, max_rel=_worse(old.max_rel, new.max_rel),
                                                         gap=_worse(old.gap, new.gap))
    return sorted(worst.values(), key=lambda p: (p.x, p.kind)), final


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def write_plot(path: Path, checks: list[Check], crit: Criteria, *, title: str) -> None:
    require_matplotlib()
    from matplotlib.figure import Figure  # the Agg canvas, not pyplot: no display, no global state

    pts, final = points(checks)
    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    _panel(top, pts, final, "max_rel", "max rel diff")
    top.set_title("max rel diff: max over the elements of |merged - ref| / |ref| (ref != 0); the worst tensor of "
                  "each kind in each layer", fontsize=9, loc="left")
    _panel(bottom, pts, final, "gap", "1 - cosine")
    bottom.set_title("1 - cosine similarity: the least cosine of each kind in each layer (0: same direction)",
                     fontsize=9, loc="left")
    if crit.min_cosine is not None and 1 - crit.min_cosine > 0:
        bottom.axhline(1 - crit.min_cosine, color="black", linestyle="--", linewidth=1,
                       label=f"--min-cosine {crit.min_cosine:g}")
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _x_axis(bottom, final)
    t = totals(checks, crit)
    least = "-" if t.least is None else f"{t.least.cosine:.6f}"
    fig.suptitle(f"{title}\n{t.compared} tensors compared; names: {percent(t.coverage.reference_in_merged)} "
                 f"of the reference's in merged, {percent(t.coverage.merged_in_reference)} of merged's in the "
                 f"reference; least cosine {least}", fontsize=10)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    except OSError as err:
        raise PlotError(f"--plot {path}: cannot write it ({err.strerror or err}): pass a writable path") from None


def _panel(ax, pts: list[Point], final: int, field: str, label: str) -> None:
    """One series per kind: a line through the layers, the ends ("embed", "final") as dots of its colour."""
    top = max([getattr(p, field) for p in pts if math.isfinite(getattr(p, field))] + [FLOOR * 10]) * 10
    kinds = (*KIND_NAMES, OTHER)
    for i, kind in enumerate(kinds):
        shift = (i - (len(kinds) - 1) / 2) * DODGE
        mine = [(p.x + shift, getattr(p, field)) for p in pts if p.kind == kind]
        inside = [(x, _drawn(v, top)) for x, v in mine if -0.5 < x < final - 0.5]
        ends = [(x, _drawn(v, top)) for x, v in mine if not -0.5 < x < final - 0.5]
        style = {"marker": "o", "markersize": 4, "color": COLORS[kind]}
        if inside:
            ax.plot(*zip(*inside, strict=True), linewidth=1.2, label=kind, **style)
        if ends:
            ax.plot(*zip(*ends, strict=True), linestyle="none", label=None if inside else kind, **style)
        nan = [(x, top) for x, v in mine if math.isnan(v)]
        if nan:
            ax.plot(*zip(*nan, strict=True), linestyle="none", marker="x", markersize=9, color="red", zorder=3)
    ax.axhline(FLOOR, color="gray", linestyle=":", linewidth=1, label=f"0 (bit-exact), or < {FLOOR:g}")
    ax.set_ylim(FLOOR / 5, top * 5)  # before the log scale: all points on the floor would give an empty range
    ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.grid(True, which="major", alpha=0.3)


def _drawn(value: float, top: float) -> float:
    return top if math.isnan(value) else max(value, FLOOR)


def _x_axis(ax, final: int) -> None:
    layers = list(range(final))
    step = max(1, math.ceil(len(layers) / 32))  # at most ~32 layer labels
    ticks = [-1, *layers[::step], final]
    ax.set_xticks(ticks, ["embed", *map(str, layers[::step]), "final"])
    ax.set_xlim(-1.5, final + 0.5)
    ax.set_xlabel("layer (model.layers.N)")
