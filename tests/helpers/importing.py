"""What the import tests share (tests/test_import_*.py, docs/import.md's examples): running `distmerge import` in this
process, a folder's bytes, Megatron-LM's vocabulary padding, the torchrun job that has a training library load the
imported folders, and the tiny DeepSeek-V3 source with its MTP layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distmerge.front.cli import main as distmerge_main
from tests.conftest import REPO


def import_inproc(*args: object) -> int:
    """`distmerge import --quiet ARGS` in this process: its exit status."""
    return distmerge_main(["import", "--quiet", *map(str, args)])


def folder_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by its path inside it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def load_with(loader: str, nproc: int, cases: list[str], result: Path) -> dict:
    """tests/fixtures/`loader` in N processes as torchrun starts them (forked: tests/fixtures/build.py run_job): the
    training library's own load of each case, its findings written as JSON to `result`."""
    from tests.fixtures.build import run_job

    argv = ["--result", str(result), *[a for c in cases for a in ("--case", c)]]
    code, output = run_job(REPO / "tests" / "fixtures" / loader, nproc, argv, timeout=400)
    assert code == 0, output[-3000:]
    return json.loads(result.read_text())


def mtp_layer(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """MTP layer num_hidden_layers as DeepSeek-V3's checkpoint names it: a decoder layer shaped as the last one
    (new seeded values, norms near 1), its own parts, and the copies of the embedding and output head."""
    from tests.fixtures import make_megatron_mla as fx

    layers, hidden = fx.HF["num_hidden_layers"], fx.HF["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."

    def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return (1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(shape, generator=gen)

    out = {mtp + n[len(last):]: values(n, tuple(t.shape)) for n, t in sorted(tensors.items()) if n.startswith(last)}
    own = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
           "shared_head.norm.weight": (hidden,)}
    out |= {mtp + n: values(n, shape) for n, shape in own.items()}
    out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out


def save_tiny_deepseek_v3(root: Path, rope_interleave: bool = True) -> Path:
    """docs/import.md's deepseek_v3: make_megatron_mla.py's seeded tiny DeepseekV3ForCausalLM (hidden 64, 4 layers
    with first_k_dense_replace=1, 4 routed experts and a shared one, q_lora_rank 48, kv_lora_rank 32, norms and
    e_score_correction_bias random) saved by save_pretrained, plus one MTP layer added to model.safetensors as
    save_pretrained writes a file (safetensors, format pt). transformers builds no module for MTP layers
    (DeepseekV3ForCausalLM ignores model.layers.61.* on load), so the layer is written under the names of
    DeepSeek-V3's published checkpoint (deepseek-ai/DeepSeek-V3 README_WEIGHTS.md and
    model.safetensors.index.json: MTP module j is model.layers.{num_hidden_layers + j}.{enorm, hnorm, eh_proj,
    shared_head.norm, a decoder layer's tensors, embed_tokens and shared_head.head copying the main model's})."""
    import transformers
    from safetensors.torch import load_file, save_file

    from tests.fixtures import make_megatron_mla as fx

    torch.manual_seed(fx.mm.SEED)
    model = fx.build_hf_model(fx.MlaCase(1, 1, "torch_dist", mtp=1))
    model.config.rope_interleave = rope_interleave
    model.save_pretrained(root, safe_serialization=True)
    assert isinstance(model, transformers.DeepseekV3ForCausalLM)
    tensors = load_file(str(root / "model.safetensors"))
    mtp = f"model.layers.{fx.HF['num_hidden_layers']}."
    assert not any(n.startswith(mtp) for n in tensors)  # transformers wrote no MTP layer
    save_file(tensors | mtp_layer(tensors, fx.mm.SEED + 2), str(root / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["first_k_dense_replace"] == 1
    return root


def save_hf_model(family: str, folder: Path) -> Path:
    """The fixtures' seeded tiny transformers model of `family` (megatron_models.FAMILIES), as save_pretrained
    writes it, in `folder`."""
    from tests.fixtures import megatron_models as mm

    mm.build_hf_model(mm.FAMILIES[family]).save_pretrained(folder, safe_serialization=True)
    return folder
