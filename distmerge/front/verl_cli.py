"""verl's model-merger command line, verbatim: `distmerge merge` and `distmerge test` take the flags of verl 0.9.1's
`python -m verl.model_merger` (and of its merger guide) beside distmerge's own (docs/verl.md).

Each verl flag is one row of FLAGS, of one kind:

    alias    the native option it is (per command): --local_dir is --input, --target_dir --output, ...
    backend  --backend fsdp|megatron: the family of formats the layout is detected among (BACKENDS)
    claim    what the user says the checkpoint is, checked against its weights and config.json (expect.py):
             a contradiction is an error, never an override
    note     meaningless here: accepted, and said once (rank 0)
    upload   --hf_upload_path REPO [--private]: the finished output goes to the hub (hub.py)

    argv --translate--> the native argv cli.py parses, + Verl (what no native option holds)

`distmerge test` is verl's `test`: the checkpoint compared with --test_hf_dir by `verify`, no model written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from distmerge.errors import InputError

if TYPE_CHECKING:  # expect.py imports the planner (and torch): only a command that makes claims loads it
    from distmerge.engine.expect import Claim

COMMANDS = {"merge": "merge", "test": "verify"}  # verl's command -> the native command that parses the rest


@dataclass(frozen=True)
class Flag:
    spelling: str
    kind: str  # alias | backend | claim | note | upload
    target: str | dict[str, str | None] = ""  # alias: native option (by command; None: kept in Verl); claim: kind
    value: type | None = None  # the value's type; None: a switch
    commands: tuple[str, ...] = ("merge", "test")
    choices: tuple[str, ...] | None = None


# verl's --backend -> the formats it may be. verl's FSDP checkpoint manager (and its VeOmni engine) writes per-rank
# model_world_size_W_rank_r.pt; its torchtitan engine saves through torchtitan's CheckpointManager (DCP).
BACKENDS: dict[str, tuple[str, ...]] = {
    "fsdp": ("fsdp", "torchtitan", "dcp", "dcp-hf"),
    "megatron": ("megatron", "megatron-dist"),
}

FLAGS: tuple[Flag, ...] = (
    Flag("--backend", "backend", value=str, choices=tuple(BACKENDS)),
    Flag("--local_dir", "alias", {"merge": "--input", "test": "--merged"}, value=str),
    Flag("--target_dir", "alias", {"merge": "--output"}, value=str, commands=("merge",)),
    Flag("--test_hf_dir", "alias", {"test": "--reference"}, value=str, commands=("test",)),
    Flag("--hf_model_path", "alias", {"merge": "--hf-config", "test": None}, value=str),
    Flag("--tie-word-embedding", "claim", "tied_embeddings"),
    Flag("--is-value-model", "claim", "value_model"),
    Flag("--num-attention-heads", "claim", "num_attention_heads", value=int),
    Flag("--num-key-value-heads", "claim", "num_key_value_heads", value=int),
    Flag("--trust-remote-code", "note", "distmerge reads tensors and config.json and never runs the model's code"),
    Flag("--use_cpu_initialization", "note", "distmerge builds no model: nothing is initialised, on CPU or GPU"),
    Flag("--low_cpu_mem_usage", "note", "memory is always bounded (each process assembles --budget per round)"),
    Flag("--hf_upload_path", "upload", value=str, commands=("merge",)),
    Flag("--private", "upload", commands=("merge",)),
)
SHORT = {"--input": "-i", "--output": "-o"}  # native options' short forms, for the both-given check
DEFAULT_TARGET = "tmp"  # verl's --target_dir default


@dataclass(frozen=True, kw_only=True)
class Verl:
    """What a command in verl's spelling asks beyond the native options it was translated to."""

    command: str
    backend: str | None = None
    claims: tuple[Claim, ...] = ()
    notes: tuple[str, ...] = ()
    upload: str | None = None
    private: bool = False
    hf_config: Path | None = None  # test: verify has no --hf-config


def _dest(flag: Flag) -> str:
    return flag.spelling.lstrip("-").replace("-", "_")


def _pre_parser(command: str) -> argparse.ArgumentParser:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag in FLAGS:
        if command in flag.commands:
            kind = {"type": flag.value, "choices": flag.choices} if flag.value else {"action": "store_true"}
            pre.add_argument(flag.spelling, dest=_dest(flag), **kind)
    return pre


def translate(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], Verl | None]:
    """The native argv and what else verl's flags ask; (argv, None) for a native command line. Misuse is
    `parser.error` (usage, exit 2), as for a native option."""
    if not argv or argv[0] not in COMMANDS:
        return argv, None
    command = argv[0]
    try:
        given, rest = _pre_parser(command).parse_known_args(argv[1:])
    except argparse.ArgumentError as err:
        parser.error(str(err))
    used = [(f, getattr(given, _dest(f))) for f in FLAGS if command in f.commands
            and getattr(given, _dest(f)) not in (None, False)]
    if command == "merge" and not used:
        return argv, None
    native, verl = [COMMANDS[command], *rest], Verl(command=command)
    for flag, value in used:
        native, verl = _apply(flag, value, native, verl, parser)
    if command == "merge" and not _given(native, "--output"):
        native += ["--output", DEFAULT_TARGET]
        verl = replace(verl, notes=(*verl.notes, f"no --target_dir: the model goes to {DEFAULT_TARGET}/, "
                                                 "verl's default"))
    if verl.private and not verl.upload:
        verl = replace(verl, notes=(*verl.notes, "--private has no effect without --hf_upload_path"))
    return native, verl


def _apply(flag: Flag, value, native: list[str], verl: Verl, parser) -> tuple[list[str], Verl]:
    """One verl flag: into the native argv, or into Verl."""
    if flag.kind == "alias":
        target = flag.target[verl.command]  # type: ignore[index]
        if target is None:
            return native, replace(verl, hf_config=Path(value))
        if _given(native, target):
            parser.error(f"{flag.spelling} and {target} both given: pass one")
        return [*native, target, str(value)], verl
    if flag.kind == "backend":
        return native, replace(verl, backend=value)
    if flag.kind == "claim":
        from distmerge.engine.expect import Claim

        return native, replace(verl, claims=(*verl.claims, Claim(flag=flag.spelling, kind=str(flag.target),
                                                                 value=value)))
    if flag.kind == "note":
        return native, replace(verl, notes=(*verl.notes, f"{flag.spelling} has no effect: {flag.target}"))
    if flag.spelling == "--private":
        return native, replace(verl, private=True)
    return native, replace(verl, upload=value)


def _given(argv: list[str], option: str) -> bool:
    names = (option, SHORT.get(option, option))
    return any(a in names or a.startswith(option + "=") for a in argv)


def say_notes(verl: Verl | None, rank: int) -> None:
    """Each note once, from rank 0."""
    if verl is not None and rank == 0:
        for note in verl.notes:
            print(f"distmerge: note: {note}", file=sys.stderr, flush=True)


def format_for(backend: str | None, root: Path, requested: str = "auto") -> str:
    """The --format to read `root` with: detected among the backend's formats. Every rank alike, before the
    process group (errors are raised by all and said by rank 0)."""
    if backend is None:
        return requested
    allowed = BACKENDS[backend]
    if requested != "auto":
        if requested not in allowed:
            _refuse(f"--backend {backend} and --format {requested} disagree: {backend} is {', '.join(allowed)}")
        return requested
    from distmerge.formats import registry

    try:
        found = registry.detect(Path(root))
    except (OSError, InputError):
        found = None
    if found is None or found.name in allowed:
        return found.name if found else "auto"  # nothing detected: the merge says why, as without --backend
    other = next((b for b, names in BACKENDS.items() if found.name in names), None)
    fix = f"pass --backend {other}" if other else "drop --backend (distmerge detects the layout)"
    _refuse(f"--backend {backend}, but {root} holds a {found.name} checkpoint ({found.help}): {fix}")


def _refuse(message: str):
    err = InputError(message)
    err.before_group = True
    raise err


def merge_options(opts, verl: Verl | None):
    """MergeOptions with the backend's format and the claims."""
    if verl is None:
        return opts
    spec = opts.input
    return replace(opts, input=replace(spec, format=format_for(verl.backend, spec.location, spec.format)),
                   claims=verl.claims)


def after_merge(verl: Verl | None, output: Path, rank: int, quiet: bool) -> None:
    """--hf_upload_path: rank 0 uploads the finished output (the other processes have ended)."""
    if verl is None or verl.upload is None or rank != 0:
        return
    from distmerge.output.hub import upload

    url = upload(Path(output), verl.upload, verl.private)
    if not quiet:
        print(f"uploaded {output} to {verl.upload}: {url}", flush=True)


def test_values(values: dict, verl: Verl | None) -> dict:
    """verl's `test`: the checkpoint (--local_dir, read as --backend says) against --test_hf_dir, tensor by tensor;
    nothing written. The verify options with the backend's format and --hf_model_path's config."""
    if verl is None:
        return values
    return {**values, "format": format_for(verl.backend, values["merged"], values["format"]),
            "hf_config": verl.hf_config or values["hf_config"]}


def check_claims(verl: Verl | None, opts, comm) -> None:
    """Collective: verl's claims (--tie-word-embedding ...) checked against the checkpoint, by rank 0."""
    if verl is None or not verl.claims:
        return
    from distmerge.engine import expect

    side = opts.merged
    comm.root_only(lambda: expect.check_checkpoint(verl.claims, side.location, side.format, side.hf_config,
                                                   side.format_options))
