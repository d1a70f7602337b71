"""launch/gpu_check.sh, rehearsed on CPU (its --dry-run), and the parts of the CUDA path that run without a GPU:
device resolution, the one-line error when CUDA is asked for but absent, which GPU each process takes, and
the one-line error when NCCL refuses to start."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from distmerge.distributed import comm as comm_mod
from distmerge.errors import DistmergeError, InputError
from distmerge.front.cli import main as distmerge_main
from tests.conftest import REPO

SCRIPT = REPO / "launch" / "gpu_check.sh"
DRY_CASES = ["fsdp2_llama_shard1_w4", "fsdp2_llama_shard1_w4.fp8-block", "dcp_llama_wrapped_w4", "megatron_tp2pp2",
             "bench"]


def fixture_root(ckpts: dict[str, Path]) -> Path:
    return next(iter(ckpts.values())).parent


def gpu_check(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    # an 8 MB benchmark checkpoint (the dry run's default is 40 MB): every step is rehearsed, at less CPU
    env = {**os.environ, "DISTMERGE_GPU_CHECK_DRY_RUN": "0", "GPU_CHECK_SIZE": "8000000"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


@pytest.fixture(scope="module")
def dry_run(fsdp_ckpts, dcp_ckpts, megatron_ckpts, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One dry run for the module, on the session's fixtures (the script builds its own when not given them)."""
    work = tmp_path_factory.mktemp("gpu_check")
    given = {"fsdp": fsdp_ckpts, "dcp": dcp_ckpts, "megatron": megatron_ckpts}
    fixtures = [a for kind, ckpts in given.items() for a in ("--fixtures", f"{kind}={fixture_root(ckpts)}")]
    return gpu_check("--dry-run", *fixtures, "--work", str(work)), work


def test_dry_run_passes_and_prints_each_comparison(dry_run):
    """Every step of the GPU check runs on CPU (gloo, 2 processes) and finds each output byte-identical to the
    one-process CPU merge; fixtures are verified against their trained weights, the benchmark checkpoint by
    `distmerge verify`. Shown to fail: with the script writing both paths into one folder (an early version
    did: the comparison then saw one folder twice), the "same folder" guard made it exit 1."""
    result, work = dry_run
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for case in DRY_CASES:
        assert f"compare  {case} (cpu/gloo x2 vs cpu x1): IDENTICAL" in out, out
        assert (work / "out" / f"{case}.gpu-path" / "model.safetensors.index.json").is_file()
        assert (work / "out" / f"{case}.cpu-path" / "model.safetensors.index.json").is_file()
    assert out.count("verify: PASS") == len(DRY_CASES) + 1, out  # the bench checkpoint also merged in memory
    assert "verify   bench on cpu/gloo x2: verify: PASS" in out
    assert "verify   bench checkpoint in memory on cpu/gloo x2: verify: PASS" in out
    # the API inside a running job (step 2b): the job's group, then distmerge's side group; the CPU's bytes
    assert re.search(r"^in-job   fsdp2_llama_shard1_w4 on cpu/gloo x2: rank 0: merged 21 tensors .* process "
                     r"unchanged$", out, re.MULTILINE), out
    for how in ("cpu/gloo x2", "side group"):
        assert f"compare  in-job fsdp2_llama_shard1_w4 ({how} vs cpu x1): IDENTICAL" in out, out
    assert "FP8 weights within the FP8 bound" in out  # the --quantize case, verified against its trained weights
    assert "vllm     skipped in a dry run" in out
    assert "== timings" in out and "gpu_check: PASS" in out
    assert "nvidia-smi" not in out and "NVIDIA-SMI" not in out


def test_compare_step_fails_on_one_changed_byte(dry_run, tmp_path):
    """The comparison the check ends each case with: identical folders pass, one flipped byte in a weights
    file, a missing file or an unfinished merge (no index) fail with a line naming it, exit 1. Shown to fail:
    with `diff -rq` replaced by `true` in compare_folders, the flipped byte passed."""
    _, work = dry_run
    a, b = work / "out" / "fsdp2_llama_shard1_w4.gpu-path", tmp_path / "b"
    shutil.copytree(a, b)
    same = gpu_check("--compare", str(a), str(b))
    assert same.returncode == 0 and "IDENTICAL" in same.stdout, same.stdout + same.stderr

    weights = b / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    flipped = gpu_check("--compare", str(a), str(b))
    assert flipped.returncode == 1, flipped.stdout
    assert "DIFFERENT" in flipped.stdout and f"differ: byte {len(data) - 4}" in flipped.stdout, flipped.stdout

    (b / "tokenizer.json").unlink()
    missing = gpu_check("--compare", str(a), str(b))
    assert missing.returncode == 1 and f"Only in {a}: tokenizer.json" in missing.stdout, missing.stdout

    (b / "model.safetensors.index.json").unlink()
    unfinished = gpu_check("--compare", str(a), str(b))
    assert unfinished.returncode == 1 and "not a finished merge" in unfinished.stdout, unfinished.stdout


def test_gpu_mode_without_cuda_says_so():
    """Without a GPU the real check refuses in one line and exit 2 instead of failing later. Shown to fail: with
    the device check removed, the script went on to build checkpoints."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check would run for real")
    result = gpu_check("--work", "/nonexistent-not-created", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().startswith("gpu_check: error: torch ") and "--dry-run" in result.stderr
    assert not Path("/nonexistent-not-created").exists()


# -- the CUDA path, where it runs on a CPU ---------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_device_resolution(no_cuda):
    """auto means the CPU without CUDA; cuda without CUDA is a user error raised before any process group, so
    only rank 0 reports it. Shown to fail: the old resolve_device returned "cuda" unchecked."""
    assert comm_mod.resolve_device("auto") == "cpu"
    assert comm_mod.resolve_device("cpu") == "cpu"
    with pytest.raises(InputError, match=r"^--device cuda: .*; use --device cpu") as caught:
        comm_mod.resolve_device("cuda")
    assert caught.value.before_group


@pytest.mark.parametrize("command", ["merge", "verify"])
def test_cuda_asked_but_absent_is_one_line(no_cuda, command, fsdp_ckpts, tmp_path, capsys, monkeypatch):
    """merge and verify with --device cuda on a machine without CUDA: exit 1, one `distmerge: error:` line on
    rank 0, nothing on the other ranks, no output folder. Shown to fail: with the checks in resolve_device and
    cuda_device disabled, the line was "rank 0: AttributeError: module 'torch._C' has no attribute
    '_cuda_setDevice'"."""
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    args = {"merge": ["merge", "--input", str(ckpt), "--output", str(tmp_path / "out")],
            "verify": ["verify", "--merged", str(tmp_path), "--reference", str(tmp_path)]}[command]
    assert distmerge_main([*args, "--device", "cuda"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: --device cuda: "), lines
    assert not (tmp_path / "out").exists()

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own under a launcher: put ours back
    try:
        assert distmerge_main([*args, "--device", "cuda"]) == 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert capsys.readouterr().err == ""


def test_each_process_takes_its_own_gpu_round_robin():
    """LOCAL_RANK -> GPU: one each while there are enough, shared beyond (NCCL then decides)."""
    assert [comm_mod.gpu_for_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [comm_mod.gpu_for_rank(r, 1) for r in range(3)] == [0, 0, 0]
    assert [comm_mod.gpu_for_rank(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]


def test_comm_on_cuda_without_cuda_is_a_user_error(no_cuda):
    """A Comm built for cuda directly (not through resolve_device) refuses the same way."""
    with pytest.raises(InputError, match="--device cuda"):
        comm_mod.Comm(device="cuda", timeout_s=10)


def test_nccl_refusal_is_one_line(monkeypatch):
    """NCCL refusing to start (here: 2 processes on 1 GPU, as recent NCCL versions do) is one DistmergeError
    that says why and what to do, raised before the group exists (rank 0 reports it), and the half-made group
    is destroyed. torch.cuda and init_process_group are stand-ins: no GPU here. The device is set before NCCL
    starts, LOCAL_RANK 1 -> cuda:0. Shown to fail: before the fix, set_device(1) raised "invalid device
    ordinal" outside the error handling (a traceback on every rank)."""
    import torch.distributed as dist

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    def refuse(backend, **kwargs):
        assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 0) and chosen
        assert kwargs["store"] == "the job's store, prefixed" and (kwargs["rank"], kwargs["world_size"]) == (1, 2)
        raise dist.DistBackendError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)\nmore")

    monkeypatch.setattr(comm_mod, "_own_store", lambda timeout: ("the job's store, prefixed", 1, 2))  # no torchrun
    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistmergeError) as caught, comm_mod.process_group(device="cuda", timeout_s=10):
        pass
    message = str(caught.value)
    assert "\n" not in message and message.startswith("NCCL could not start on cuda:0 (DistBackendError: NCCL error")
    assert "2 processes on 1 GPU(s)" in message and "or use --device cpu" in message
    assert chosen == [torch.device("cuda", 0)] and caught.value.before_group


def test_lora_fuse_runs_on_the_cpu():
    """The fused LoRA weight is W + (B @ A) * scale in float32, cast back, and comes back on the CPU (where it
    is computed for every --device: cuBLAS sums in another order; the GPU side is checked by gpu_check.sh's
    --lora merge case)."""
    from distmerge.families.lora.transforms import lora_fuse

    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen, dtype=torch.bfloat16) for shape in ((6, 5), (2, 5), (6, 2)))
    (fused,) = lora_fuse([w, a, b], scale=0.5)
    assert fused.device.type == "cpu" and fused.dtype == torch.bfloat16
    assert torch.equal(fused, (w.float() + (b.float() @ a.float()) * 0.5).to(torch.bfloat16))
