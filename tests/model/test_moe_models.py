"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, and the expert layer's shards.

The checkpoints are tiny random models written by transformers itself (tests/model/tiny_moe.py):
per-expert tensors as save_pretrained writes them (Mixtral's under its Hub names), and the stacked
experts of transformers 5's in-memory layout, which must load to the same weights. Greedy outputs
must be token-identical to transformers' in float32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import parallel.state as parallel_state
from engine.models.loader import iterate_safetensors_weights
from engine.models.model_files import ModelSource, read_arch_config
from engine.models.moe import FusedMoE
from engine.models.registry import get_model_class
from kernels.moe import fused_experts, select_experts
from tests.model.engine_greedy import engine_greedy
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_moe import write_tiny_moe

PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 160)), [7]]
MAX_TOKENS = 12


@pytest.mark.parametrize(
    "options",
    [
        # Qwen3-MoE without renormalized top-k weights, its second layer a dense MLP.
        pytest.param({"norm_topk_prob": False, "mlp_only_layers": [1]}, id="qwen3-moe"),
        pytest.param({"family": "mixtral"}, id="mixtral"),
        # A shared expert beside the routed ones; renormalized top-k weights.
        pytest.param({"family": "qwen2_moe", "norm_topk_prob": True}, id="qwen2-moe"),
    ],
)
def test_tiny_moe_matches_transformers(tmp_path, options):
    folder = write_tiny_moe(tmp_path / "model", **options)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Chunked prefill over a small cache, so that steps mix prefill and decode rows.
    outputs = engine_greedy(folder, PROMPTS, MAX_TOKENS, num_kv_blocks=32, max_num_batched_tokens=16)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("mixtral") / "model", family="mixtral")


def build_and_load(folder, weights):
    arch = read_arch_config(ModelSource(folder, "hf"))
    model = get_model_class(arch.architecture, folder)(arch, torch.float32)
    model.load_weights(weights)
    return model


def test_stacked_experts_load_as_the_per_expert_tensors(mixtral_folder, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj, ...) of the same weights."""
    stacked = write_tiny_moe(tmp_path / "stacked", family="mixtral", stacked=True)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in iterate_safetensors_weights(stacked))
    expected = build_and_load(mixtral_folder, iterate_safetensors_weights(mixtral_folder)).state_dict()
    got = build_and_load(stacked, iterate_safetensors_weights(stacked)).state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_missing_expert_tensor_is_named(mixtral_folder):
    weights = [
        (name, tensor)
        for name, tensor in iterate_safetensors_weights(mixtral_folder)
        if name != "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    ]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13_weight:\(3, 'up'\)"):
        build_and_load(mixtral_folder, weights)


def test_an_expert_the_model_lacks_is_an_error(mixtral_folder):
    weights = list(iterate_safetensors_weights(mixtral_folder))
    weights.append(("model.layers.0.block_sparse_moe.experts.4.w1.weight", torch.zeros(32, 64)))
    with pytest.raises(ValueError, match=r"experts\.4\.gate_proj.*outside the model's 4 experts"):
        build_and_load(mixtral_folder, weights)


@pytest.fixture
def as_rank(monkeypatch):
    """Build layers as if this process were TP rank `rank` of `size` (no collectives are run)."""

    def use(rank: int, size: int, expert_parallel: bool) -> None:
        state = parallel_state.ParallelState(
            tp_rank=rank, tp_size=size, enable_expert_parallel=expert_parallel
        )
        monkeypatch.setattr(parallel_state, "_state", state)

    return use


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_expert_shards_add_up_to_the_whole_layer(as_rank, expert_parallel):
    """Each of two ranks loads its slice of every expert, or its two whole experts of four (and
    lists only those as its checkpoint shards); the ranks' outputs sum to the unsharded layer's."""
    experts, hidden_size, inter = 4, 16, 8
    gates, ups, downs = (
        torch.randn(experts, inter, hidden_size),
        torch.randn(experts, inter, hidden_size),
        torch.randn(experts, hidden_size, inter),
    )
    x = torch.randn(5, hidden_size)
    weights, ids = select_experts(torch.randn(5, experts), 2, renormalize=True)

    def loaded_layer() -> FusedMoE:
        layer = FusedMoE(experts, 2, hidden_size, inter, True, torch.float32)
        for e in range(experts):
            for shard, tensor in (("gate", gates[e]), ("up", ups[e])):
                layer.weight_loader(layer.w13_weight, tensor, (e, shard))
            layer.weight_loader(layer.w2_weight, downs[e], (e, "down"))
        return layer

    as_rank(0, 1, expert_parallel)
    whole = loaded_layer()
    expected = fused_experts(x, weights, ids, whole.w13_weight, whole.w2_weight)
    total = torch.zeros_like(expected)
    for rank in range(2):
        as_rank(rank, 2, expert_parallel)
        layer = loaded_layer()
        if expert_parallel:
            assert layer.w13_weight.shape == (2, 2 * inter, hidden_size)
            assert {e for e, _ in layer.w13_weight.checkpoint_shards} == {2 * rank, 2 * rank + 1}
        else:
            assert layer.w13_weight.shape == (experts, inter, hidden_size)
        total += fused_experts(x, weights, ids, layer.w13_weight, layer.w2_weight, layer.first_expert)
    torch.testing.assert_close(total, expected)
