"""Command line: `distmerge merge`, `distmerge verify` and `distmerge watch` (under torchrun or alone), `distmerge
inspect`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

from distmerge import __version__, options
from distmerge import testing_seams as seams
from distmerge.errors import DistmergeError, InputError
from distmerge.front import import_cli, verl_cli
from distmerge.options.cli_options import add_options

EPILOG = """examples:
  torchrun --nproc-per-node 8 -m distmerge merge --input ckpts/global_step_1000/actor --output merged/
  python -m distmerge merge --input ckpts/global_step_1000/actor --output merged/ --dtype bf16
  torchrun --nproc-per-node 8 -m distmerge merge --input megatron_ckpts/ --output merged/ --hf-config hf_model/
  torchrun --nproc-per-node 8 -m distmerge merge --input ckpts/global_step_900/actor \\
      --input ckpts/global_step_1000/actor --output averaged/ --average      (docs/average.md)
  distmerge inspect ckpts/global_step_1000/actor

Under torchrun each process reads a share of the rank files, assembles and writes its own output
files; rank 0 writes config.json and, last, model.safetensors.index.json (no index = not finished).
"""


MERGE_DESCRIPTION = """\
Merge a sharded training checkpoint into one Hugging Face model: sharded safetensors, the index,
config.json, tokenizer and generation config, as save_pretrained writes them. Run it alone or under
torchrun: the processes share the reading, assembling and writing; the result is the same for any number."""


# A rank other than 0 holding the error rank 0 prints (argparse's, or one every rank agreed on) stays silent, and
# waits this long before it exits: torchrun stops the whole job when the first worker exits, so a silent rank that
# exits first could kill rank 0 before its one line is out (seen under CPU load). Rank 0's exit ends the wait (its
# SIGTERM), so this costs nothing when rank 0 gets to say it.
SILENT_RANK_WAIT_S = 60.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def let_rank_0_speak() -> None:
    """On a silent rank under torchrun: wait for rank 0 to print the error and exit (torchrun then ends us)."""
    if _rank() == 0:
        seams.pause_before_rank_0_error()  # a test's slow rank 0 (testing_seams.py); nothing otherwise
        return
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # alone, or under a launcher other than torchrun (which one stops the job is its own rule)
    with contextlib.suppress(KeyboardInterrupt):  # torchrun's SIGTERM, once rank 0 has exited (_interrupt_on_sigterm)
        time.sleep(SILENT_RANK_WAIT_S)


def tell_torchrun(line: str) -> None:
    """Write the error where torchrun looks for its root cause (the file `errors.record` would write), so its
    failure summary shows this line instead of "To enable traceback see ...". Only under torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):  # the summary then lacks our line; the line itself is printed
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


def report_silence(line: str, speak: bool) -> None:
    """The watchdog's verdict on a silent rank (watchdog/): every rank that found it gives it to torchrun, one
    prints it. The watchdog then ends the process (its main thread is blocked in a collective)."""
    tell_torchrun(f"distmerge: error: {line}")
    if speak:
        print(f"distmerge: error: {line}", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """Every process of a torchrun job parses the same command line: rank 0 alone prints usage and errors."""

    def _print_message(self, message: str, file=None) -> None:
        if _rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        tell_torchrun(f"{self.prog}: error: {message}")
        let_rank_0_speak()
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="distmerge",
        description="Merge sharded training checkpoints into one Hugging Face model (safetensors).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"distmerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    merge = sub.add_parser("merge", help="merge a checkpoint into safetensors", description=MERGE_DESCRIPTION,
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(merge, "merge")
    inspect = sub.add_parser("inspect", help="describe a checkpoint and the files a merge would write",
                             description="What a checkpoint holds and which files `merge` with the same options "
                                         "would write; nothing is written.")
    add_options(inspect, "inspect")
    add_verify_parser(sub)
    watch = sub.add_parser("watch", help="merge each checkpoint of a training run once its trainer has finished "
                           "saving it", description=WATCH_DESCRIPTION, epilog=WATCH_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(watch, "watch")
    import_cli.add_import_parser(sub)
    # verl's spelling, listed here only: verl_cli.translate turns `test ...` into `verify ...` before parsing
    sub.add_parser("test", add_help=False, help="verify in verl's spelling: the flags of `python -m "
                   "verl.model_merger test` (docs/verl.md)")
    return parser


VERIFY_DESCRIPTION = """\
Compare a merged model with a reference, tensor by tensor: names both ways, shape, dtype, bit-exactness,
max abs / max rel / mean abs diff and cosine similarity.

Without tolerances every tensor must be bit-exact and of the reference's dtype. With any of --atol,
--rtol, --min-cosine, a tensor passes when it is within them, and a dtype other than the reference's is
accepted: the reference is cast to the merged dtype before comparing (the report says so per tensor).
A tied lm_head.weight present on one side only is accepted when the merged config.json ties embeddings
and it equals the embedding on the other side.

--merged may also be a training checkpoint, anything `merge` reads: it is then merged in memory, as
`merge` with the same options would (--format, --dtype, --lora, --budget ...), and each tensor compared
as it is assembled; nothing is written. A --dtype cast is accepted (values must equal the cast reference).
--reference may be a checkpoint too (say a Megatron save of the model an FSDP --merged was trained as, or the
checkpoint a finished --merged model came from), read with the --reference- twins of --format, --hf-config and
the formats' options: merged in memory with the same --dtype, --lora and --budget, and compared, nothing written.
--merged given once per checkpoint with --average (and --average-weights): their average, built in memory exactly
as `merge --input A --input B --average` writes it, compared with a finished --reference (docs/average.md)."""

VERIFY_EPILOG = """examples:
  torchrun --nproc-per-node 8 -m distmerge verify --merged merged/ --reference hf_model/
  python -m distmerge verify --merged merged/ --reference full_state_dict.safetensors --json verify.json
  python -m distmerge verify --merged merged/ --reference hf_model/ --atol 1e-3 --min-cosine 0.9999 --logits
  python -m distmerge verify --merged merged/ --reference hf_model/ --plot verify.png
  torchrun --nproc-per-node 8 -m distmerge verify --merged ckpts/global_step_1000/actor --reference hf_model/
  torchrun --nproc-per-node 8 -m distmerge verify --merged fsdp_ckpt/ --reference megatron_ckpt/ \\
      --reference-hf-config hf_model/ --reference-iteration 1000
  torchrun --nproc-per-node 8 -m distmerge verify --merged hf_model/ --reference ckpts/global_step_1000/actor
  torchrun --nproc-per-node 8 -m distmerge verify --merged ckpts/global_step_900/actor \
      --merged ckpts/global_step_1000/actor --average --reference averaged/

Each process checks the tensors of the merged files it owns (read a block at a time on both sides);
rank 0 prints the worst tensors, the totals (names matched both ways, least cosine per kind of layer) and one
verdict line. Exit 0 only when every tensor passes.
"""


WATCH_DESCRIPTION = """\
Merge each checkpoint a training run saves, once its trainer has finished saving it (its own marker: verl's and
Megatron-LM's latest_checkpointed_iteration.txt, DeepSpeed's latest, the HF Trainer's trainer_state.json, DCP's
and torchtitan's .metadata). RUN/<rel> is merged into OUT/<rel> exactly as `distmerge merge` would, once: a step
still being written waits for a later pass, a step already merged is left untouched, an interrupted one is finished
(--resume), and a step another watcher is merging is left to it. Without --once it looks again every --poll seconds
until SIGTERM or Ctrl-C, then exits 0 (a merge in flight stops as merge's Ctrl-C stops it; the next watch resumes
it). Exit 1 when a step failed (named in the summary)."""

WATCH_EPILOG = """examples:
  python -m distmerge watch --input ckpts/ --output merged/ --once
  torchrun --nproc-per-node 8 -m distmerge watch --input ckpts/ --output merged/ --poll 60 --dtype bf16
  python -m distmerge watch --input ckpts/ --output merged/ --steps every:1000 --hf_upload_path me/model

Under torchrun rank 0 finds the steps each pass and every process takes part in each merge; rank 0 prints a table
per pass that has news (step, status, size, time). docs/watch.md: the markers, the statuses, SLURM.
"""


def add_verify_parser(sub) -> None:
    verify = sub.add_parser(
        "verify", help="compare a merged model with a reference, tensor by tensor", epilog=VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=VERIFY_DESCRIPTION,
    )
    add_options(verify, "verify")


INTERRUPTED = {
    "merge": "distmerge: interrupted: {done}; run the same command with --resume to finish",
    "verify": "distmerge: interrupted: nothing was changed; run verify again",
    "watch": "distmerge watch: interrupted; run it again to finish",
    "inspect": "distmerge: interrupted",
    "import": "distmerge import: interrupted: no tracker was written; run it again with --overwrite",
}


def _interrupt_on_sigterm() -> None:
    """torchrun passes a Ctrl-C on to its workers as SIGTERM: let it end the run the way Ctrl-C does."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        def stop(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def _start_up(program: bool):
    """The parser imports torch and every format: ~170k Python objects. With the cyclic GC on, Python walks all
    of them several times while they load, and again in each full collection of the run (~0.4 s of CPU in a
    2.6 s merge of 0.78 GB, docs/torchtitan.md#speed). So a program run (argv None: `python -m distmerge`,
    torchrun, the `distmerge` script) loads them with the GC off and then freezes them (gc.freeze: never walked
    again; the ~1 MB of cyclic garbage the imports leave stays). A caller passing argv (tests, other programs)
    keeps its GC as it was: freezing its objects would keep their garbage for the rest of its life."""
    if not program or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    with _start_up(program=argv is None):
        parser = build_parser()
    native, verl = verl_cli.translate(sys.argv[1:] if argv is None else list(argv), parser)  # verl's spelling
    args = parser.parse_args(native)
    args.verl = verl
    _interrupt_on_sigterm()
    verl_cli.say_notes(verl, _rank())
    try:
        if args.command == "inspect":
            from distmerge.front.inspect import run_inspect

            return run_inspect(args)
        if args.command == "verify":
            return _run_verify(args)
        if args.command == "watch":
            return _run_watch(args)
        if args.command == "import":
            return import_cli.run_import_command(args, report_silence)
        return _run_merge(args)
    except DistmergeError as err:
        _report_error(err, args.debug)
        return 1
    except KeyboardInterrupt as stop:
        if _rank() == 0:  # every rank is interrupted: one says so
            print(INTERRUPTED[args.command].format(done=_finished_files(stop)), file=sys.stderr, flush=True)
        return 130
    except Exception as err:  # noqa: BLE001  (inspect works outside the collectives: same one line as a bug there)
        _report_error(_internal(err), args.debug)
        return 1


def _finished_files(stop: KeyboardInterrupt) -> str:
    """What an interrupted merge leaves for --resume, as rank 0 counted it (errors.Interrupted)."""
    finished, planned = getattr(stop, "finished", None), getattr(stop, "planned", None)
    if finished is None or planned is None:
        return "the files it finished are kept"
    return f"{finished} of {planned} output file(s) are finished and kept"


def _internal(err: Exception) -> DistmergeError:
    """What comm.Comm gives an unexpected exception inside a collective: one line, the trace for --debug."""
    import traceback

    first = (str(err).splitlines() or [""])[0][:300]
    wrapped = DistmergeError(f"internal error on rank {_rank()}: {type(err).__name__}: {first} (rerun with --debug)")
    wrapped.trace = "".join(traceback.format_exception(err))
    wrapped.before_group = True
    return wrapped


def _run_merge(args: argparse.Namespace) -> int:
    """`distmerge merge`: the API's merge (api.run_merge) in the group api.job_group gives, then what only the
    command does: --json-summary, --verify-against, verl's upload."""
    from distmerge import api
    from distmerge.output import is_url
    from distmerge.report import summary_json

    values = options.from_namespace(args, "merge")
    opts = verl_cli.merge_options(api.merge_request(values), args.verl)
    if is_url(args.output) and (args.verify_against is not None or getattr(args.verl, "upload", None)):
        err = InputError("--verify-against and --hf_upload_path read the merged folder: with an s3:// --output, "
                         "verify or upload the model from a local copy")
        err.before_group = True
        raise err
    if args.verify_against is not None and not args.verify_against.exists():  # before hours of merging
        err = InputError(f"--verify-against {args.verify_against} does not exist: pass the reference model")
        err.before_group = True
        raise err
    with api.job_group(values, on_silence=report_silence) as comm:
        result = api.run_merge(opts, comm, show=not args.quiet)
        if comm.rank == 0 and args.json_summary:
            args.json_summary.write_text(summary_json(result))
        status = _verify_after_merge(args, comm) if args.verify_against is not None else 0
    if status == 0:
        verl_cli.after_merge(args.verl, args.output, _rank(), args.quiet)
    return status


def _run_verify(args: argparse.Namespace) -> int:
    """`distmerge verify` (and verl's `test`): the API's verify (verify_and_write) in the group api.job_group
    gives; the report always (--quiet: the verdict), exit 0 only when every tensor passes."""
    from distmerge import api
    from distmerge.verifier.run import verify_and_write

    values = verl_cli.test_values(options.from_namespace(args, "verify"), args.verl)
    opts = api.verify_request(values)
    with api.job_group(values, on_silence=report_silence) as comm:
        verl_cli.check_claims(args.verl, opts, comm)
        return 0 if verify_and_write(opts, comm, plot=args.plot, show=True).passed else 1


def _run_watch(args: argparse.Namespace) -> int:
    """`distmerge watch`: the API's watch (api.run_watch) in the group api.job_group gives, SIGTERM taken as Ctrl-C;
    the last line, and the status: 1 when a step failed, 130 when --once was interrupted, else 0."""
    from distmerge import api
    from distmerge.watcher.summary import print_end

    values = options.from_namespace(args, "watch")
    request = api.watch_request(values)
    try:
        with _sigterm_interrupts(), api.job_group(values, on_silence=report_silence) as comm:
            result = api.run_watch(request, comm, show=not args.quiet)
    except KeyboardInterrupt as stop:  # --once only: a watch without it returns, stopped
        outcome = getattr(stop, "outcome", None)
        if _rank() == 0:
            where = f" in {outcome.name} ({outcome.detail})" if outcome is not None else ""
            print(f"distmerge watch: interrupted{where}; run it again to finish", file=sys.stderr, flush=True)
        return 130
    if _rank() == 0 and not args.quiet:
        print_end(result, " (stopped by a signal)" if result.stopped else "")
    return 1 if result.failed else 0


@contextlib.contextmanager
def _sigterm_interrupts():
    """watch: SIGTERM (scancel, a time limit, kill) stops it as Ctrl-C does, with any number of processes; the
    handler found is put back after (a caller's process keeps its own)."""
    def stop(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _verify_after_merge(args: argparse.Namespace, comm) -> int:
    """Same processes, same group: the merged files are still in the page cache."""
    from distmerge.verifier import VerifyOptions, verify_and_report
    from distmerge.verifier.report import Criteria

    sys.stdout.flush()  # the merge summary before the verify table
    crit = Criteria(accept_cast=args.dtype != "keep")  # the merge cast on purpose; values must match the cast
    return verify_and_report(VerifyOptions(merged=args.output, reference=args.verify_against, criteria=crit,
                                           quiet=args.quiet), comm)


def _report_error(err: DistmergeError, debug: bool) -> None:
    tell_torchrun(f"distmerge: error: {err}")
    # Every rank holds the same error (agreed through a collective, or found by every rank alike before
    # the group exists): rank 0 speaks for all.
    shared = hasattr(err, "origin_rank") or getattr(err, "before_group", False)
    if shared and _rank() != 0 and os.environ.get("LOCAL_RANK") == "0":
        # the first process of another node: its node's log says the line too, and it exits at once (its agent
        # then ends the node's other processes; rank 0's node is another agent's, which this exit does not stop)
        print(f"distmerge: error: {err}", file=sys.stderr, flush=True)
        return
    if shared:
        let_rank_0_speak()  # at once on rank 0 (but for a test seam)
    if shared and _rank() != 0:
        return
    if debug:
        import traceback

        print(getattr(err, "trace", None) or "".join(traceback.format_exception(err)), file=sys.stderr)
    print(f"distmerge: error: {err}", file=sys.stderr, flush=True)
