"""Which DCP entries are model weights. The key layouts are those `dcp.save` produces when it flattens
nested state dicts (torch.distributed.checkpoint._nested_dict): `{"model": sd}` -> `model.<param>`."""

from __future__ import annotations

import pytest

from distmerge.errors import InputError
from distmerge.families.hf import check_names_are_hf as check_hf_names
from distmerge.formats.dcp.keys import model_names

HF = ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


def test_plain_hf_state_dict_is_kept_as_is():
    assert model_names(HF, "ckpt") == {n: n for n in HF}


def test_model_wrapper_is_stripped_and_other_groups_dropped():
    keys = [f"model.{n}" for n in HF] + ["optimizer.state.model.norm.weight.exp_avg", "lr_scheduler.last_epoch"]
    assert model_names(keys, "ckpt") == {f"model.{n}": n for n in HF}


def test_wrapped_causal_lm_without_other_groups_is_stripped():
    keys = [f"model.{n}" for n in HF]
    assert model_names(keys, "ckpt") == {f"model.{n}": n for n in HF}


def test_tied_model_without_head_keeps_its_own_model_prefix():
    keys = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    assert model_names(keys, "ckpt") == {n: n for n in keys}


def test_optimizer_only_checkpoint_is_refused():
    with pytest.raises(InputError, match="no model tensors"):
        model_names(["optimizer.state.w.exp_avg", "optimizer.param_groups.0.lr"], "ckpt")


def test_foreign_naming_is_refused_with_examples():
    with pytest.raises(InputError, match="torchtitan's naming .layers.0.attention.wq.weight"):
        check_hf_names(["layers.0.attention.wq.weight", "tok_embeddings.weight", "output.weight"])
    check_hf_names(HF)
