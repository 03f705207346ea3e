"""A checkpoint that does not match its config, or asks for what the engine does not implement, is
an error at load that names the tensor or the setting; never a silently different model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.model.tiny_families import write_family_model


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return write_family_model(tmp_path_factory.mktemp("qwen3") / "model", "qwen3")


def _edited_copy(source, target, edit_tensors=None, edit_config=None):
    shutil.copytree(source, target)
    if edit_tensors is not None:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def _load(folder):
    LLM(str(folder), dtype="float32", num_kv_blocks=8)


def test_missing_tensor_is_named(qwen3_folder, tmp_path):
    folder = _edited_copy(
        qwen3_folder, tmp_path / "m", edit_tensors=lambda t: t.pop("model.layers.1.self_attn.q_norm.weight")
    )
    with pytest.raises(
        ValueError, match=r"checkpoint lacks 1 tensors.*model\.layers\.1\.self_attn\.q_norm\.weight"
    ):
        _load(folder)


def test_extra_tensor_is_named(qwen3_folder, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' has no place"):
        _load(_edited_copy(qwen3_folder, tmp_path / "m", edit_tensors=add))


def test_wrong_shape_is_named(qwen3_folder, tmp_path):
    def shrink(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :100].contiguous()

    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight'.*shape \(64, 100\), expected 128 along dim 1",
    ):
        _load(_edited_copy(qwen3_folder, tmp_path / "m", edit_tensors=shrink))


def test_unsupported_rope_scaling_is_refused(qwen3_folder, tmp_path):
    def longrope(config):
        config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}

    with pytest.raises(
        ValueError, match=r"rope scaling type 'longrope' is not supported; supported: default, linear"
    ):
        _load(_edited_copy(qwen3_folder, tmp_path / "m", edit_config=longrope))


def test_unsupported_architecture_lists_the_supported(qwen3_folder, tmp_path):
    def rename(config):
        config["architectures"] = ["FalconForCausalLM"]

    with pytest.raises(
        ValueError,
        match=r"'FalconForCausalLM' is not supported; supported: .*Gemma3ForCausalLM.*Qwen3ForCausalLM",
    ):
        _load(_edited_copy(qwen3_folder, tmp_path / "m", edit_config=rename))
