"""Every example in docs/*.md is run: here (RUN), by the test it names (ELSEWHERE), or not, with the reason (NOT_RUN).

An example is a fenced block labelled python, bash or sh, or one holding a command line (a `$ ` prompt, or a line
that starts with python, torchrun, distmerge, sbatch, pip, ...); layouts, printed outputs and formulas are not.
Each entry names its page and a piece of the example's text found in no other example of that page, so an
example that is added, or changed where its entry looks, fails test_every_example_has_one_entry until it is given
one.

How RUN runs an example, in a fresh folder where its `layout` puts the paths it names (links to the session's
fixtures, or folders made from them), with `replace` applied to its code (a save's tag or step number):

- a shell block: each command that runs distmerge (`python -m distmerge`, `distmerge`, `torchrun ... -m distmerge`)
  runs in this process through cli.main, as one process: N processes write the same bytes (the byte-identical
  tests of tests/test_merge_*.py), so one stands for N here, and a test job's start-up is spared. A block of `$ `
  commands is a transcript: its commands run in turn in one folder, and what it shows after each is checked where it
  is not a timing or a size of memory: the exit status (1 where it shows `distmerge: error:` or `verify: FAIL`, or
  `echo $?` says so), each `distmerge: error:` and `verify:` line, exactly (where the page abridged one with `...`,
  any text there), and a summary line (`distmerge: 21
  tensors, 1 file(s), 824.06 KB`) up to its timing. A block without prompts lists alternatives: each command runs
  in a folder of its own and must exit 0. `python -c CODE` runs CODE here.
- a python block: exec'd, with `names` defined first (what the page calls CHECKPOINT and the like), then `check`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from distmerge.front.cli import main as distmerge_main
from tests.conftest import REPO, free_port, merge_inproc, reference_dir
from tests.helpers.verify import bump

DOCS = REPO / "docs"
LANGS = ("python", "bash", "sh")
COMMAND = re.compile(r"^\s*(\$ |python3? |torchrun |distmerge |bash |sbatch |pip |sudo |export |flock |\.venv/|"
                     r"[A-Z_]+=\S* |slurm/|train_job=)")


@dataclass(frozen=True)
class Example:
    page: str
    line: int  # of the opening fence
    lang: str
    body: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.body) + "\n"


def examples() -> list[Example]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):  # the user docs and the maintainers' (docs/dev/)
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            body = tuple(text[len(fence[1]):] for text in lines[i + 1:end])
            if fence[2] in LANGS or any(COMMAND.match(text) for text in body):
                found.append(Example(page.relative_to(DOCS).as_posix(), i + 1, fence[2], body))
            i = end + 1
    return found


# -- the paths an example names ---------------------------------------------------------------------------------------

FIXTURES = {"fsdp": "fsdp_ckpts", "dcp": "dcp_ckpts", "ds": "ds_ckpts", "megatron": "megatron_ckpts",
            "tt": "tt_ckpts"}
LLAMA = "fsdp:fsdp2_llama_w4"  # the 4-rank FSDP2 save most pages show (21 tensors, 824.06 KB)
REF = LLAMA + ":ref"


def fixture(spec: str, request) -> Path:
    """'family:case' -> the case's folder; ':ref' its reference beside it; ':ref/x' or '/x' a path inside."""
    family, case, *rest = spec.split(":")
    path = request.getfixturevalue(FIXTURES[family])[case.split("/")[0]]
    if "/" in case:
        path = path / case.split("/", 1)[1]
    if rest:
        sub = rest[0].split("/", 1)
        path = reference_dir(path) / (sub[1] if len(sub) > 1 else "")
    return path


def merged(spec: str, *options: str):
    """A folder merge writes from the fixture `spec` (with `options`), as a page's earlier command made it."""
    def make(dst: Path, request) -> None:
        assert merge_inproc("--input", fixture(spec, request), "--output", dst, *options) == 0
    return make


def edited_copy(spec: str, edit: Callable[[dict[str, torch.Tensor]], None], *, merge: bool = False):
    """A copy of a reference (or, with merge, a one-file merge of a checkpoint) whose tensors `edit` changes."""
    def make(dst: Path, request) -> None:
        if merge:
            merged(spec)(dst, request)
        else:
            shutil.copytree(fixture(spec, request), dst)
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        if merge:  # the index follows, as a consistent (if wrong) output would have it
            index = dst / "model.safetensors.index.json"
            index.write_text(json.dumps({**json.loads(index.read_text()),
                                         "weight_map": dict.fromkeys(tensors, "model.safetensors")}))
    return make


def broken(t: dict[str, torch.Tensor]) -> None:
    """docs/verify.md's `broken`: the head gone, one norm element moved by 0.01, one weight cast to bf16."""
    del t["lm_head.weight"]
    bump("model.norm.weight")(t)
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].bfloat16()


def transposed(t: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.mlp.gate_proj.weight"
    t[name] = t[name].T.contiguous()


def to_bf16(t: dict[str, torch.Tensor]) -> None:
    t.update({k: v.bfloat16() for k, v in t.items()})


def averaged(*specs: str, options: tuple[str, ...] = ()):
    """A folder merge --average writes from the fixtures `specs`, as a page's earlier command made it."""
    def make(dst: Path, request) -> None:
        ins = [a for spec in specs for a in ("--input", fixture(spec, request))]
        assert merge_inproc(*ins, "--output", dst, "--average", *options) == 0
    return make


def reference_average(*specs: str):
    """docs/average.md's reference: the formula over the fixtures' full state dicts, as a finished model."""
    def make(dst: Path, request) -> None:
        refs = [load_file(fixture(spec + ":ref/model.safetensors", request)) for spec in specs]
        out = {}
        for name, first in refs[0].items():
            acc = torch.zeros(first.shape, dtype=torch.float64)
            for ref in refs:
                acc += (1 / len(refs)) * ref[name].double()
            out[name] = acc.to(first.dtype)
        dst.mkdir()
        save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(fixture(specs[0] + "/huggingface/config.json", request), dst / "config.json")
    return make


def ema_ckpt(dst: Path, request) -> None:
    from tests.helpers.average import ema_save

    ema_save(request.getfixturevalue("dcp_ckpts"), dst)


def copied(spec: str):
    def make(dst: Path, request) -> None:
        shutil.copytree(fixture(spec, request), dst)
    return make


def unfinished(dst: Path, request) -> None:
    merged(LLAMA, "--max-shard-size", "300KB")(dst, request)
    (dst / "model.safetensors.index.json").unlink()


def verl_megatron_actor(dst: Path, request) -> None:
    """verl's Megatron layout: actor/dist_ckpt/ (a torch_dist save) + actor/huggingface/ (tests/test_merge_megatron)."""
    ckpt = fixture("megatron:megatron_dist_tp2pp2", request)
    shutil.copytree(ckpt / "iter_0000001", dst / "dist_ckpt")
    shutil.copytree(reference_dir(ckpt) / "huggingface", dst / "huggingface")


def verl_run(dst: Path, request) -> None:
    """docs/watch.md's run: verl's global_step_{100,200,300}/actor (the 4-rank FSDP2 save, files linked), the
    marker naming 200."""
    for step in (100, 200, 300):
        shutil.copytree(fixture(LLAMA, request), dst / f"global_step_{step}" / "actor", copy_function=os.link)
    (dst / "latest_checkpointed_iteration.txt").write_text("200")


def watched(namespace: dict, out: str) -> None:
    result = namespace["result"]
    assert result.merged == ["global_step_100/actor", "global_step_200/actor"] and not result.failed
    assert "global_step_300/actor still being written" in out


def build(layout: dict[str, str | Callable], root: Path, request) -> None:
    for name, source in layout.items():
        dst = root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if callable(source):
            source(dst, request)
        else:
            dst.symlink_to(fixture(source, request))


# -- running an example -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    layout: dict[str, str | Callable] = field(default_factory=dict)
    replace: dict[str, str] = field(default_factory=dict)
    names: dict[str, object] = field(default_factory=dict)  # python: defined before the block runs
    check: Callable[[dict, str], None] | None = None  # python: (its namespace, what it printed)


def commands(body: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it): continuations joined, comments and blank lines dropped."""
    found: list[tuple[str, list[str]]] = []
    prompted = any(text.startswith("$ ") for text in body)
    pending = ""
    for text in body:
        if pending:
            pending += " " + text.strip()
        elif prompted and not text.startswith("$ "):
            if found:
                found[-1][1].append(text)
            continue
        else:
            pending = text.removeprefix("$ ").strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        command = re.sub(r"\s+#.*$", "", pending).strip()
        pending = ""
        if command and not command.startswith("#"):
            found.append((command, []))
    return found


def distmerge_argv(command: str) -> list[str] | None:
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        argv = argv[argv.index("-m") + 1:]
    elif argv[:2] == ["python", "-m"]:
        argv = argv[2:]
    return argv[1:] if argv and argv[0] == "distmerge" else None


def shown(lines: list[str]) -> tuple[int, list[str], list[str]]:
    """What a transcript shows after a command: its exit status, the lines to find exactly, the summaries."""
    exact = [t for t in lines if t.startswith(("distmerge: error: ", "verify: "))]
    summaries = [t.split(" in ")[0] for t in lines if re.match(r"distmerge: \d+ tensors, ", t)]
    failed = any(t.startswith(("distmerge: error: ", "verify: FAIL")) for t in exact)
    return int(failed), exact, summaries


def run_shell(example: Example, spec: Run, root: Path, request, capsys, monkeypatch) -> None:
    prompted = any(text.startswith("$ ") for text in example.body)
    code = "\n".join(example.body)
    for old, new in spec.replace.items():
        code = code.replace(old, new)
    status = None
    for n, (command, after) in enumerate(commands(tuple(code.splitlines()))):
        where = root / ("transcript" if prompted else f"alternative-{n}")
        if not where.exists():
            where.mkdir()
            build(spec.layout, where, request)
        monkeypatch.chdir(where)
        if command == "echo $?":
            assert [status] == [int(t) for t in after], f"{example.page}:{example.line}: exit status {status}"
            continue
        if command.startswith("python -c "):
            exec(shlex.split(command)[2], {})
            continue
        argv = distmerge_argv(command)
        assert argv is not None, f"{example.page}:{example.line}: no way to run {command!r} here"
        capsys.readouterr()
        status = distmerge_main(argv)
        out, err = capsys.readouterr()
        printed = (out + err).splitlines()
        want, exact, summaries = shown(after)
        assert status == want, f"{example.page}:{example.line}: {command!r} exited {status}:\n{out}{err}"
        for text in exact:  # a line the page abridged with "..." stands for any text there
            pattern = re.compile(".*".join(map(re.escape, text.split("..."))))
            assert any(pattern.fullmatch(p) for p in printed), \
                f"{example.page}:{example.line}: {command!r} did not print\n{text}\nbut\n{out}{err}"
        for text in summaries:
            assert any(p.startswith(text + " in ") for p in printed), f"{example.page}:{example.line}: {text}"


def run_python(example: Example, spec: Run, root: Path, request, capsys, monkeypatch) -> None:
    build(spec.layout, root, request)
    monkeypatch.chdir(root)
    code = "\n".join(example.body)
    for old, new in spec.replace.items():
        code = code.replace(old, new)
    namespace = {"__name__": "docs_example", **spec.names}
    exec(compile(code, f"docs/{example.page}:{example.line}", "exec"), namespace)
    if spec.check:
        spec.check(namespace, capsys.readouterr().out)


def in_a_one_process_job(monkeypatch) -> None:
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)


def merged_and_printed(namespace: dict, out: str) -> None:
    assert "not merged" not in out, out
    assert namespace["result"].tensors == 21


def job_merged(namespace: dict, out: str) -> None:
    assert namespace["checked"].passed and namespace["result"].tensors == 21


# -- every example, and what is done with it --------------------------------------------------------------------------

ACTOR = {"actor": LLAMA, "reference": REF}
VERIFY_PAGE = {**ACTOR, "merged": merged(LLAMA, "--max-shard-size", "300KB")}
BENCHMARK = "a benchmark: minutes and gigabytes (tests/bench), run by hand and recorded, never by the tests"
SLURM = ("needs a SLURM cluster, which slurm/ci/setup.sh installs and starts as root: tests/test_slurm.py runs "
         "merge.sbatch on it in CI")

AVERAGED = ("fsdp:fsdp2_llama_w1", "fsdp:fsdp2_llama_w4", "dcp:dcp_llama_w2")  # docs/average.md's three saves

def tiny_llama_hf(dst: Path, request) -> None:
    """docs/import.md's hf_model: the Megatron fixtures' seeded tiny Llama, as save_pretrained writes it."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES["llama"]).save_pretrained(dst, safe_serialization=True)


def tiny_qwen3_moe_hf(dst: Path, request) -> None:
    """docs/import.md's qwen3_moe: the Megatron fixtures' seeded tiny Qwen3-MoE, as save_pretrained writes it."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES["qwen3_moe"]).save_pretrained(dst, safe_serialization=True)


def tiny_deepseek_v3_hf(dst: Path, request) -> None:
    """docs/import.md's deepseek_v3: the tiny DeepSeek-V3 with its MTP layer (tests/helpers/importing.py)."""
    from tests.helpers.importing import save_tiny_deepseek_v3

    save_tiny_deepseek_v3(dst)


def tiny_llama4_hf(dst: Path, request) -> None:
    """docs/import.md's llama4: the Megatron fixtures' seeded tiny Llama with 4 layers (pipeline stages)."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES["llama4"]).save_pretrained(dst, safe_serialization=True)


def imported_four_files(namespace: dict, printed: str) -> None:
    """docs/import.md's API example: TP=2 x PP=2 written as four files, the vocabulary of 1001 padded for TP=2."""
    assert printed.split() == ["4", "1024"], printed
    assert sorted(p.name for p in Path("megatron_ckpt/release").glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)]


def tiny_qwen2_hf(dst: Path, request) -> None:
    """docs/import.md's qwen2_model: the Megatron fixtures' seeded tiny Qwen2 (a family torchtitan lacks)."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES["qwen2"]).save_pretrained(dst, safe_serialization=True)


RUN: dict[tuple[str, str], Run] = {
    ("import.md", "$ python -m distmerge import --input deepseek_v3 --output dsv3_ckpt --tp 2 --ep 2"): Run(
        layout={"deepseek_v3": tiny_deepseek_v3_hf}),
    ("import.md", "$ python -m distmerge import --input deepseek_v3 --output titan_dsv3 --to torchtitan"): Run(
        layout={"deepseek_v3": tiny_deepseek_v3_hf}),
    ("import.md", "$ python -m distmerge import --input hf_model --output titan_ckpt --to torchtitan"): Run(
        layout={"hf_model": tiny_llama_hf, "qwen2_model": tiny_qwen2_hf, "qwen3_moe": tiny_qwen3_moe_hf}),
    ("import.md", "$ python -m distmerge import --input hf_model --output megatron_ckpt --tp 2 --pp 2"): Run(
        layout={"hf_model": tiny_llama_hf}),
    ("import.md", "$ python -m distmerge import --input llama4 --output vpp_ckpt --tp 2 --pp 2 --vpp 2"): Run(
        layout={"llama4": tiny_llama4_hf}),
    ("import.md", 'distmerge.import_checkpoint("hf_model", "megatron_ckpt", tp=2, pp=2)'): Run(
        layout={"hf_model": tiny_llama_hf}, check=imported_four_files),
    ("import.md", "$ python -m distmerge import --input qwen3_moe --output moe_ckpt --tp 2 --ep 2"): Run(
        layout={"qwen3_moe": tiny_qwen3_moe_hf}),
    ("average.md", "--input ckpts/global_step_800/actor --input ckpts/global_step_900/actor"): Run(
        layout={"ckpts/global_step_800/actor": "fsdp:fsdp2_llama_w1",
                "ckpts/global_step_900/actor": "fsdp:fsdp2_llama_w2", "ckpts/global_step_1000/actor": LLAMA,
                "run/global_step_900/actor": "fsdp:fsdp2_llama_w2", "dcp_save/step-1000": "dcp:dcp_llama_w2"}),
    ("average.md", 'distmerge.merge(["fsdp2_llama_w2", "dcp_llama_w2"]'): Run(
        layout={"fsdp2_llama_w2": "fsdp:fsdp2_llama_w2", "dcp_llama_w2": "dcp:dcp_llama_w2"},
        check=lambda namespace, out: assert_equal(out, "21 average of 2 inputs, weights 0.75, 0.25\n")),
    ("average.md", "--input fsdp2_llama_w1 --input fsdp2_llama_w4 --input dcp_llama_w2 --output averaged --average"):
        Run(layout={spec.split(":")[1]: spec for spec in AVERAGED}),
    ("average.md", "refs = [load_file("): Run(
        layout={**{spec.split(":")[1] + "_reference": spec + ":ref" for spec in AVERAGED},
                "averaged": averaged(*AVERAGED)},
        check=lambda namespace, out: assert_equal(out, "21 tensors equal to the formula\n")),
    ("average.md", "--input fsdp2_llama_w4 --input fsdp2_llama_bf16_w4 --output mixed --average"): Run(
        layout={"fsdp2_llama_w4": LLAMA, "fsdp2_llama_bf16_w4": "fsdp:fsdp2_llama_bf16_w4",
                "fsdp2_llama_w1": "fsdp:fsdp2_llama_w1"}),
    ("average.md", "python -m distmerge verify --merged averaged --reference reference_average"): Run(
        layout={"averaged": averaged(*AVERAGED), "reference_average": reference_average(*AVERAGED)}),
    ("average.md", "--merged fsdp2_llama_w4 --merged dcp_llama_w2 --average --reference averaged"): Run(
        layout={**{spec.split(":")[1]: spec for spec in AVERAGED}, "averaged": averaged(*AVERAGED),
                "reference_average": reference_average(*AVERAGED)}),
    ("average.md", "python -m distmerge merge --input ema_ckpt --output live"): Run(layout={"ema_ckpt": ema_ckpt}),
    ("average.md", "python -m distmerge merge --input lora_a --input lora_b"): Run(
        layout={"lora_a": "fsdp:fsdp2_llama_lora_w2", "lora_b": copied("fsdp:fsdp2_llama_lora_w2")}),
    ("api.md", "try:"): Run(
        layout={"ckpts/global_step_1000/actor": LLAMA, "hf_model": REF}, check=merged_and_printed),
    ("api.md", 'dist.init_process_group("gloo")'): Run(
        layout=ACTOR, names={"checkpoint": "actor", "reference": "reference"}, check=job_merged),
    ("dcp.md", "torchrun --nproc-per-node 8 -m distmerge merge --input ckpt/step-1000"): Run(
        layout={"ckpt/step-1000": "dcp:dcp_llama_w2", "pytorch_model_fsdp_0": "dcp:dcp_llama_wrapped_w4",
                "path/to/hf_model": "dcp:dcp_llama_wrapped_w4/huggingface"}),
    ("deepspeed.md", "torchrun --nproc-per-node 8 -m distmerge merge --input output/checkpoint-1000"): Run(
        layout={"output/checkpoint-1000": "ds:ds_trainer_z2_w2/checkpoint-2", "ckpt": "ds:ds_z1_bf16_w2",
                "hf_model": "ds:ds_z1_bf16_w2/huggingface"},
        replace={"global_step500": "global_step2"}),
    ("deepspeed.md", "python -m distmerge merge --input ckpt/checkpoints_ppo/_actor"): Run(
        layout={"ckpt/checkpoints_ppo/_actor": "ds:ds_openrlhf_z2_w2/_actor",
                "ckpt/ppo-model": "ds:ds_openrlhf_z2_w2:ref/hf_model"}),
    ("deepspeed.md", "python -m distmerge merge --input out/checkpoint-500"): Run(
        layout={"out/checkpoint-500": "ds:ds_trainer_lora_z2_w2/checkpoint-2",
                "base": "ds:ds_trainer_lora_z2_w2:ref/base"}),
    ("deepspeed.md", "torchrun --nproc-per-node 2 -m distmerge merge --input ds_trainer_z3_qwen2_w2"): Run(
        layout={"ds_trainer_z3_qwen2_w2": "ds:ds_trainer_z3_qwen2_w2", "ds_z2_odd_w3": "ds:ds_z2_odd_w3"}),
    ("lora.md", "--output out/ --lora merge"): Run(
        layout={"ckpt/actor": "fsdp:fsdp2_llama_lora_w2"}),
    ("megatron.md", "torchrun --nproc-per-node 8 -m distmerge merge --input ckpts/"): Run(
        layout={"ckpts": "megatron:megatron_tp2pp2", "hf_model": "megatron:megatron_tp2pp2:ref/huggingface",
                "global_step_100/actor": verl_megatron_actor},
        replace={"--iteration 2000": "--iteration 1"}),
    ("megatron.md", "torchrun --nproc-per-node 2 -m distmerge merge --input megatron_tp2pp2"): Run(
        layout={"megatron_tp2pp2": "megatron:megatron_tp2pp2",
                "megatron_tp2pp2_reference": "megatron:megatron_tp2pp2:ref"}),
    ("quantize.md", "python -m distmerge merge --input CKPT --output OUT --quantize fp8-block"): Run(
        layout={"CKPT": "fsdp:fsdp2_llama_w2"}),
    ("quantize.md", "torchrun --nproc-per-node 2 -m distmerge merge --input CKPT --output OUT --dtype bf16"): Run(
        layout={"CKPT": "fsdp:fsdp2_llama_w2"}),
    ("reliability.md", "torchrun --nproc-per-node 8 -m distmerge merge --input CKPT --output OUT --resume"): Run(
        layout={"CKPT": LLAMA}, replace={"[--checksum]": "--checksum"}),
    ("reliability.md", "torchrun --nproc-per-node 2 -m distmerge merge --input /nope --output out"): Run(),
    ("torchtitan.md", "torchrun --nproc-per-node 8 -m distmerge merge --input outputs/"): Run(
        layout={"outputs": "tt:tt_qwen3_w2", "hf_assets": "tt:tt_qwen3_w2/huggingface"},
        replace={"2000": "2"}),
    ("torchtitan.md", "python -m distmerge inspect dump"): Run(layout={"dump": "tt:tt_qwen3_moe_w4"}),
    ("verify.md", "python -m distmerge merge --input actor --output merged --max-shard-size 300KB"): Run(
        layout=ACTOR),
    ("verify.md", "torchrun --nproc-per-node 2 -m distmerge verify --merged merged --reference reference/"): Run(
        layout=VERIFY_PAGE),
    ("verify.md", "python -m distmerge verify --merged merged --reference bumped --min-cosine"): Run(
        layout={**VERIFY_PAGE, "bumped": edited_copy(REF, bump("model.layers.1.mlp.down_proj.weight"))}),
    ("verify.md", "python -m distmerge verify --merged merged --reference extra"): Run(
        layout={**VERIFY_PAGE, "extra": edited_copy(REF, lambda t: t.update(
            {"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(8)}))}),
    ("verify.md", "verify --merged broken --reference reference\n"): Run(
        layout={**ACTOR, "broken": edited_copy(LLAMA, broken, merge=True)}),
    ("verify.md", "python -m distmerge verify --merged broken --reference reference --atol"): Run(
        layout={**ACTOR, "broken": edited_copy(LLAMA, broken, merge=True)}),
    ("verify.md", "python -m distmerge verify --merged transposed"): Run(
        layout={**ACTOR, "transposed": edited_copy(LLAMA, transposed, merge=True)}),
    ("verify.md", "python -m distmerge merge --input actor --output merged_bf16"): Run(layout=ACTOR),
    ("verify.md", "python -m distmerge verify --merged qwen_merged"): Run(
        layout={"qwen_merged": merged("fsdp:fsdp2_qwen2_tied_w4"), "qwen_reference": "fsdp:fsdp2_qwen2_tied_w4:ref"}),
    ("verify.md", 'python -c "import torch; from safetensors.torch import load_file'): Run(layout=VERIFY_PAGE),
    ("verify.md", "verify --merged actor --reference reference\n"): Run(
        layout={**VERIFY_PAGE, "megatron": "megatron:megatron_tp2pp2",
                "megatron_config": "megatron:megatron_tp2pp2:ref/huggingface",
                "megatron_reference.safetensors": "megatron:megatron_tp2pp2:ref/model.safetensors"}),
    ("verify.md", "python -m distmerge verify --merged actor --reference bumped"): Run(
        layout={**ACTOR, "bumped": edited_copy(REF, bump("model.layers.1.mlp.down_proj.weight"))}),
    ("verify.md", "python -m distmerge verify --merged actor --reference reference --dtype bf16"): Run(
        layout={**ACTOR, "reference_bf16": edited_copy(REF, to_bf16)}),
    ("verify.md", "python -m distmerge verify --merged actor --reference reference --logits"): Run(
        layout={**VERIFY_PAGE, "megatron_config": "megatron:megatron_tp2pp2:ref/huggingface"}),
    ("verify.md", "with process_group("): Run(
        layout=ACTOR, names={"CKPT": Path("actor"), "HF_DIR": Path("reference")},
        check=lambda namespace, out: (assert_equal(namespace["status"], 0))),
    ("verify.md", "python -m distmerge verify --merged reference --reference actor"): Run(
        layout={**ACTOR, "bumped": edited_copy(REF, bump("model.layers.1.mlp.down_proj.weight"))}),
    ("verify.md", "python -m distmerge verify --merged unfinished"): Run(
        layout={**VERIFY_PAGE, "unfinished": unfinished}),
    ("watch.md", "latest_checkpointed_iteration.txt', 'w').write('300')"): Run(layout={"ckpts": verl_run}),
    ("watch.md", 'distmerge.watch("ckpts", "merged", once=True)'): Run(layout={"ckpts": verl_run}, check=watched),
    ("watch.md", "--average-last 2\n"): Run(layout={"ckpts": verl_run}),
    ("verl.md", "python -m distmerge test --backend fsdp --local_dir actor --test_hf_dir original_hf_model"): Run(
        layout={"actor": LLAMA, "original_hf_model": REF}),
    ("verl.md", "torchrun --nproc-per-node 2 -m distmerge test --backend fsdp --local_dir actor --test_hf_dir bumped"):
        Run(layout={"actor": LLAMA, "bumped_hf": edited_copy(REF, bump("model.layers.1.mlp.up_proj.weight"))}),
}

ELSEWHERE: dict[tuple[str, str], str] = {
    ("import.md", "python -m distmerge import --input s3://models/llama-hf"):
        "tests/test_import_s3.py::test_a_folder_in_a_bucket_imports_as_on_disk, "
        "tests/test_import_s3.py::test_two_processes_write_into_a_bucket_what_one_writes_into_a_folder",
    ("import.md", "--input megatron_legacy_ckpt --hf-config hf_config_dir"):
        "tests/test_import_megatron_moe.py::test_a_legacy_save_is_written_at_another_layout, "
        "tests/test_import_megatron_moe.py::test_a_legacy_save_imported_merges_back_to_its_source",
    ("extending.md", "class Int8Row(Scheme):"):
        "tests/test_quantize_schemes.py::test_a_registered_scheme_gets_its_own_config",
    ("extending.md", "int8_row.INT8_ROW,"):
        "tests/test_quantize_schemes.py::test_a_registered_scheme_gets_its_own_config",
    ("multinode.md", "slurm/multinode_example.sh 123456"):
        "tests/test_multinode.py::test_the_slurm_example_submits_on_the_training_nodes",
    ("multinode.md", "torchrun --nnodes 2 --node-rank 0"): "tests/test_multinode.py::test_the_transcript_in_the_docs",
    ("watch.md", "torchrun --nproc-per-node 2 -m distmerge watch --input ckpts --output merged --poll 1"):
        "tests/test_watch.py::test_live_watcher_beside_training_merges_each_step_exactly_once_finished",
    ("watch.md", "sbatch --nodes=1 slurm/watch.sbatch"): "tests/test_slurm.py::test_watch_once_after_training",
    ("watch.md", "slurm/watch_example.sh train.sbatch"):
        "tests/test_slurm.py::test_watcher_beside_training_then_the_last_pass",
    ("api.md", "result = distmerge.merge(input, output, *,"):
        "tests/test_options_agree.py::test_docs_api_shows_each_keyword_with_its_default",
    ("api.md", "tests/jobs/api_in_job.py"):
        "tests/test_api.py::test_a_running_job_calls_the_api_on_every_rank",
    ("api.md", "trainer = Trainer("):
        "tests/test_hooks.py::test_trainer_deepspeed_zero3_and_zero2_merge_in_the_job_as_the_cli",
    ("api.md", "torchrun --nproc-per-node 2 tests/jobs/hf_trainer_job.py"):
        "tests/test_hooks.py::test_trainer_deepspeed_zero3_and_zero2_merge_in_the_job_as_the_cli",
    ("api.md", "default_local_dir, total_training_steps"):
        "tests/test_hooks.py::test_post_training_steps_merge_in_the_job_as_the_cli, "
        "tests/test_hooks.py::test_docs_show_the_post_training_lines_the_job_runs",
    ("api.md", "trainer.checkpointer.maybe_wait_for_saving()"):
        "tests/test_hooks.py::test_post_training_steps_merge_in_the_job_as_the_cli, "
        "tests/test_hooks.py::test_docs_show_the_post_training_lines_the_job_runs",
    ("api.md", "save, hf_model = get_args().save"):
        "tests/test_hooks.py::test_post_training_steps_merge_in_the_job_as_the_cli, "
        "tests/test_hooks.py::test_docs_show_the_post_training_lines_the_job_runs",
    ("api.md", "torchrun --nproc-per-node 2 tests/jobs/post_training.py"):
        "tests/test_hooks.py::test_post_training_steps_merge_in_the_job_as_the_cli",
    ("lora.md", "base = AutoModelForCausalLM.from_pretrained"):
        "tests/test_lora.py::test_adapter_loads_with_peft_and_gives_the_trained_logits",
    ("lora.md", "--base-model Qwen2.5-7B/ --lora merge"):
        "tests/test_lora_only.py::test_without_a_base_only_the_adapter_is_written, "
        "tests/test_lora_only.py::test_base_model_folder_gives_the_whole_model, "
        "tests/test_lora_only.py::test_fused_with_the_base_model_folder",
    ("quantize.md", "python -m distmerge merge --input fsdp2_llama_w2 --output fp8-block"):
        "tests/test_quantize_verify.py::test_fp8_folder_passes_within_the_bound",
    ("quantize.md", "python -m distmerge merge --input fsdp2_llama_w2 --output nvfp4"):
        "tests/test_quantize_fp4_verify.py::test_4_bit_folder_passes_within_the_bound",
    ("reliability.md", "python -m distmerge merge --input ckpts/global_step_200/actor"):
        "tests/test_output_lock.py::test_a_requeued_merge_fails_at_once_and_the_first_keeps_its_model",
    ("storage.md", "torchrun --nproc-per-node 2 -m distmerge merge --input s3://"):
        "tests/test_s3.py::test_object_store_merge_equals_the_disk_merge",
    ("storage.md", "python -m distmerge merge --input s3://ckpts/global_step_1000/actor --output merged/"):
        "tests/test_s3.py::test_object_store_merge_equals_the_disk_merge",
    ("storage.md", "torchrun --nproc-per-node 2 -m distmerge merge --input actor --output s3://"):
        "tests/test_s3.py::test_object_store_merge_equals_the_disk_merge",
    ("storage.md", "python -m distmerge merge --input s3://ckpts/global_step_1000/actr"):
        "tests/test_s3.py::test_a_missing_prefix_is_one_line, "
        "tests/test_s3.py::test_another_scheme_is_refused_not_taken_for_a_folder",
    ("verify.md", "python -m distmerge verify --merged merged --reference reference --plot"):
        "tests/test_verify_plot.py::test_plot_without_matplotlib_says_what_to_install",
    ("verify.md", "python -m distmerge verify --merged merged --reference reference --logits"):
        "tests/test_verify.py::test_logits",
    ("verify.md", "python -m distmerge verify --merged fsdp2 --reference megatron --reference-hf-config"):
        "tests/test_verify_two_checkpoints.py::test_one_model_two_strategies_bit_exact_writing_nothing",
    ("verify.md", "python -m distmerge verify --merged fsdp2 --reference megatron_bad"):
        "tests/test_verify_two_checkpoints.py::test_wrongly_interleaved_qkv_fails_naming_q_k_v",
    ("verl.md", "python -m distmerge merge --backend fsdp --local_dir"):
        "tests/test_verl_cli.py::test_fsdp_guide_command, "
        "tests/test_verl_cli.py::test_megatron_guide_command_on_verl_v2_layout, "
        "tests/test_verl_cli.py::test_test_passes_on_the_checkpoint_and_writes_nothing",
}

NOT_RUN: dict[tuple[str, str], str] = {
    ("import.md", "-m torchtitan.train --module llama3 --config llama3_8b"): (
        "torchtitan's training script (GPUs, a data set); tests/test_import_torchtitan.py starts a job from the "
        "folder with torchtitan's own CheckpointManager and its --checkpoint.initial_load_path"),
    ("import.md", "pretrain_gpt.py --load megatron_ckpt --finetune"): (
        "Megatron-LM's training script (GPUs, a data set); tests/test_import_megatron.py loads the folder into "
        "megatron-core's GPTModel as its load_checkpoint does"),
    ("dev/mutations.md", "python tests/mutations/run.py --list"):
        "the mutation check runs the suite's own tests once per planted bug (minutes); run by hand before resolving",
    ("dev/benchmarks-history.md", "python tests/bench/bench_fsdp.py"): BENCHMARK,
    ("dev/benchmarks-history.md", "python tests/bench/bench_megatron.py"): BENCHMARK,
    ("dev/benchmarks-history.md", "python tests/bench/bench_deepspeed.py"): BENCHMARK,
    ("dev/benchmarks-history.md", "torchrun --standalone --nproc-per-node 16 tests/bench/make_ckpt.py"): BENCHMARK,
    ("quantize.md", "python tests/bench/bench_quantize.py --size 0.8GB"): BENCHMARK,
    ("quantize.md", "python tests/bench/bench_quantize.py --scheme nvfp4"): BENCHMARK,
    ("extending.md", "class MyFormat(FormatDefaults):"): "a skeleton with `...` bodies, the shape of a format; "
                                                         "what a registered format must do is "
                                                         "tests/test_contract_formats.py",
    ("extending.md", "class MyFamily:"): "a skeleton with `...` bodies, the shape of a family; what a registered "
                                         "family must do is tests/test_contract_families.py",
    ("gpu.md", "bash launch/gpu_check.sh"): "the first line needs a CUDA GPU; the second, --dry-run, is "
                                            "tests/test_gpu_check.py::test_dry_run_passes_and_prints_each_comparison",
    ("reliability.md", "DISTMERGE_STRESS_TESTS=1 python -m pytest"): "a stress run of tests that takes minutes "
                                                                     "under load, asked for by its variable",
    ("storage.md", "pip install 'distmerge[s3]'"): "installs a package and sets the credentials of a real store; "
                                                   "the tests start their own (tests/s3_server.py)",
    ("verify.md", "torchrun --nproc-per-node 8 -m distmerge verify --merged OUT --reference HF_DIR [--atol"):
        "the forms of the command, with placeholders and optional parts; each form is run by this page's "
        "transcripts (RUN entries of verify.md)",
    **{("slurm.md", start): SLURM for start in (
        "sbatch --cpus-per-task=16 slurm/merge.sbatch", "DISTMERGE_INPUT=/tmp/dm-fx/fsdp2_llama_w4",
        "sbatch --nodes=4 --exclusive", "sbatch --wait --nodes=2", "DISTMERGE_NPROC=8 sbatch --nodes=8",
        "slurm/post_training_example.sh train.sbatch ckpts/global_step_1000/actor", "train_job=$(sbatch",
        "PYTHON=/work/main/.venv/bin/python", "DISTMERGE_INPUT=/tmp/dm-doc/nonexistent",
        "sudo bash slurm/ci/setup.sh", "time bash slurm/ci/setup.sh",
        "tests/test_slurm.py -m slurm --durations=0")},
}


def assert_equal(a, b) -> None:
    assert a == b, (a, b)


def entry_of(example: Example) -> list[tuple[str, tuple[str, str]]]:
    return [(kind, key) for kind, table in (("RUN", RUN), ("ELSEWHERE", ELSEWHERE), ("NOT_RUN", NOT_RUN))
            for key in table if key[0] == example.page and key[1] in example.text]


def test_every_example_has_one_entry():
    """Each example of docs/ is in exactly one of RUN, ELSEWHERE, NOT_RUN, and each entry is one example's. Shown to
    fail with a python block added to docs/lora.md."""
    found = examples()
    problems = [f"docs/{e.page}:{e.line}: {e.body[:2]} has {len(entry_of(e))} entries: {entry_of(e)}"
                for e in found if len(entry_of(e)) != 1]
    problems += [f"entry {key} is {n} examples'" for key in (*RUN, *ELSEWHERE, *NOT_RUN)
                 if (n := sum(key in [k for _, k in entry_of(e)] for e in found)) != 1]
    assert problems == []


def test_the_tests_named_elsewhere_exist():
    for where in ELSEWHERE.values():
        for name in where.split(", "):
            path, test = name.split("::")
            assert f"def {test}(" in (REPO / path).read_text(), name


def test_every_link_between_pages_reaches_its_heading():
    """A link from a page of docs/ (docs/dev/ too) or the README to a page of docs/ (and a heading in it) finds them:
    moving runs to benchmarks-history.md moved the headings other pages pointed at."""
    def anchors(page: Path) -> set[str]:
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}

    broken = []
    for page in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target, anchor in re.findall(r"\]\(((?:\.\./|[\w-]+/)*[\w-]+\.md)?(?:#([\w-]+))?\)", page.read_text()):
            if not target and not anchor:
                continue
            dest = (page.parent / target) if target else page
            if not dest.exists() or (anchor and anchor not in anchors(dest)):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


@pytest.mark.parametrize("key", list(RUN), ids=[f"{page}:{start.strip()}" for page, start in RUN])
def test_example_runs(key, request, tmp_path, capsys, monkeypatch):
    """Shown to fail: with docs/api.md's first example as it was (`verify("merged/", "hf_model/", dtype="bf16")`:
    InputError), a verdict of docs/verify.md changed (max abs 0.01 -> 0.02), a summary of docs/torchtitan.md (39
    tensors -> 38) and the exit status docs/verl.md shows after a failed `test` (1 -> 0)."""
    example = next(e for e in examples() if e.page == key[0] and key[1] in e.text)
    spec = RUN[key]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        if example.lang == "python":
            if "init_process_group" in example.text:
                in_a_one_process_job(monkeypatch)
            run_python(example, spec, tmp_path, request, capsys, monkeypatch)
        else:
            run_shell(example, spec, tmp_path, request, capsys, monkeypatch)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the in-job example's group, the job's to end
            dist.destroy_process_group()
