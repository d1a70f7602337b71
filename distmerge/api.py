"""The library API, `distmerge.merge()`, `distmerge.verify()`, `distmerge.watch()` and
`distmerge.import_checkpoint()`, and what the command line shares with it.

    keywords --options.from_keywords--> values --merge_request--> engine.run.MergeOptions --run_merge--> MergeResult
    argv     --argparse (cli.py)------> values --verify_request-> verify.VerifyOptions --verify_and_write--> ...
                                        values --watch_request--> watcher.passes.WatchOptions --run_watch--> WatchResult
                                        values --import_request-> importer.request.ImportOptions --run_import--> ...

`values` are the options by name, parsed the same way on both paths (options/: the one table of options, from
which argparse and docs/cli.md's table come; these functions' keywords are written out, for editors and type
checkers, and tests/test_options_agree.py checks them against the table). The command line (cli.py) is a layer
over this module: it parses, calls job_group and run_merge / verify_and_write, and alone turns errors into a line
and an exit status, installs signal handlers and freezes the GC.

Where it runs (every rank of a job makes the same call):

    a running torch.distributed job     the job's default group, or `group=`: borrowed, never destroyed
    (dist.is_initialized())             (comm.Comm.borrow: a gloo side group of ours beside an NCCL group,
                                        destroyed at the end); no signal handler, no GC, dtype, RNG, CUDA
                                        device or environment change
    torchrun's environment, no group    a group of its own, destroyed at the end (as `torchrun -m distmerge`)
    neither                             one process (as `python -m distmerge`)

Errors are the typed exceptions of distmerge.errors, raised on every rank, their messages in the API's spelling
(`overwrite=True`, `dtype`: api_spelling) where the command line's name its flags. Nothing is printed unless
`progress=True` (rank 0: progress and summary); notes go to the `distmerge` logger.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from distmerge import options, output_options
from distmerge.errors import DistmergeError
from distmerge.options.cli_options import base_model_dir, format_options, output_settings, reference_format_options

if TYPE_CHECKING:
    import torch.distributed

    from distmerge.distributed.comm import Comm
    from distmerge.engine.inputs import InputSpec
    from distmerge.engine.run import MergeOptions
    from distmerge.importer.request import ImportOptions, ImportResult
    from distmerge.results import MergeResult
    from distmerge.verifier.listing import VerifyOptions
    from distmerge.verifier.run import VerifyResult
    from distmerge.watcher.outcome import WatchResult
    from distmerge.watcher.passes import WatchOptions

log = logging.getLogger("distmerge")

# The options a request does not take under their own name: how the call runs and what it shows (job_group,
# run_merge, verify_and_write, the command line), and what the request's computed fields are made of.
RUNNING = frozenset({"device", "timeout", "progress", "group", "quiet", "debug", "json_summary", "verify_against",
                     "plot"})
# (and each option that shapes the output, output_options.py: they are made into the request's `settings`)
COMPUTED = frozenset({"budget", "atol", "rtol", "min_cosine"})
# ... and the input options, made into the request's engine.inputs.InputSpec (one per side of a verify: input_spec)
DESCRIBED = frozenset({"input", "merged", "reference", "format", "hf_config", "reference_format",
                       "reference_hf_config"})
# watch's own: the WatchOptions around the merge
WATCHING = frozenset({"once", "poll", "steps", "hf_upload_path", "average_last"})


def merge(input: str | os.PathLike | list[str | os.PathLike], output: str | os.PathLike, *, format: str = "auto",
          hf_config: str | os.PathLike | None = None, tag: int | str | None = None,
          weights: int | str | None = None, iteration: int | str | None = None, step: int | str | None = None,
          ema_key: int | str | None = None, dtype: str = "keep", quantize: str | None = None,
          max_shard_size: int | str = "5GB", lora: str = "auto", lora_alpha: float | None = None,
          base_model: str | None = None, average: bool = False, average_weights: int | str | None = None,
          overwrite: bool = False, resume: bool = False, checksum: bool = False, device: str = "auto",
          timeout: float = 600.0, budget: int | str = "128MiB", progress: bool = False,
          group: torch.distributed.ProcessGroup | None = None) -> MergeResult:
    given = dict(locals())  # first, so it holds the arguments alone (options.from_keywords checks and parses them)
    with api_spelling("merge"):
        values = options.from_keywords("merge", given)
        opts = merge_request(values)
        with as_found(), job_group(values) as comm:
            result = run_merge(opts, comm, show=values["progress"])
            rank = comm.rank
    if not values["progress"]:  # what the progress would have said (--resume's line), and the notes
        _log_notes(rank, [result.resume] if result.resume else [])
    _log_notes(rank, result.notes)
    return result


def verify(merged: str | os.PathLike | list[str | os.PathLike], reference: str | os.PathLike, *,
           atol: float | None = None, rtol: float | None = None, min_cosine: float | None = None,
           logits: bool = False, json: str | os.PathLike | None = None, plot: str | os.PathLike | None = None,
           format: str = "auto", hf_config: str | os.PathLike | None = None, tag: int | str | None = None,
           weights: int | str | None = None, iteration: int | str | None = None, step: int | str | None = None,
           ema_key: int | str | None = None, reference_format: str = "auto",
           reference_hf_config: str | os.PathLike | None = None, reference_tag: int | str | None = None,
           reference_weights: int | str | None = None, reference_iteration: int | str | None = None,
           reference_step: int | str | None = None, reference_ema_key: int | str | None = None,
           dtype: str = "keep", quantize: str | None = None, max_shard_size: int | str = "5GB", lora: str = "auto",
           lora_alpha: float | None = None, base_model: str | None = None, average: bool = False,
           average_weights: int | str | None = None, device: str = "auto", timeout: float = 600.0,
           budget: int | str = "128MiB", progress: bool = False,
           group: torch.distributed.ProcessGroup | None = None) -> VerifyResult:
    given = dict(locals())  # first, so it holds the arguments alone
    from distmerge.verifier.run import verify_and_write

    with api_spelling("verify"):
        values = options.from_keywords("verify", given)
        opts = verify_request(values)
        with as_found(), job_group(values) as comm:
            result = verify_and_write(opts, comm, plot=values["plot"], show=values["progress"])
            rank = comm.rank
    _log_notes(rank, [*result.notes, *result.reference_notes])
    return result


def watch(input: str | os.PathLike, output: str | os.PathLike, *, once: bool = False, poll: float = 30.0,
          steps: int | str = "all", average_last: int | str | None = None, hf_upload_path: str | None = None,
          format: str = "auto", hf_config: str | os.PathLike | None = None, weights: int | str | None = None,
          ema_key: int | str | None = None, dtype: str = "keep", quantize: str | None = None,
          max_shard_size: int | str = "5GB", lora: str = "auto", lora_alpha: float | None = None,
          base_model: str | None = None, checksum: bool = False, device: str = "auto", timeout: float = 600.0,
          budget: int | str = "128MiB", progress: bool = False,
          group: torch.distributed.ProcessGroup | None = None) -> WatchResult:
    given = dict(locals())  # first, so it holds the arguments alone
    with api_spelling("watch"):
        values = options.from_keywords("watch", given)
        request = watch_request(values)
        with as_found(), job_group(values) as comm:
            result = run_watch(request, comm, show=values["progress"])
    return result


def import_checkpoint(input: str | os.PathLike, output: str | os.PathLike, *,
                      hf_config: str | os.PathLike | None = None, to: str = "megatron", tp: int | str = 1,
                      pp: int | str = 1, vpp: int | str | None = None,
                      decoder_first_pipeline_num_layers: int | str | None = None,
                      decoder_last_pipeline_num_layers: int | str | None = None, ep: int | str = 1,
                      make_vocab_size_divisible_by: int | str = 128, overwrite: bool = False,
                      timeout: float = 600.0, progress: bool = False,
                      group: torch.distributed.ProcessGroup | None = None) -> ImportResult:
    given = dict(locals())  # first, so it holds the arguments alone
    with api_spelling("import"):
        values = options.from_keywords("import", given)
        opts = import_request(values)
        with as_found(), job_group({**values, "device": "cpu"}) as comm:  # import reads and writes on the CPU
            result = run_import(opts, comm, show=values["progress"])
    return result


# The docstrings list each keyword with its flag and help, from the table (options.docstring); the signatures
# above are written out so that editors and type checkers see them, and tests/test_options_agree.py checks them
# against the table (a new row of OPTIONS fails it until its keyword is added here).
merge.__doc__ = options.docstring("merge", """Merge the checkpoint `input` into a Hugging Face model in `output`, as
`distmerge merge` does; the options are the command's (docs/api.md). `input` may be a list of checkpoints of one
model with `average=True`: their weighted average (docs/average.md). Returns the run's figures (the same on every
rank). Errors: distmerge.errors' exceptions, on every rank.""")
watch.__doc__ = options.docstring("watch", """Merge each finished checkpoint under the run folder `input` into `output`,
as `distmerge watch` does (docs/watch.md): `once=True` merges what is finished and returns; otherwise it watches,
every `poll` seconds, until interrupted (KeyboardInterrupt), and returns what it did. Returns the WatchResult (the
same on every rank): each step's outcome. A step that fails is an outcome, not an error.""")
verify.__doc__ = options.docstring("verify", """Compare `merged` (a merged model, or a checkpoint merged in memory)
with `reference` (a Hugging Face model, or a checkpoint merged in memory, read with the reference_ options), as
`distmerge verify` does. Returns the VerifyResult (`.passed`, `.checks`): a failed comparison
is a result, not an error. `json`, `plot`: written by rank 0; the report is printed only with `progress=True`.""")
import_checkpoint.__doc__ = options.docstring("import", """Write the Hugging Face model `input` (or a training
checkpoint distmerge merges) as the checkpoint a training job starts from, in `output`, as `distmerge import` does
(docs/import.md): Megatron-LM torch_dist at the TP, PP (VPP, uneven stages) and EP given, or with
`to="torchtitan"` a DCP step-0 folder. Named so because `import` is Python's keyword. Returns the ImportResult (the
same on every rank). Errors: distmerge.errors' exceptions, on every rank, before anything is written.""")


@contextmanager
def api_spelling(command: str) -> Iterator[None]:
    """An error raised through distmerge.<command>() names the API's arguments where its message names the command
    line's flags (options.api_spelling: `pass --overwrite` is `pass overwrite=True`); the same exception, re-raised.
    The command line calls below this and keeps its flags."""
    try:
        yield
    except DistmergeError as err:
        if err.args and isinstance(err.args[0], str):
            err.args = (options.api_spelling(err.args[0], command), *err.args[1:])
        raise


# -- what the command line shares ----------------------------------------------------------------------------------


def merge_request(values: Mapping[str, Any]) -> MergeOptions:
    """engine.run.MergeOptions from the parsed options (each option of its own name goes to its field)."""
    from distmerge.engine.run import MergeOptions

    return _fill(MergeOptions, values, input=input_spec(values, "input"), settings=output_settings(values))


def watch_request(values: Mapping[str, Any]) -> WatchOptions:
    """watch.passes.WatchOptions from the parsed options: the merge of every step (merge_request's, with the run's
    folder as its input for now), and watch's own. A run folder that is not one is refused here, before a group."""
    from distmerge.watcher.passes import WatchOptions, check_places

    run, output = values["input"], values["output"]
    check_places(run, output, values["hf_upload_path"])
    template = merge_request({k: v for k, v in values.items() if k not in WATCHING})
    return WatchOptions(run=run, output=output, template=template, once=values["once"], poll=values["poll"],
                        steps=values["steps"], upload=values["hf_upload_path"], average_last=values["average_last"])


def run_watch(opts: WatchOptions, comm: Comm, *, show: bool) -> WatchResult:
    """Collective: the watch; with `show`, rank 0 prints each pass's table and the merges' progress."""
    from distmerge.watcher.passes import watch as watch_passes

    return watch_passes(opts, comm, show)


def verify_request(values: Mapping[str, Any]) -> VerifyOptions:
    """verify.VerifyOptions from the parsed options. The options that shape the output given may change the
    comparison (output_options.criteria): a --dtype asks for the cast, values must equal the reference cast the same
    way (as merge --verify-against)."""
    from distmerge.verifier.listing import VerifyOptions
    from distmerge.verifier.report import Criteria

    settings = output_settings(values)
    crit = Criteria(atol=values["atol"], rtol=values["rtol"], min_cosine=values["min_cosine"],
                    **output_options.criteria(settings))
    return _fill(VerifyOptions, values, criteria=crit, settings=settings, merged=input_spec(values, "merged"),
                 reference=input_spec(values, "reference"))


def input_spec(values: Mapping[str, Any], side: str) -> InputSpec:
    """merge's --input or verify's --merged (`side`), read with the input options; verify's --reference with their
    --reference- twins (it has no --base-model)."""
    from distmerge.engine.inputs import InputSpec

    if side == "reference":
        return InputSpec(locations=values["reference"], format=values["reference_format"],
                         hf_config=values["reference_hf_config"], format_options=reference_format_options(values))
    return InputSpec(locations=values[side], format=values["format"], hf_config=values["hf_config"],
                     format_options=format_options(values), base_model=base_model_dir(values))


def _fill(cls: type, values: Mapping[str, Any], **computed: Any) -> Any:
    """`cls` with each value under its own name and the computed fields; a value with no home is a bug (an option
    added to options.OPTIONS and to no request: tests/test_options_agree.py)."""
    names = {f.name for f in fields(cls)}
    homeless = (set(values) - names - RUNNING - COMPUTED - DESCRIBED - output_options.names()
                - set(options.format_option_names())
                - set(options.reference_format_option_names()))
    assert not homeless, f"options {sorted(homeless)} reach no field of {cls.__name__}"
    return cls(**{k: v for k, v in values.items() if k in names and k not in computed}, **computed)


def import_request(values: Mapping[str, Any]) -> ImportOptions:
    """importer.request.ImportOptions from the parsed options of `import` (its own table, options/import_options.py)."""
    from distmerge.importer.plan import Layout
    from distmerge.importer.request import ImportOptions, local_folder

    layout = Layout(tp=values["tp"], pp=values["pp"], ep=values["ep"], vpp=values["vpp"],
                    first=values["decoder_first_pipeline_num_layers"], last=values["decoder_last_pipeline_num_layers"],
                    divisible_by=values["make_vocab_size_divisible_by"])
    hf_config = values["hf_config"]
    return ImportOptions(input=values["input"], output=values["output"], layout=layout, to=values["to"],
                         overwrite=values["overwrite"],
                         hf_config=None if hf_config is None else local_folder(hf_config, "--hf-config"))


def run_import(opts: ImportOptions, comm: Comm, *, show: bool) -> ImportResult:
    """Collective: the import; with `show`, rank 0 prints its summary line."""
    from distmerge.importer.run import run_import as import_model
    from distmerge.importer.run import summary

    result = import_model(opts, comm)
    if show and comm.rank == 0:
        print(summary(result, opts), flush=True)
    return result


def run_merge(opts: MergeOptions, comm: Comm, *, show: bool) -> MergeResult:
    """Collective: the merge; with `show`, rank 0 prints the progress and the summary."""
    from distmerge.engine.run import merge as engine_merge
    from distmerge.report import Progress, print_summary

    result = engine_merge(opts, comm, Progress(enabled=show and comm.rank == 0))
    if show and comm.rank == 0:
        print_summary(result)
    return result


@contextmanager
def job_group(values: Mapping[str, Any], on_silence: Callable[[str, bool], None] | None = None) -> Iterator[Comm]:
    """The Comm of one call: the running job's group when there is one (borrowed: left up), else a group of our
    own under torchrun, else one process. `on_silence`: a command's (Comm's): the watchdog of a group of our own
    ends the process with its verdict."""
    from distmerge.distributed.comm import process_group, resolve_device

    group, device, timeout = values.get("group"), values["device"], values["timeout"]
    if group is not None or _initialized():
        with process_group(device=device, timeout_s=timeout, borrow=True, group=group) as comm:
            yield comm
    else:
        with process_group(device=resolve_device(device), timeout_s=timeout, on_silence=on_silence) as comm:
            yield comm


@contextmanager
def as_found() -> Iterator[None]:
    """The process as the call found it, in what a library could change unasked: Python's global `random` state
    (a library imported or called during the merge may draw from it), and no walk of the input kept
    (input_source.fresh_session)."""
    from distmerge.input import source as input_source

    state = random.getstate()
    try:
        with input_source.fresh_session():
            yield
    finally:
        random.setstate(state)


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _log_notes(rank: int, notes) -> None:
    """Rank 0's: every rank has the same."""
    for note in notes if rank == 0 else ():
        log.info("%s", note)
