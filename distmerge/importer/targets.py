"""The training layouts `distmerge import` writes, each declared as a Target: what differs between them, as data and
small functions, for the one skeleton of run.py to run (lock, discover, plan, write, finalize).

    megatron     OUT/release/__{rank}_0.distcp, then .metadata, metadata.json, common.pt (finalize.py), and last
                 OUT/latest_checkpointed_iteration.txt: no tracker, no finished import. A training checkpoint
                 input is read in one pass (source.py).
    torchtitan   OUT/step-0/__{i}_0.distcp, then OUT/step-0/.metadata, last: torchtitan counts a step folder as
                 a checkpoint only once it has one. A training checkpoint input is read in one pass, as for
                 megatron; one layout for every world size, so none of Megatron-LM's layout options.

torchtitan's OUT starts a job as `--checkpoint.initial_load_path OUT/step-0` (model only, the default of
initial_load_model_only), and as the job's checkpoint folder (a step-0 save is loaded as model weights only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distmerge.errors import ConfigError
from distmerge.families.torchtitan import inverse as torchtitan_inverse
from distmerge.formats.torch_private.dcp import write as dcp
from distmerge.importer import finalize as fin
from distmerge.importer.discover import Model
from distmerge.importer.megatron_args import common_state, megatron_args
from distmerge.importer.plan import Layout, check_layout, make_plan
from distmerge.importer.request import ImportOptions, ImportResult
from distmerge.importer.torchtitan_plan import STEP, make_titan_plan
from distmerge.output.store import Store


@dataclass(frozen=True, kw_only=True)
class Target:
    """One training layout: where its files go and how its plan, its last files and its summary are made."""

    folder: str  # the output's folder that holds the .distcp files
    marker: str  # the file that says the import finished: written last, removed first when the output is prepared
    plan: Callable[[Model, Layout, int], Any]  # (model, layout, processes) -> .tensors, .files, .owners
    finalize: Callable[[Store, Model, Any, list[dcp.Entry], Layout], None]  # rank 0, once every file is written
    check_options: Callable[[ImportOptions], None]  # the options this layout takes none of, refused
    check_config: Callable[[dict, Layout], None]  # what config.json alone refuses (--hf-config, before a merge)
    padded_vocab: Callable[[Any], int]  # the vocabulary's rows written
    summary: Callable[[ImportResult, ImportOptions], str]  # the line rank 0 prints


def _finalize_megatron(store: Store, model: Model, plan: Any, entries: list[dcp.Entry], layout: Layout) -> None:
    dtype = next(iter(plan.tensors.values())).dtype
    fin.finalize(store, entries, common_state(megatron_args(model.config, plan, layout, dtype)))


def _megatron_summary(result: ImportResult, opts: ImportOptions) -> str:
    lay = opts.layout
    ep = f" x EP={lay.ep}" if lay.ep > 1 else ""
    vpp = f" x VPP={lay.vpp}" if lay.vpp else ""
    return (f"distmerge import: wrote {opts.output} (Megatron-LM torch_dist, TP={lay.tp} x PP={lay.pp}{vpp}{ep}): "
            f"{result.tensors} tensors in {result.chunks} chunks, {result.files} files, "
            f"{result.nbytes / 1e6:.1f} MB, vocabulary padded to {result.padded_vocab} rows; "
            f"{result.seconds:.1f} s with {result.processes} process(es)")


def _finalize_torchtitan(store: Store, model: Model, plan: Any, entries: list[dcp.Entry], layout: Layout) -> None:
    store.write_small(f"{STEP}/.metadata", dcp.metadata_bytes(entries))


def _torchtitan_summary(result: ImportResult, opts: ImportOptions) -> str:
    return (f"distmerge import: wrote {opts.output}/{STEP} (torchtitan DCP, loads at any world size): "
            f"{result.tensors} tensors in {result.files} files, {result.nbytes / 1e6:.1f} MB; "
            f"{result.seconds:.1f} s with {result.processes} process(es)")


def _refuse_megatron_options(opts: ImportOptions) -> None:
    """--to torchtitan: one layout for every world size, so no --tp, --pp, --ep or pipeline split (torchtitan's run
    options, not the checkpoint's: its loader reshards), and no vocabulary padding (torchtitan's embedding is
    vocab_size rows). --hf-config is taken: a checkpoint input's config.json, as for merge."""
    lay = opts.layout
    if (lay.tp, lay.pp, lay.ep, lay.vpp, lay.first, lay.last) != (1, 1, 1, None, None, None):
        raise ConfigError("--to torchtitan writes one folder that torchtitan loads at any parallelism: drop --tp, "
                          "--pp, --ep, --vpp, --decoder-first-pipeline-num-layers and "
                          "--decoder-last-pipeline-num-layers (set them in torchtitan's own config)")
    if lay.divisible_by != 128:
        raise ConfigError("--make-vocab-size-divisible-by is Megatron-LM's: torchtitan does not pad the vocabulary, "
                          "so --to torchtitan takes no such option")


def _takes_every_option(opts: ImportOptions) -> None:
    """Megatron-LM's layout takes every option of `import`."""


def _check_megatron_config(config: dict, layout: Layout) -> None:
    """A TP, PP, EP or pipeline split config.json does not allow (plan.check_layout)."""
    check_layout(config, layout)


def _check_torchtitan_config(config: dict, layout: Layout) -> None:
    """An architecture torchtitan (or this import) lacks, refused from --hf-config's config.json before a
    checkpoint's tensors are read (torchtitan_inverse.architecture)."""
    torchtitan_inverse.architecture(config)


MEGATRON = Target(folder=fin.RELEASE, marker=fin.TRACKER,
                  plan=make_plan, finalize=_finalize_megatron, check_options=_takes_every_option,
                  check_config=_check_megatron_config,
                  padded_vocab=lambda plan: plan.sizes.padded_vocab, summary=_megatron_summary)
TORCHTITAN = Target(folder=STEP, marker=f"{STEP}/.metadata",
                    plan=lambda model, layout, world: make_titan_plan(model, world), finalize=_finalize_torchtitan,
                    check_options=_refuse_megatron_options, check_config=_check_torchtitan_config,
                    padded_vocab=lambda plan: 0, summary=_torchtitan_summary)

TARGETS = {"megatron": MEGATRON, "torchtitan": TORCHTITAN}  # --to's choices (options/import_options.TARGETS)
