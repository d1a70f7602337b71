"""Frontier-scale planning, simulated (issue #14): the real inventory exchange and planner on the inventories a
405B dense FSDP2 checkpoint and a 671B MoE Megatron checkpoint would report, for N merge processes.

    python tests/bench/bench_scale.py [--model 405b 671b] [--world 64 256 1024] [--procs 8 64 256]
                                      [--layout fsdp dcp] [--max-shard-size 5GB] [--budget 128MiB] [--no-memory]

No bytes exist: the inventories are generated as the formats' `open` returns them (one list of
distmerge.formats.base.Fragment per input file, with the files' InputFile records), from the models' real
configs. Everything after that is the merge's own code, called as engine.merge calls it:

    plan.assign_readers          which rank opens which input file (files opened per rank)
    inventory.pack / unpack      what each rank sends in the all-gather of inventories (its pickled size is
                                 the "inventory received" column: every rank receives every rank's part)
    prepare.prepare_merge        coverage, the family's units, output files, owners, rounds

The plan is the same on every rank (that is the design), so it is made once per N; what differs per rank
(files opened, bytes read, bytes written, bytes exchanged) is computed for every simulated rank from it.
Columns: `plan s` = unpacking the gathered inventories + prepare_merge, on one core (what every rank spends
after discovery); `plan state` = tracemalloc's peak over the same (the Python objects a rank holds for the
plan: received inventories, sources, units, files, rounds); `open` = files a rank opens; `read`/`written` =
bytes per rank, max and mean; `rounds` and the largest round's source bytes (all owners) and the most one
owner assembles in a round.

405B `--layout dcp`: the same FSDP2 state dict saved by `dcp.save` (`.metadata` + one `__R_0.distcp` per rank).
Its `.metadata` is written for real from the simulated chunks (scale_metadata.py) and read twice, each in a fresh
process: torch's `pickle.load` and distmerge's read_metadata (seconds and peak RSS on the line below the table).
671B: the legacy `mp_rank_TT_PPP_EEE` save (TP=8 x PP=16 x EP=64, expert TP = TP, 8192 files; non-expert
tensors are in every EP rank's file, as Megatron saves them), named by bench_scale_deepseek.py's table (MTP
included, which distmerge's Megatron family refuses: transformers has no module for it).
"""

from __future__ import annotations

import argparse
import math
import pickle
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_scale_deepseek  # noqa: E402, F401  (registers the DeepSeek-V3 names, MTP included)
import scale_metadata  # noqa: E402

from distmerge import dtypes  # noqa: F401
from distmerge.engine import inventory  # noqa: F401
from distmerge.engine import plan as planning  # noqa: F401
from distmerge.engine.discover import Discovery  # noqa: E402
from distmerge.engine.prepare import OutputSettings, prepare_merge  # noqa: E402
from distmerge.formats.base import Fragment, Hints, InputFile, Scan  # noqa: E402
from distmerge.formats.dcp.keys import model_names  # noqa: E402

BF16, FP32 = "BF16", "F32"
HEADER = 4096  # bytes before the first tensor of a rank file (pickle and zip records): only shifts offsets

# Llama-3.1-405B (config.json of meta-llama/Llama-3.1-405B)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 126, "hidden_size": 16384,
         "num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248, "vocab_size": 128256,
         "tie_word_embeddings": False}
# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3); its MTP module is layer 61 in Hugging Face's naming
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
            "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
            "num_nextn_predict_layers": 1, "vocab_size": 129280, "tie_word_embeddings": False}


# -- Llama-3.1-405B saved by FSDP2: every tensor Shard(0) over W ranks, one rank file each ------------------
def llama_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (c["intermediate_size"], h)),
                (p + "mlp.up_proj.weight", (c["intermediate_size"], h)),
                (p + "mlp.down_proj.weight", (h, c["intermediate_size"]))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def fsdp_inventories(world: int, config: dict = LLAMA, dtype: str = BF16) -> tuple[tuple[InputFile, ...], list]:
    """What FsdpFormat.open returns for each rank file: DTensor Shard(0), torch.chunk's split (ceil(n/W) rows
    per rank, the last ones shorter or empty)."""
    tensors = llama_tensors(config)
    size = dtypes.itemsize(dtype)
    per_file: list[list[Fragment]] = [[] for _ in range(world)]
    at = [HEADER] * world
    for name, shape in tensors:
        rows, row_bytes = shape[0], math.prod(shape[1:]) * size
        chunk = -(-rows // world)
        for r in range(world):
            start = min(r * chunk, rows)
            n = max(0, min(rows - start, chunk))
            offsets = (start,) + (0,) * (len(shape) - 1)
            per_file[r].append(Fragment(name=name, dtype=dtype, global_shape=shape, offsets=offsets,
                                        lengths=(n, *shape[1:]), file_index=r, byte_offset=at[r], key=name))
            at[r] += n * row_bytes
    files = tuple(InputFile(index=r, path=f"model_world_size_{world}_rank_{r}.pt", size=at[r], rank=r)
                  for r in range(world))
    return files, per_file


# -- the same state dict saved by dcp.save (torchtitan's model-only save; accelerate wraps it: {"model": sd}) --
BLOB_HEAD, BLOB_TAIL = 704, 873  # a chunk's torch.save blob before and after its elements (torch 2.13, +-64)


def dcp_inventories(world: int, config: dict = LLAMA, dtype: str = BF16, wrap: str = "") -> tuple[tuple, list]:
    """What DcpFormat.open returns for each __R_0.distcp of dcp.save(FSDP2 state dict): rank R's Shard(0) chunk
    of every tensor, one blob each (in llama_tensors' order; dcp.save follows the state dict's, which moves byte
    offsets only); files in the scan's order (sorted paths: rank 10 before 2), keys named as open names them
    (dcp_keys.model_names). A chunk index held by several ranks (empty shards past the end) is written once, by
    the rank whose plan is smallest so far (dcp's dedup_save_plans)."""
    _, by_rank = fsdp_inventories(world, config, dtype)
    fqn = {f.name: f"{wrap}.{f.name}" if wrap else f.name for f in by_rank[0]}
    names = model_names(sorted(fqn.values()), "/sim")
    holders: dict[tuple, tuple[Fragment, list[int]]] = {}
    for r, frags in enumerate(by_rank):
        for f in frags:
            holders.setdefault((f.name, f.offsets), (f, []))[1].append(r)
    writer, planned = {}, [0] * world
    for index, (f, ranks) in holders.items():
        writer[index] = min(ranks, key=planned.__getitem__)
        planned[writer[index]] += f.nbytes or 1
    files, per_file = [], []
    for index, r in enumerate(sorted(range(world), key=lambda r: f"__{r}_0.distcp")):
        at, frags = 0, []
        for f in (f for f in by_rank[r] if writer[f.name, f.offsets] == r):
            frags.append(replace(f, name=names[fqn[f.name]], key=fqn[f.name], file_index=index,
                                 byte_offset=at + BLOB_HEAD))
            at += BLOB_HEAD + f.nbytes + BLOB_TAIL
        files.append(InputFile(index=index, path=f"__{r}_0.distcp", size=at))
        per_file.append(frags)
    return tuple(files), per_file


# -- DeepSeek-V3 saved by Megatron (legacy mp_rank_TT_PPP_EEE), TP x PP x EP ---------------------------------
REP, COL, ROW = None, 0, 1  # replicated on TP ranks, split on dim 0 (column-parallel), on dim 1 (row-parallel)


def deepseek_layer(c: dict, prefix: str, moe: bool, ep: int, ep_size: int) -> list[tuple[str, tuple, int | None, str]]:
    """(name, global shape, TP split dim, dtype) of one decoder layer's tensors in one EP rank's file."""
    h, heads, qk = c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    a = prefix + "self_attention."
    out = [(prefix + "input_layernorm.weight", (h,), REP, BF16),
           (a + "linear_q_down_proj.weight", (c["q_lora_rank"], h), REP, BF16),
           (a + "linear_q_up_proj.layer_norm_weight", (c["q_lora_rank"],), REP, BF16),
           (a + "linear_q_up_proj.weight", (heads * qk, c["q_lora_rank"]), COL, BF16),
           (a + "linear_kv_down_proj.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h), REP, BF16),
           (a + "linear_kv_up_proj.layer_norm_weight", (c["kv_lora_rank"],), REP, BF16),
           (a + "linear_kv_up_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
            COL, BF16),
           (a + "linear_proj.weight", (h, heads * c["v_head_dim"]), ROW, BF16),
           (prefix + "pre_mlp_layernorm.weight", (h,), REP, BF16)]
    if not moe:
        return out + [(prefix + "mlp.linear_fc1.weight", (2 * c["intermediate_size"], h), COL, BF16),
                      (prefix + "mlp.linear_fc2.weight", (h, c["intermediate_size"]), ROW, BF16)]
    m, f = prefix + "mlp.", c["moe_intermediate_size"]
    out += [(m + "router.weight", (c["n_routed_experts"], h), REP, BF16),
            (m + "router.expert_bias", (c["n_routed_experts"],), REP, FP32),
            (m + "shared_experts.linear_fc1.weight", (2 * f, h), COL, BF16),
            (m + "shared_experts.linear_fc2.weight", (h, f), ROW, BF16)]
    local = c["n_routed_experts"] // ep_size
    for e in range(ep * local, (ep + 1) * local):  # grouped GEMM names, global expert numbers (as open renumbers)
        out += [(m + f"experts.linear_fc1.weight{e}", (2 * f, h), COL, BF16),
                (m + f"experts.linear_fc2.weight{e}", (h, f), ROW, BF16)]
    return out


def stage_layers(layers: int, pp: int) -> list[range]:
    """Megatron's uneven split: the first stages take one layer more."""
    base_n, extra = divmod(layers, pp)
    bounds, at = [], 0
    for s in range(pp):
        n = base_n + (s < extra)
        bounds.append(range(at, at + n))
        at += n
    return bounds


def deepseek_file(c: dict, layers: range, first: bool, last: bool, ep: int, ep_size: int) -> list[tuple]:
    h, vocab = c["hidden_size"], c["vocab_size"]
    out = [("embedding.word_embeddings.weight", (vocab, h), COL, BF16)] if first else []
    for i in layers:
        out += deepseek_layer(c, f"decoder.layers.{i}.", i >= c["first_k_dense_replace"], ep, ep_size)
    if last:
        out += [("decoder.final_layernorm.weight", (h,), REP, BF16), ("output_layer.weight", (vocab, h), COL, BF16)]
        mtp = "mtp.layers.0."
        out += [(mtp + "enorm.weight", (h,), REP, BF16), (mtp + "hnorm.weight", (h,), REP, BF16),
                (mtp + "eh_proj.weight", (h, 2 * h), COL, BF16), (mtp + "final_layernorm.weight", (h,), REP, BF16)]
        out += deepseek_layer(c, mtp + "transformer_layer.", True, ep, ep_size)
    return out


def with_reads(files: tuple[InputFile, ...], per_file: list[list[Fragment]]) -> tuple[InputFile, ...]:
    """Files as the Megatron legacy scan lists them: InputFile.reads = the bytes not replicated in a lower file
    (what the plan reads from each; megatron_legacy._expected_reads computes it from one file per stage).
    --megatron-sizes leaves them unset, to show spreading readers by file size instead."""
    seen: set[tuple] = set()
    out = []
    for file, frags in zip(files, per_file, strict=True):
        fresh = [f for f in frags if (f.name, f.region) not in seen]
        seen.update((f.name, f.region) for f in fresh)
        out.append(replace(file, reads=sum(f.nbytes for f in fresh)))
    return tuple(out)


def megatron_inventories(tp: int, pp: int, ep: int) -> tuple[tuple[InputFile, ...], list[list[Fragment]]]:
    """What MegatronLegacyFormat.open returns per file, in its file order (stage, EP rank, TP rank)."""
    files, per_file = [], []
    for s, layers in enumerate(stage_layers(DEEPSEEK["num_hidden_layers"], pp)):
        for e in range(ep):
            tensors = deepseek_file(DEEPSEEK, layers, s == 0, s == pp - 1, e, ep)
            for t in range(tp):
                index, at, frags = len(files), HEADER, []
                for name, shape, dim, dtype in tensors:
                    lengths, offsets = list(shape), [0] * len(shape)
                    if dim is not None:
                        lengths[dim] //= tp
                        offsets[dim] = t * lengths[dim]
                    frags.append(Fragment(name=name, dtype=dtype, global_shape=shape, offsets=tuple(offsets),
                                          lengths=tuple(lengths), file_index=index, byte_offset=at, key=name))
                    at += frags[-1].nbytes
                per_file.append(frags)
                files.append(InputFile(index=index, path=f"mp_rank_{t:02d}_{s:03d}_{e:03d}/model_optim_rng.pt",
                                       size=at, rank=index))
    return tuple(files), per_file


# -- the measurement -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Case:
    label: str
    scan: Scan
    config: dict
    per_file: list[list[Fragment]]


def fsdp_case(world: int, layout: str = "fsdp") -> Case:
    files, per_file = (dcp_inventories if layout == "dcp" else fsdp_inventories)(world)
    scan = Scan(format=layout, root="/sim", files=files, hf_dir=None, world_size=world)
    saved = "dcp.save of FSDP2" if layout == "dcp" else "FSDP2"
    return Case(label=f"Llama-3.1-405B {saved} W={world}", scan=scan, config=LLAMA, per_file=per_file)


def megatron_case(tp: int, pp: int, ep: int, reads: bool) -> Case:
    files, per_file = megatron_inventories(tp, pp, ep)
    files = with_reads(files, per_file) if reads else files
    hints = Hints(naming="megatron", fc1_shards=tp, expert_fc1_shards=tp)
    scan = Scan(format="megatron", root="/sim", files=files, hf_dir=None, world_size=len(files), hints=hints)
    label = f"DeepSeek-V3 Megatron TP={tp} x PP={pp} x EP={ep} ({len(files)} files{', reads set' * reads})"
    return Case(label=label, scan=scan, config=DEEPSEEK, per_file=per_file)


PER_NODE = 8  # merge processes per node (8 GPUs' worth of a training node), as the issue's 8 nodes x 8


def gathered(case: Case, readers: tuple[int, ...], world: int) -> list[bytes]:
    """Each rank's part of the all-gather of inventories, as the engine sends it (pickled by the collective)."""
    mine: list[list[int]] = [[] for _ in range(world)]
    for i, r in enumerate(readers):
        mine[r].append(i)
    return [pickle.dumps(inventory.pack([f for i in files for f in case.per_file[i]])) for files in mine]


def plan_once(case: Case, parts: list[bytes], world: int, settings: OutputSettings):
    found = Discovery(scan=case.scan, config=case.config, hf_dir="")
    fragments = inventory.unpack([pickle.loads(p) for p in parts])
    hosts = tuple(r - r % PER_NODE for r in range(world))  # nodes of PER_NODE processes: files shared within one
    return prepare_merge(found, fragments, world, settings, hosts=hosts).plan


def per_rank(plan: planning.Plan, world: int) -> dict[str, list[int]]:
    read, written, opened, sent, got = ([0] * world for _ in range(5))
    for r in plan.readers:
        opened[r] += 1
    for i, unit in enumerate(plan.units):
        owner = plan.owner_of_unit[i]  # writes the unit, in its own file or a shared one (Plan.written_by)
        written[owner] += sum(t.nbytes for t in unit.targets)
        for s in unit.sources:
            for frag in plan.sources[s].fragments:
                reader = plan.readers[frag.file_index]
                read[reader] += frag.nbytes
                if reader != owner:
                    sent[reader] += frag.nbytes
                    got[owner] += frag.nbytes
    return {"read": read, "written": written, "open": opened, "sent": sent, "received": got}


def round_sizes(plan: planning.Plan) -> tuple[int, int]:
    """The largest round's source bytes (all owners) and the most one owner assembles in one round."""
    need = {name: math.prod(s.meta.shape) * dtypes.itemsize(s.meta.dtype) for name, s in plan.sources.items()}
    total, one = 0, 0
    for units in plan.rounds:
        by_owner: dict[int, int] = {}
        for i in units:
            owner = plan.owner_of_unit[i]
            by_owner[owner] = by_owner.get(owner, 0) + sum(need[s] for s in plan.units[i].sources)
        total, one = max(total, sum(by_owner.values())), max(one, max(by_owner.values()))
    return total, one


def measure(case: Case, world: int, settings: OutputSettings, memory: bool) -> dict:
    readers = planning.assign_readers(case.scan.files, world)
    parts = gathered(case, readers, world)
    start = time.process_time()
    plan = plan_once(case, parts, world, settings)
    seconds = time.process_time() - start
    peak = 0
    if memory:
        del plan
        tracemalloc.start()
        plan = plan_once(case, parts, world, settings)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    ranks = per_rank(plan, world)
    total, one = round_sizes(plan)
    return {"N": world, "plan_s": seconds, "peak": peak, "inventory": sum(map(len, parts)), "ranks": ranks,
            "rounds": len(plan.rounds), "round_total": total, "round_one": one,
            "fragments": sum(map(len, case.per_file)), "files_out": len(plan.files), "units": len(plan.units),
            "W": len(case.scan.files)}


def row(m: dict) -> str:
    def mm(key: str, scale: float = 1e9, fmt: str = "{:.1f}") -> str:
        values = m["ranks"][key]
        mean = statistics.fmean(values)
        off = (max(values) / mean - 1) * 100 if mean else 0.0
        return f"{fmt.format(max(values) / scale)} / {fmt.format(mean / scale)} (+{off:.1f}%)"
    limit = -(-m["W"] // m["N"]) + 1
    return (f"| {m['N']} | {m['plan_s']:.1f} | {m['peak'] / 1e9:.2f} GB | {m['inventory'] / 1e6:.0f} MB | "
            f"{mm('read')} | {mm('written')} | {max(m['ranks']['open'])} (limit {limit}) | "
            f"{mm('received')} | {m['rounds']} | {m['round_total'] / 1e9:.1f} / {m['round_one'] / 1e9:.2f} GB |")


HEAD = ("| N | plan s | plan state | inventory received | read GB max / mean | written GB max / mean | "
        "open files max | received GB max / mean | rounds | largest round: all / one owner |\n|" + "---|" * 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["405b", "671b"], choices=["405b", "671b"])
    parser.add_argument("--world", nargs="+", type=int, default=[64, 256, 1024], help="FSDP2 rank files W")
    parser.add_argument("--layout", nargs="+", default=["fsdp"], choices=["fsdp", "dcp"], help="405b saved as")
    parser.add_argument("--grid", default="8x16x64", help="Megatron TP x PP x EP (8x16x64)")
    parser.add_argument("--procs", nargs="+", type=int, default=[8, 64, 256], help="merge processes N")
    parser.add_argument("--max-shard-size", type=float, default=5e9, help="bytes (5e9)")
    parser.add_argument("--budget", type=float, default=128 * 2**20, help="bytes per round per rank (128 MiB)")
    parser.add_argument("--megatron-sizes", action="store_true",
                        help="671b: files without .reads (readers spread by file size, as before the scan set them)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass (twice as fast)")
    parser.add_argument("--no-metadata", action="store_true",
                        help="--layout dcp: skip writing the simulated .metadata and timing its readers")
    args = parser.parse_args()
    settings = OutputSettings(max_shard_bytes=int(args.max_shard_size), budget_bytes=int(args.budget))
    cases = []
    if "405b" in args.model:
        cases += [lambda w=w, lay=lay: fsdp_case(w, lay) for lay in args.layout for w in args.world]
    if "671b" in args.model:
        tp, pp, ep = (int(x) for x in args.grid.split("x"))
        cases.append(lambda: megatron_case(tp, pp, ep, not args.megatron_sizes))
    print(f"max shard {args.max_shard_size / 1e9:g} GB, budget {args.budget / 2**20:g} MiB; times are CPU seconds of "
          "one process", flush=True)
    for make in cases:
        case = make()
        first = None
        for n in args.procs:
            m = measure(case, n, settings, not args.no_memory)
            if first is None:
                first = m
                print(f"\n### {case.label}: {m['fragments']:,} fragments, {m['units']:,} units, "
                      f"{m['files_out']} output files\n\n{HEAD}")
            print(row(m), flush=True)
        if case.scan.format == "dcp" and not args.no_metadata:
            print("\n" + scale_metadata.line(case.scan.files, case.per_file, (BLOB_HEAD, BLOB_TAIL)), flush=True)
        del case


if __name__ == "__main__":
    main()
