"""The library API: `distmerge.merge()` and `distmerge.verify()`, over the functions the CLI runs (engine.merge,
verify.run).

Where it runs (every rank of a job makes the same call):

    a running torch.distributed job     the job's default group, or `group=` (gloo, CPU): borrowed, never
    (dist.is_initialized())             destroyed; no signal handler, no GC, dtype, RNG or environment change
    torchrun's environment, no group    a group of its own, destroyed at the end (as `torchrun -m distmerge`)
    neither                             one process (as `python -m distmerge`)

Errors are the typed exceptions of distmerge.errors, raised on every rank. Nothing is printed unless
`progress=True` (rank 0: progress and summary); notes go to the `distmerge` logger.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from distmerge.errors import InputError
from distmerge.results import MergeResult

log = logging.getLogger("distmerge")

Size = int | str  # bytes, or "5GB" / "512MiB" as on the command line
Option = int | str | None  # a format's own option (iteration, step, tag, weights): as on the command line
DEVICES = ("auto", "cpu", "cuda")
LORA_MODES = ("auto", "adapter", "merge")


def merge(input: str | os.PathLike, output: str | os.PathLike, *, format: str = "auto",
          hf_config: str | os.PathLike | None = None, dtype: str = "keep", max_shard_size: Size = "5GB",
          budget: Size = "128MiB", lora: str = "auto", lora_alpha: float | None = None,
          base_model: str | os.PathLike | None = None, overwrite: bool = False, resume: bool = False,
          checksum: bool = False, iteration: Option = None, step: Option = None, tag: Option = None,
          weights: Option = None, device: str = "auto", timeout: float = 600.0, progress: bool = False,
          group: Any = None) -> MergeResult:
    """Merge the checkpoint `input` into a Hugging Face model in `output`, as `distmerge merge` does; the options
    are the command's (docs/api.md). Returns the run's figures (the same on every rank)."""
    from distmerge.engine import MergeOptions
    from distmerge.engine import merge as run_merge
    from distmerge.report import Progress, print_summary

    opts = MergeOptions(input=_location(input), output=_location(output), format=_format(format),
                        hf_config=_path(hf_config),
                        format_options=_format_options(iteration=iteration, step=step, tag=tag, weights=weights),
                        settings=_settings(output, dtype, max_shard_size, budget, lora, lora_alpha, base_model),
                        base_model=_base_dir(base_model), overwrite=overwrite, resume=resume, checksum=checksum)
    with job_group(device, timeout, group) as comm:
        result = run_merge(opts, comm, Progress(enabled=progress and comm.rank == 0))
        if progress and comm.rank == 0:
            print_summary(result)
    for note in result.notes:
        log.info("%s", note)
    return result


def verify(merged: str | os.PathLike, reference: str | os.PathLike, *, atol: float | None = None,
           rtol: float | None = None, min_cosine: float | None = None, logits: bool = False,
           json: str | os.PathLike | None = None, plot: str | os.PathLike | None = None,
           reference_hf_config: str | os.PathLike | None = None, format: str = "auto",
           hf_config: str | os.PathLike | None = None, dtype: str = "keep", max_shard_size: Size = "5GB",
           budget: Size = "128MiB", lora: str = "auto", lora_alpha: float | None = None,
           base_model: str | os.PathLike | None = None, iteration: Option = None, step: Option = None,
           tag: Option = None, weights: Option = None, device: str = "auto", timeout: float = 600.0,
           progress: bool = False, group: Any = None):
    """Compare `merged` (a merged model, or a checkpoint merged in memory) with `reference`, as `distmerge verify`
    does. Returns the VerifyResult (`.passed`, `.checks`); a failed comparison is a result, not an error.
    `json`, `plot`: written by rank 0; the report is printed only with `progress=True`."""
    from distmerge.verify.listing import VerifyOptions
    from distmerge.verify.report import Criteria
    from distmerge.verify.run import verify_and_write

    crit = Criteria(atol=atol, rtol=rtol, min_cosine=min_cosine, accept_cast=dtype != "keep")
    opts = VerifyOptions(merged=Path(merged), reference=Path(reference), criteria=crit, logits=logits,
                         json=_path(json), quiet=False, format=_format(format), hf_config=_path(hf_config),
                         format_options=_format_options(iteration=iteration, step=step, tag=tag, weights=weights),
                         base_model=_base_dir(base_model), reference_hf_config=_path(reference_hf_config),
                         settings=_settings(Path(), dtype, max_shard_size, budget, lora, lora_alpha, base_model))
    with job_group(device, timeout, group) as comm:
        result = verify_and_write(opts, comm, plot=_path(plot), show=progress)
    for note in result.notes:
        log.info("%s", note)
    return result


@contextmanager
def job_group(device: str, timeout: float, group: Any = None) -> Iterator[Any]:
    """The Comm of one call: the running job's group when there is one (borrowed: left up), else a group of
    our own under torchrun, else one process."""
    from distmerge.comm import process_group, resolve_device

    _choose("device", device, DEVICES)
    in_job = group is not None or _initialized()
    if in_job and device == "cuda":
        raise InputError("device='cuda' inside a running job is not supported yet: the job's group is used on the "
                         "CPU (device='cpu' or 'auto')")
    with process_group(device="cpu" if in_job else resolve_device(device), timeout_s=timeout, borrow=in_job,
                       group=group) as comm:
        yield comm


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _choose(name: str, value: str, choices) -> str:
    if value not in choices:
        raise InputError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def _format(name: str) -> str:
    from distmerge.formats import registry

    return _choose("format", name, registry.choices())


def _location(value: str | os.PathLike) -> Path | str:
    """A folder, or an object-store URL kept as given (cli_options.location)."""
    return value if isinstance(value, str) and "://" in value else Path(value)


def _path(value: str | os.PathLike | None) -> Path | None:
    return None if value is None else Path(value)


def _base_dir(value: str | os.PathLike | None) -> Path | None:
    """base_model as a second input root: only when it names a folder (cli_options.base_model_dir)."""
    return Path(value) if value and Path(value).is_dir() else None


def _parsed(name: str, parse, value: Any) -> Any:
    try:
        return parse(str(value))
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise InputError(f"{name}={value!r}: {err}") from None


def _format_options(**given: Option) -> dict[str, Any]:
    """The formats' own options given (the ones left None are not passed), parsed as the command line parses."""
    from distmerge.formats import registry

    known = {opt.dest: opt for opt, _ in registry.options()}
    unknown = sorted(set(given) - set(known))
    if unknown:  # a format option the API does not name yet: a bug, caught by tests/test_api.py
        raise InputError(f"no format takes {', '.join(unknown)}")
    return {name: _parsed(name, known[name].parse, value) for name, value in given.items() if value is not None}


def _settings(output, dtype: str, max_shard_size: Size, budget: Size, lora: str, lora_alpha: float | None,
              base_model) -> Any:
    from distmerge.cli_options import CAST_NAMES, parse_size
    from distmerge.families.base import LoraOptions
    from distmerge.prepare import OutputSettings

    _choose("dtype", dtype, CAST_NAMES)
    _choose("lora", lora, LORA_MODES)

    def size(name: str, value: Size) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise InputError(f"{name}={value}: a size is at least 1 byte")
            return value
        return _parsed(name, parse_size, value)

    return OutputSettings(dtype=dtype, max_shard_bytes=size("max_shard_size", max_shard_size),
                          budget_bytes=size("budget", budget), output=_location(output),
                          lora=LoraOptions(mode=lora, alpha=lora_alpha,
                                           base_model=None if base_model is None else str(base_model)))
