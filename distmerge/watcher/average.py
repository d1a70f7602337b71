"""`watch --average-last K`: after each pass's steps, the average of the last K finished steps' checkpoints (issue
#36), written to OUT/average-last-K/<sub> (sub: the checkpoint's folder inside its step, `actor` for verl's
`global_step_N/actor`; none when the step folder is the checkpoint). It is `merge --average` of those K inputs, oldest
step first, weights 1/K (docs/average.md), handed to the same step merge as any step (step.py: its lock, --resume).

A new finished step changes the last K: the merge's --resume finds other inputs in the output's record and writes the
average again; while the last K are the same, the output is already this merge and stays untouched. Fewer than K
finished steps: a line that says how many there are, nothing written.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path, PurePosixPath

from distmerge.average.units import AverageOptions
from distmerge.engine.run import MergeOptions
from distmerge.output import beneath
from distmerge.watcher import steps
from distmerge.watcher.outcome import TOO_FEW, Outcome
from distmerge.watcher.step import Target


def folder(k: int) -> str:
    """Where the average goes under OUT."""
    return f"average-last-{k}"


def lines(k: int, found: list[steps.Step], template: MergeOptions, run: Path,
          output: Path | str) -> list[Target | Outcome]:
    """One target per checkpoint folder every one of the last K finished steps holds, or a waiting line."""
    done = [s for s in found if s.finished and s.number is not None and s.checkpoints and not s.as_hf]
    if len(done) < k:
        return [Outcome(name=folder(k), status=TOO_FEW, detail=f"{len(done)} of {k} steps finished")]
    last = done[-k:]
    subs = [_subs(s) for s in last]
    common = [sub for sub in subs[0] if all(sub in each for each in subs[1:])]
    return [_target(k, [run / s.rel / sub for s in last], sub, template, output, last[-1].number) for sub in common]


def _subs(step: steps.Step) -> list[str]:
    """Its checkpoints' folders inside the step ("" for the step folder itself)."""
    return ["" if name == step.rel else str(PurePosixPath(name).relative_to(step.rel)) for name in step.checkpoints]


def _target(k: int, inputs: list[Path], sub: str, template: MergeOptions, output: Path | str,
            number: int | None) -> Target:
    name = f"{folder(k)}/{sub}" if sub else folder(k)
    out = beneath(output, name)
    settings = replace(template.settings, output=out, average=AverageOptions(on=True))
    opts = replace(template, input=replace(template.input, locations=tuple(inputs)), output=out, settings=settings,
                   resume=True)
    return Target(name=name, number=number, opts=opts)
