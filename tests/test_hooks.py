"""Hooks where users already are (distmerge/hooks/, docs/api.md): the Hugging Face Trainer callback in real
Trainer runs (DeepSpeed ZeRO-3 and ZeRO-2, accelerate FSDP2; tests/jobs/hf_trainer_job.py), and the documented
post-training steps of verl, torchtitan and Megatron-LM jobs (tests/jobs/post_training.py) on the fixtures' saves;
each merge byte for byte the CLI's merge of the same save."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from distmerge.errors import InputError
from tests.conftest import REPO, free_port, merge_inproc, tree_bytes

JOB = REPO / "tests" / "jobs" / "hf_trainer_job.py"
DONE = re.compile(r"rank (\d): (\w+): last merged steps \[2\], every save merged steps \[1, 2\] \(\d+ tensors, "
                  r"2 processes\); a further step ran: step 3, loss \d+\.\d+")


def trainer_job(out: Path, *cases: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(JOB), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    said = sorted(DONE.findall(done.stdout))  # the two ranks' lines may interleave
    assert said == sorted((rank, case) for rank in "01" for case in cases), done.stdout
    return done


def assert_as_the_cli(case_dir: Path, tmp_path: Path, *extra: str, input_sub: str = ".") -> None:
    """last/ and every/step-N/ hold exactly what `distmerge merge` writes from run/checkpoint-N."""
    for step in (1, 2):
        cli = tmp_path / f"{case_dir.name}-cli-{step}"
        ckpt = case_dir / "run" / f"checkpoint-{step}" / input_sub
        assert merge_inproc("--input", ckpt, "--output", cli, *extra) == 0
        assert tree_bytes(case_dir / "every" / f"step-{step}") == tree_bytes(cli), step
    assert tree_bytes(case_dir / "last") == tree_bytes(tmp_path / f"{case_dir.name}-cli-2")
    steps = [tree_bytes(case_dir / "every" / f"step-{s}")["model.safetensors"] for s in (1, 2)]
    assert steps[0] != steps[1]  # step 2 trained after step 1's merge
    assert sorted(p.name for p in case_dir.iterdir() if p.name.startswith(".")) == []  # no config folder left


def test_trainer_deepspeed_zero3_and_zero2_merge_in_the_job_as_the_cli(tmp_path):
    """The issue's end state: a real HF Trainer + DeepSpeed ZeRO-3 run (2 processes, CPU) with the callback ends
    with a merged folder equal to `distmerge merge` of the same save, and a further training step still runs."""
    trainer_job(tmp_path / "job", "z3", "z2")
    for case in ("z3", "z2"):
        assert_as_the_cli(tmp_path / "job" / case, tmp_path)


def test_trainer_accelerate_fsdp2_merges_the_dcp_save_with_the_models_config(tmp_path):
    """accelerate FSDP2, SHARDED_STATE_DICT: checkpoint-N/pytorch_model_fsdp_0/ holds no config; the callback
    writes the model's (config, generation config, tokenizer) for the merge and removes it afterwards. The job
    also checks the last merge against the live model's full state dict (torch.equal)."""
    trainer_job(tmp_path / "job", "fsdp2")
    case = tmp_path / "job" / "fsdp2"
    assert_as_the_cli(case, tmp_path, "--hf-config", str(case / "hf_config"), input_sub="pytorch_model_fsdp_0")
    assert {"tokenizer.json", "generation_config.json"} <= set(tree_bytes(case / "last"))


def test_trainer_stopped_early_merges_its_last_save_at_train_end(ds_ckpts, tmp_path):
    """No group, one process: a run stopped before max_steps (early stopping) merges its last save at
    on_train_end; an earlier save is not merged on its own."""
    from transformers import TrainerControl, TrainerState

    from distmerge.hooks.hf_trainer import DistmergeCallback

    run = ds_ckpts["ds_trainer_z2_w2"]  # the Trainer's output_dir: checkpoint-2/ inside
    callback = DistmergeCallback(tmp_path / "merged")
    args, state = SimpleNamespace(output_dir=str(run)), TrainerState(global_step=2, max_steps=10)
    callback.on_save(args, state, TrainerControl())
    assert callback.results == {} and not (tmp_path / "merged").exists()
    callback.on_train_end(args, state, TrainerControl())
    assert list(callback.results) == [2]
    assert merge_inproc("--input", run / "checkpoint-2", "--output", tmp_path / "cli") == 0
    assert tree_bytes(tmp_path / "merged") == tree_bytes(tmp_path / "cli")


def test_callback_refuses_what_it_cannot_do(tmp_path):
    from distmerge.hooks.hf_trainer import DistmergeCallback, which_save

    with pytest.raises(InputError, match="step"):
        DistmergeCallback(tmp_path / "merged", every_save=True)
    with pytest.raises(InputError, match="sets input, output and group"):
        DistmergeCallback(tmp_path / "merged", group=None)
    with pytest.raises(InputError, match="no DeepSpeed ZeRO save"):
        which_save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert which_save(tmp_path).input is None  # a full save: a Hugging Face model already


POST = REPO / "tests" / "jobs" / "post_training.py"


def test_post_training_steps_merge_in_the_job_as_the_cli(fsdp_ckpts, tt_ckpts, megatron_ckpts, tmp_path):
    """docs/api.md's lines for verl, torchtitan and Megatron-LM, run by a 2-process job on the fixtures' saves
    (made by 4, 2 and 4 ranks): each output byte for byte the CLI's merge of the same save."""
    from tests.conftest import reference_dir

    verl_root = tmp_path / "verl"  # config.trainer.default_local_dir, holding global_step_{N}/ as verl's does
    shutil.copytree(fsdp_ckpts["fsdp2_llama_w4"], verl_root / "global_step_4")
    titan, save = tt_ckpts["tt_qwen3_w2"], megatron_ckpts["megatron_dist_tp2pp2"]
    out = {name: tmp_path / f"job-{name}" for name in ("verl", "torchtitan", "megatron")}
    args = ["verl", verl_root, "4", out["verl"],
            "torchtitan", titan / "checkpoint", "2", titan / "huggingface", out["torchtitan"],
            "megatron", save, reference_dir(save) / "huggingface", out["megatron"]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(POST), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    said = re.findall(r"rank (\d): (\w+): merged \d+ tensors \([\w-]+, saved by \d ranks\) with 2 processes; "
                      r"all_reduce after: 2", done.stdout)
    assert sorted(said) == sorted((r, n) for r in "01" for n in out), done.stdout
    cli = {"verl": ["--input", verl_root / "global_step_4"],
           "torchtitan": ["--input", titan / "checkpoint", "--step", "2", "--hf-config", titan / "huggingface"],
           "megatron": ["--input", save, "--hf-config", reference_dir(save) / "huggingface"]}
    for name, given in cli.items():
        assert merge_inproc(*given, "--output", tmp_path / f"cli-{name}") == 0
        assert tree_bytes(out[name]) == tree_bytes(tmp_path / f"cli-{name}"), name


def test_docs_show_the_post_training_lines_the_job_runs():
    """Every line of the job's step functions (less docstrings; `return ` dropped) is in docs/api.md."""
    from tests.jobs import post_training

    docs = (REPO / "docs" / "api.md").read_text()
    for name, (step, _) in post_training.STEPS.items():
        body = inspect.getsource(step).split('"""')[2].splitlines()[1:]  # after the docstring
        for line in filter(None, (raw.strip().removeprefix("return ") for raw in body)):
            assert line in docs, f"{name}: docs/api.md lacks {line!r}"


def test_nothing_outside_the_hooks_imports_them():
    """The hooks import their training libraries; the merge path (and everything else in distmerge) never
    imports a hook, so `distmerge merge` never loads transformers' Trainer."""
    from tests.helpers.structure import imports, modules

    mods = modules()
    users = sorted(m for m, path in mods.items() if not m.startswith("distmerge.hooks")
                   for i in imports(path, set(mods)) if i.startswith("distmerge.hooks"))
    assert users == []

