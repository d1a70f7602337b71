"""Write a many-rank megatron-core `torch_dist` save (W up to 1024 and more) in one process, by megatron-core's code.

    python tests/bench/make_megatron_dist_scale.py --out DIR --reference FILE --world 1024 [--tp 8] [--pp 16]
                                                   [--layers 128] [--no-fully-parallel]

W = TP x PP x DP. Every simulated rank r runs, under a fake process group of rank r (torch.testing's "fake"
backend: no communication, `get_rank() == r`) with megatron's parallel_state initialised for it
(`initialize_model_parallel(tp, pp)`), what `dist_checkpointing.save` runs on rank r of a W-rank job, as
Megatron-LM's and verl's Megatron checkpointing call it (both wrap the torch_dist strategy in
FullyParallelSaveStrategyWrapper over the data-parallel group; verl: utils/megatron/dist_checkpointing.py):

    GPTModel (local spec, bf16 as Float16Module casts it) .sharded_state_dict(metadata=...)      (each rank)
    save_preprocess (factories: linear_fc1's [gate; up] split), TorchCommonSaveStrategy.save_common (rank 0)
    determine_main_replica_uniform_distribution + distribute_main_replicas_with_precomputed_distribution
                            (the fully-parallel wrapper; the shard lists of the DP group travel as its all_gather)
    _replace_state_dict_keys_with_sharded_keys(keep_only_main_replica), mcore_to_pyt_state_dict,
    MCoreSavePlanner + FileSystemWriterAsync: local plan, decentralized global plan, finish_plan,
    prepare_write_data, preload_tensors, write_preloaded_data per bucket          (each rank; its two files)
    MCoreSavePlanner.create_global_plan(all local plans) -> Metadata (+ all_local_plans), writer.finish
                                                                                   (coordinator: .metadata)
    save_config -> metadata.json                                                   (rank 0)

What travels between ranks (the DP group's shard lists, the local plans, the write results) goes through pickle,
as the collectives send it. Left out: the forked writer processes (write_preloaded_data runs in this process, the
same function, without fsync) and the spawn Manager queue megatron hands results through. Before writing
.metadata, megatron's own validate_sharding_integrity checks that the main replicas of all ranks cover every
tensor exactly once.

The model is a Llama (hidden 128, 16 heads of 8, 8 KV groups, FFN 256, vocab 2000 padded to 2048 for TP=8) with
`--layers` layers, seeded from a random Hugging Face model (tests/fixtures/megatron_models.py cuts each rank's
shards); `--reference` gets that model's tensors in bf16 (what an exact merge gives). Megatron's torch_dist
layout does not grow with W as FSDP's does: every chunk is one layer's TP shard (DP replicas are not written
twice, PP splits layers), so .metadata holds layers x (5 TP + 2) + 2 TP + 1 chunks whatever DP is (5,393 for
128 layers at TP=8). Also written: latest_checkpointed_iteration.txt, iter_0000001/ and huggingface/config.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "fixtures"))

from make_dcp_scale import travel  # noqa: E402

ITERATION = 1


def family(layers: int):
    """The Llama of these saves: TP up to 8 (16 heads, 8 KV groups), `layers` layers."""
    import megatron_models as mm

    hf = {**mm.FAMILIES["llama"].hf, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 16,
          "num_key_value_heads": 8, "num_hidden_layers": layers, "vocab_size": 2000}
    return mm.Family("llama", "LlamaConfig", hf)


def become(rank: int, world: int, tp: int = 0, pp: int = 0) -> None:
    """This process as rank `rank` of `world` (fake process group), with megatron's groups when tp is given."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    if tp:  # the gloo twins of each group cannot exist under the fake backend (and are not used to save)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)


class Job:
    """The save's constants and what the simulated ranks hand each other."""

    def __init__(self, args: argparse.Namespace) -> None:
        import megatron_models as mm
        import torch

        self.args, self.world, self.tp, self.pp = args, args.world, args.tp, args.pp
        assert args.world % (args.tp * args.pp) == 0, "--world must be a multiple of TP x PP"
        self.dp = args.world // (args.tp * args.pp)
        self.fam = family(args.layers)
        self.vocab = mm.padded_vocab_size(self.fam.hf["vocab_size"], args.tp)
        hf_model = mm.build_hf_model(self.fam)
        self.hf_sd = {k: v.to(torch.bfloat16) for k, v in mm.hf_disk_state_dict(hf_model)[0].items()}
        self.hf_config = hf_model.config
        self.full: dict[int, dict] = {}  # per TP rank: every layer's shards (the same on every PP and DP rank)
        self.ckpt = args.out / f"iter_{ITERATION:07d}"

    def shards(self, tp_rank: int) -> dict:
        import megatron_models as mm

        if tp_rank not in self.full:
            group = (self.tp, tp_rank)
            self.full[tp_rank] = mm.hf_to_megatron(self.fam, self.hf_sd, self.vocab, group, group, (1, 0))
        return self.full[tp_rank]

    def megatron_args(self) -> argparse.Namespace:
        import make_megatron as mk
        import megatron_models as mm
        import torch

        case = mk.MegatronCase(self.tp, self.pp, "torch_dist")
        args = mm.fake_args(self.fam, case, self.vocab, self.world)
        return argparse.Namespace(**{**vars(args), "params_dtype": torch.bfloat16, "bf16": True,
                                     "data_parallel_size": self.dp, "ckpt_fully_parallel_save": self.args.fully})


def build_model(job: Job):
    """This rank's GPTModel (Megatron-LM's get_model: pre/post_process by pipeline stage, bf16 as Float16Module
    casts it), loaded with its shards of the reference weights."""
    import make_megatron as mk
    import megatron_models as mm
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = mm.megatron_config(job.fam, job.tp, job.pp, None, 1)
    config.perform_initialization = False  # every weight is copied in below
    model = GPTModel(config=config, transformer_layer_spec=mm.layer_spec(job.fam), vocab_size=job.vocab,
                     max_sequence_length=job.fam.hf["max_position_embeddings"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_percent=1.0, rotary_base=int(job.fam.hf["rope_theta"])).bfloat16().eval()
    mk.load_into(model, job.shards(ps.get_tensor_model_parallel_rank()))
    return model


def sharded_part(job: Job, rank: int):
    """Rank `rank`'s sharded state dict as dist_checkpointing.save preprocesses it (checkpointing.py's
    generate_state_dict + _build_sharded_state_dict_metadata, no optimizer), its common part, its DP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import _CONTENT_METADATA_KEY
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    become(rank, job.world, job.tp, job.pp)
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = {"args": job.megatron_args(), "checkpoint_version": 3.0, "iteration": ITERATION,
               "model": build_model(job).sharded_state_dict(metadata=dict(content, dp_cp_group=dp_group)),
               "num_floating_point_operations_so_far": 0, _CONTENT_METADATA_KEY: content}
    part, common = save_preprocess(sharded, validate_access_integrity=False)  # validated once, globally, below
    return part, common, dist.get_process_group_ranks(dp_group)


@contextlib.contextmanager
def gathered(lists: dict[int, list]):
    """all_gather_object inside the block hands out the group members' lists, each through pickle."""
    import torch.distributed as dist

    real = dist.all_gather_object

    def fake(out: list, obj, group=None) -> None:
        out[:] = [travel(lists[r]) for r in dist.get_process_group_ranks(group)]

    dist.all_gather_object = fake
    try:
        yield
    finally:
        dist.all_gather_object = real


def distribute(part, dp_ranks: list[int], no_data: dict[int, list]) -> None:
    """FullyParallelSaveStrategyWrapper.apply_saving_parallelization: the main replicas split over the DP group."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.exchange_utils import determine_main_replica_uniform_distribution
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        distribute_main_replicas_with_precomputed_distribution,
    )

    group = dist.new_group(dp_ranks)
    with gathered(no_data):
        plan = determine_main_replica_uniform_distribution(part, group)
    distribute_main_replicas_with_precomputed_distribution(part, group, plan)


def write(writer) -> list:
    """What write_preloaded_data_multiproc does in its forked workers, here: one bucket (file) after another."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    if save_fn is None:
        return writer.retrieve_write_results()  # nothing to write on this rank
    buckets = preload_fn()
    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    done, counts, per_file = queue.Queue(), queue.Queue(), {}
    for i, bucket in enumerate(buckets):
        counts.put(i)
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, done, counts, False)
        index, got = done.get()
        if isinstance(got, Exception):
            raise got
        per_file[index] = got
    writer.results_queue.put(per_file)
    return writer.retrieve_write_results()


def rank_save(job: Job, rank: int, part, strategy):
    """TorchDistSaveShardedStrategy.async_save + save_state_dict_async_plan on rank `rank` (decentralized plan):
    (its local plan, its write results, its planner and writer)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(part, strategy.keep_only_main_replica)
    state = mcore_to_pyt_state_dict(flat, False)
    writer = FileSystemWriterAsync(job.ckpt, separation_hint=strategy.separation_hint,
                                   thread_count=strategy.thread_count, use_msc=False)
    planner = MCoreSavePlanner(dedup_replicated_tensors=not strategy.keep_only_main_replica,
                               flatten_state_dict=False)
    planner.set_up_planner(state, is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0)
    local = writer.prepare_local_plan(planner.create_local_plan())
    central = writer.prepare_decentralized_global_plan(planner.create_decentralized_global_plan(local))
    writer.prepare_write_data(planner.finish_plan(central), planner)
    return local, write(writer), planner, writer


def check_each_grid_once() -> None:
    """torch's ShardedTensor checks that no two shards of a tensor's grid overlap, pairwise (half of each rank's
    planning time here, 1.5 s per rank at TP=8 with 128 layers). Megatron lists every shard of the grid on every
    rank, so the ranks check the same lists: the real check runs once per distinct list, a list already found
    non-overlapping passes (what each real rank pays is not what this bench measures)."""
    from torch.distributed._shard.sharded_tensor import api as tensor_api
    from torch.distributed._shard.sharded_tensor import utils as tensor_utils
    from torch.distributed._shard.sharding_spec import _internals
    from torch.distributed._shard.sharding_spec import api as spec_api

    real, passed = _internals.validate_non_overlapping_shards_metadata, set()

    def once(shards) -> None:
        key = tuple((tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in shards)
        if key not in passed:
            real(shards)  # raises on an overlap
            passed.add(key)

    for module in (tensor_api, tensor_utils, spec_api):
        module.validate_non_overlapping_shards_metadata = once


def save(job: Job) -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    filesystem_async._get_write_results_queue = queue.Queue  # not a spawned Manager's queue: one process here
    check_each_grid_once()
    strategy = serialization.get_default_save_sharded_strategy()
    job.ckpt.mkdir(parents=True, exist_ok=True)
    parts, dp_ranks, no_data = {}, {}, {}
    for rank in range(job.world):  # model, sharded_state_dict, save_preprocess on every rank
        parts[rank], common, dp_ranks[rank] = sharded_part(job, rank)
        no_data[rank] = [t.without_data() for t in nested_values(parts[rank]) if isinstance(t, ShardedTensor)]
        if rank == 0:
            serialization.get_default_save_common_strategy().save_common(common, job.ckpt)
        _progress("sharded_state_dict", rank, job.world)
    local_plans, results, accessed, coordinator = [], [], [], None
    for rank in range(job.world):  # the fully-parallel split, the plan and the writing, on every rank
        become(rank, job.world)
        part = parts.pop(rank)
        if job.args.fully and len(dp_ranks[rank]) > 1:
            distribute(part, dp_ranks[rank], no_data)
        accessed.append(travel([t.without_data() for t in nested_values(part)]))
        local, written, planner, writer = rank_save(job, rank, part, strategy)
        local_plans.append(travel(local))
        results.append(travel(written))
        coordinator = coordinator or (planner, writer)
        _progress("write", rank, job.world)
    become(0, job.world)
    validate_sharding_integrity(accessed)  # rank 0: every tensor's main replicas cover it exactly once
    planner, writer = coordinator
    _, metadata = planner.create_global_plan(local_plans)
    metadata.all_local_plans = local_plans
    writer.finish(metadata, results)
    save_config(CheckpointingConfig(strategy.backend, strategy.version), job.ckpt)


def _progress(what: str, rank: int, world: int) -> None:
    if (rank + 1) % max(1, world // 8) == 0 or rank + 1 == world:
        print(f"make_megatron_dist_scale: {what} {rank + 1}/{world}", flush=True)


def write_side_files(job: Job, reference: Path) -> None:
    """latest_checkpointed_iteration.txt, huggingface/config.json (bf16, as saved), the reference tensors."""
    from safetensors.torch import save_file

    (job.args.out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    job.hf_config.save_pretrained(str(job.args.out / "huggingface"))
    path = job.args.out / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config.update({key: "bfloat16" for key in ("dtype", "torch_dtype") if key in config})
    config["make_megatron_dist_scale"] = {k: getattr(job, k) for k in ("world", "tp", "pp", "dp")}
    path.write_text(json.dumps(config, indent=2))
    reference.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in job.hf_sd.items()}, str(reference))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True, help="the expected merge (a .safetensors file)")
    parser.add_argument("--world", type=int, required=True, help="W = TP x PP x DP")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--no-fully-parallel", dest="fully", action="store_false",
                        help="plain TorchDistSaveShardedStrategy (DP rank 0 writes all) instead of the "
                             "FullyParallelSaveStrategyWrapper Megatron-LM and verl use")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import make_megatron as mk
    import torch

    torch.set_num_threads(1)
    mk.patch_cuda_for_cpu()
    start = time.perf_counter()
    job = Job(args)
    save(job)
    write_side_files(job, args.reference)
    size = (job.ckpt / ".metadata").stat().st_size
    files = len(list(job.ckpt.glob("*.distcp")))
    print(f"make_megatron_dist_scale: W={args.world} (TP={args.tp} PP={args.pp} DP={job.dp}), {files} .distcp "
          f"files, .metadata {size / 1e6:.2f} MB, {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
