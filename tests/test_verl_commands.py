"""issue #24's done-when, command by command: each merge command of verl's merger guide and of verl 0.9.1's
`python -m verl.model_merger` docs, only the program name swapped, run by one process and by a 2-process torchrun
job, gives the exact model (torch.equal) and the same bytes; `test` exits 0 on the checkpoint and non-zero naming
the tensor on a reference with one element moved by 1e-2, writing nothing, under torchrun too.

Covered elsewhere: the guide's Megatron command (--tie-word-embedding, --num-attention-heads,
--num-key-value-heads) on verl's schema-v2 tree, N=1 and N=2 (test_verl_cli.py); FSDP against Megatron TP=2 x
PP=2 bit-exact and a wrongly interleaved QKV named, N=1 and N=2 (test_verify_two_checkpoints.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, assert_exact, expected_tensors, load_merged, load_reference, reference_dir, torchrun
from tests.conftest import tree_bytes as files_of
from tests.helpers.verify_checkpoint import bumped_reference
from tests.helpers.verl_cli import committed_files, expected_megatron, run

HF = "{hf}"  # the case's config folder
# case: (fixture family, checkpoint, the command's flags after `merge`, the expected model)
COMMANDS = {
    # the guide's FSDP command and verl's upload, one job (a torchrun job costs seconds)
    "fsdp_low_cpu_mem_usage_upload_private": ("fsdp_ckpts", "fsdp2_llama_w4", [
        "--backend", "fsdp", "--low_cpu_mem_usage", "--hf_upload_path", "me/model", "--private"], expected_tensors),
    "megatron_legacy_script": ("megatron_ckpts", "megatron_qwen2_tp2", ["--backend", "megatron", "--hf_model_path",
                               HF, "--use_cpu_initialization", "--trust-remote-code"], expected_megatron),
    "critic_is_value_model": ("critic_ckpts", "critic_megatron_bias_tp2", ["--backend", "megatron",
                              "--is-value-model", "--hf_model_path", HF], load_reference),
}


@pytest.mark.torchrun
@pytest.mark.parametrize("command", COMMANDS)
def test_merge_command_one_process_and_two(command, request, tmp_path):
    family, case, flags, expected = COMMANDS[command]
    ckpt = request.getfixturevalue(family)[case]
    requests = request.getfixturevalue("hub") if "--hf_upload_path" in flags else None
    flags = [str(reference_dir(ckpt) / "huggingface") if f == HF else f for f in flags]
    args = ["merge", *flags, "--local_dir", ckpt, "--max-shard-size", "100KB", "--quiet", "--target_dir"]
    assert run(*args, tmp_path / "n1") == 0
    job = torchrun(2, *args, tmp_path / "n2")
    assert job.returncode == 0, job.stderr[-3000:]
    assert_exact(load_merged(tmp_path / "n1"), expected(ckpt))
    one, two = files_of(tmp_path / "n1"), files_of(tmp_path / "n2")
    assert len([n for n in one if n.endswith(".safetensors")]) > 1 and one == two
    if requests is not None:  # each run uploaded its output, the second from torchrun's rank 0, privately
        creates = [json.loads(body) for _, path, body in requests if path == "/api/repos/create"]
        assert len(creates) == 2 and all(c.get("visibility") == "private" or c.get("private") is True
                                         for c in creates)  # huggingface_hub 1.x / older
        sent = committed_files([r for r in requests if "/commit/" in r[1]][-1:])
        assert {k: v for k, v in sent.items() if "/" not in k} == two


@pytest.mark.torchrun
def test_test_command_two_processes_writes_nothing(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w4"]
    name = "model.layers.1.mlp.down_proj.weight"
    bad = bumped_reference(reference_dir(ckpt), tmp_path / "bad", name)
    repo = (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns)  # torchrun's working directory
    good = torchrun(2, "test", "--backend", "fsdp", "--local_dir", ckpt, "--test_hf_dir", reference_dir(ckpt))
    assert good.returncode == 0 and good.stdout.splitlines()[-1] == "verify: PASS 21 tensors bit-exact", good.stdout
    failed = torchrun(2, "test", "--backend", "fsdp", "--local_dir", ckpt, "--test_hf_dir", bad, real=True)
    assert failed.returncode != 0
    verdict = [line for line in failed.stdout.splitlines() if line.startswith("verify:")]
    assert verdict == [f"verify: FAIL 1 of 21 tensors: {name} (values differ: max abs 0.01)"], failed.stdout
    assert (sorted(os.listdir(REPO)), os.stat(REPO).st_mtime_ns) == repo and os.listdir(tmp_path) == ["bad"]


def test_test_command_on_a_megatron_save(megatron_ckpts, tmp_path, capsys, monkeypatch):
    """verl's `test --backend megatron` (the legacy script's --hf_model_path for the config)."""
    ckpt = megatron_ckpts["megatron_tp2pp2"]
    args = ["test", "--backend", "megatron", "--local_dir", ckpt, "--hf_model_path",
            reference_dir(ckpt) / "huggingface", "--test_hf_dir"]
    monkeypatch.chdir(tmp_path)
    assert run(*args, reference_dir(ckpt)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "verify: PASS 21 tensors bit-exact"
    name = "model.layers.0.self_attn.k_proj.weight"  # out of the fused QKV
    assert run(*args, bumped_reference(reference_dir(ckpt), tmp_path / "bad", name)) == 1
    assert f"verify: FAIL 1 of 21 tensors: {name} (values differ: max abs 0.01" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["bad"]
