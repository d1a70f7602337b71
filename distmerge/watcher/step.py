"""One checkpoint of a finished step: RUN/<rel> merged into OUT/<rel> exactly as `distmerge merge` would (the same
engine, the watch's options, --resume), once. Every rank makes the same calls:

    root_only   rank 0: is OUT/<rel> this merge already (done.py)? then it is left untouched
    the merge   engine.run.merge, collective; its lock (output/lock.py) held by a live merge elsewhere is
                errors.OutputLocked on every rank: another watcher has the step, left to it
    root_only   rank 0, --hf_upload_path: the finished output sent to the hub, on the step's branch
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from distmerge.distributed.comm import Comm
from distmerge.engine.run import MergeOptions
from distmerge.engine.run import merge as engine_merge
from distmerge.errors import DistmergeError, Interrupted, OutputLocked
from distmerge.input import source as input_source
from distmerge.output import beneath
from distmerge.output.names import RECORDS
from distmerge.report import Progress
from distmerge.watcher import done, summary
from distmerge.watcher.outcome import DONE, ELSEWHERE, FAILED, INTERRUPTED, MERGED, RESUMED, UPLOAD_FAILED, Outcome

UPLOADED = f"{RECORDS}/uploaded.json"  # what --hf_upload_path sent, beside --resume's records


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where a step's checkpoint is merged, and how."""

    name: str  # relative to RUN, and to OUT
    opts: MergeOptions  # the watch's merge options, with this input and output, --resume
    number: int | None = None


def target(template: MergeOptions, run: Path, output: Path | str, name: str, number: int | None) -> Target:
    out = beneath(output, name)
    settings = replace(template.settings, output=out)  # what a LoRA adapter names its base after, as merge does
    spec = replace(template.input, locations=(run / name,))
    return Target(name=name, number=number, opts=replace(template, input=spec, output=out, settings=settings,
                                                         resume=True))


class QuietStart(Progress):
    """The merge's progress, without --resume's line: the watch says what it found in its own words."""

    def say(self, line: str) -> None:
        pass


def merge(step: Target, comm: Comm, show: bool, upload: str | None) -> Outcome:
    """Collective: the step's outcome, the same on every rank. The step walks its input in a session of its own
    (input/source.py), dropped at its end: the next step's walk is its own."""
    with input_source.fresh_session():
        return _merge(step, comm, show, upload)


def _merge(step: Target, comm: Comm, show: bool, upload: str | None) -> Outcome:
    nbytes = comm.root_only(lambda: done.merged_bytes(step.opts))
    if nbytes is not None:
        return _uploaded(Outcome(name=step.name, number=step.number, status=DONE, nbytes=nbytes), step, comm,
                         upload)
    if show and comm.rank == 0:
        summary.say_merging(step.name, str(step.opts.output))
    start = time.perf_counter()
    try:
        result = engine_merge(step.opts, comm, QuietStart(enabled=show and comm.rank == 0))
    except OutputLocked:
        return Outcome(name=step.name, number=step.number, status=ELSEWHERE)
    except DistmergeError as err:
        return Outcome(name=step.name, number=step.number, status=FAILED, detail=str(err))
    except KeyboardInterrupt as stop:
        raise StepInterrupted(Outcome(name=step.name, number=step.number, status=INTERRUPTED,
                                      seconds=time.perf_counter() - start, detail=_kept(stop))) from stop
    kept, files = result.resumed_files, len(result.files)
    status = DONE if result.already_complete else RESUMED if kept else MERGED
    detail = f"kept {kept} of {files} file(s) an earlier merge finished" if status == RESUMED else ""
    outcome = Outcome(name=step.name, number=step.number, status=status, nbytes=result.total_bytes,
                      seconds=result.seconds, detail=detail)
    return _uploaded(outcome, step, comm, upload)


class StepInterrupted(KeyboardInterrupt):
    """A step's merge stopped by SIGTERM or Ctrl-C, with its outcome (every rank)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__()
        self.outcome = outcome


def _kept(stop: KeyboardInterrupt) -> str:
    if isinstance(stop, Interrupted) and stop.finished is not None:
        return f"{stop.finished} of {stop.planned} file(s) finished and kept; the next watch resumes it"
    return "the files it finished are kept; the next watch resumes it"


def branch(name: str) -> str:
    """The hub branch of a step: its name under RUN, `/` as `-` (`global_step_200/actor` -> global_step_200-actor)."""
    return name.replace("/", "-")


def _uploaded(outcome: Outcome, step: Target, comm: Comm, repo: str | None) -> Outcome:
    """--hf_upload_path: rank 0 sends the finished output to `repo` on the step's branch, once (UPLOADED)."""
    if repo is None:
        return outcome
    failed = comm.root_only(lambda: _upload(Path(step.opts.output), repo, branch(step.name)))
    if failed:
        return replace(outcome, status=UPLOAD_FAILED, detail=failed)
    return replace(outcome, detail=f"on {repo}@{branch(step.name)}" if outcome.status != DONE else outcome.detail)


def _upload(folder: Path, repo: str, revision: str) -> str:
    """Rank 0: the error's line, or '' once sent (or sent before)."""
    from distmerge.output.hub import upload

    record = folder / UPLOADED
    try:
        sent = json.loads(record.read_text())
    except (OSError, ValueError):
        sent = {}
    if isinstance(sent, dict) and (sent.get("repo"), sent.get("revision")) == (repo, revision):
        return ""
    try:
        url = upload(folder, repo, private=True, revision=revision)  # a repository it creates is private
    except DistmergeError as err:
        return str(err)
    record.write_text(json.dumps({"repo": repo, "revision": revision, "url": url}, indent=1) + "\n")
    return ""
