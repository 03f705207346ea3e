"""The GPU check script's Python parts on the CPU: the random Llama it writes, the decode step's byte
count against the checkpoint itself, and a whole --dry-run (tiny model and workload, no pytest)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from benchmarks import gpu_check
from engine.models.model_files import read_arch_config, resolve_model_source


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("gpu-check")
    return gpu_check.main(["--dry-run", "--out", str(out)]), out


@pytest.mark.slow
def test_decode_bytes_count_every_weight_but_the_embedding_once_plus_the_kv_cache(dry_run):
    _, out = dry_run
    folder = out / "llama-tiny"
    arch = read_arch_config(resolve_model_source(str(folder)))
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        # Independently: every matrix in the file but the embedding table (read by row, not whole).
        matrices = sum(
            weights.get_slice(name).get_shape()[0] * weights.get_slice(name).get_shape()[1]
            for name in weights.keys()  # noqa: SIM118 - safe_open has no iteration
            if len(weights.get_slice(name).get_shape()) == 2 and "embed_tokens" not in name
        )
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
    assert gpu_check.decode_step_bytes(arch, 2, batch=8, mean_context=100) == 2 * (
        matrices + 8 * 100 * kv_per_token
    )
    assert gpu_check.hbm_share(2.4e12, 1.0) == pytest.approx(0.5)


def test_the_smollm2_shape_is_the_packaged_models():
    arch = read_arch_config(resolve_model_source(None))
    shape = gpu_check.SMOLLM2_SHAPE
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads) == (
        arch.hidden_size,
        arch.intermediate_size,
        arch.num_layers,
        arch.num_heads,
        arch.num_kv_heads,
    )


@pytest.mark.parametrize(
    "shape,low,high", [(gpu_check.LLAMA_1B, 0.9e9, 1.5e9), (gpu_check.LLAMA_8B, 7e9, 8.5e9)]
)
def test_the_large_shapes_have_their_parameter_counts(shape, low, high):
    vocab = 49152
    head_dim = shape.hidden // shape.heads
    per_layer = (
        shape.hidden * head_dim * (2 * shape.heads + 2 * shape.kv_heads)
        + 3 * shape.hidden * shape.intermediate
    )
    total = shape.layers * per_layer + 2 * vocab * shape.hidden
    assert low < total < high


def test_peak_bandwidth_follows_the_device_name():
    assert gpu_check.peak_hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.peak_hbm_bytes_per_s("NVIDIA H200") == 4.8e12


@pytest.mark.slow
def test_dry_run_checks_the_backends_and_benchmarks_eager_and_graph_modes(dry_run):
    summary, out = dry_run
    assert summary["device"] == "cpu" and "pytest_gpu" not in summary
    assert summary["backends"]["sdpa"]["status"] == "ok"  # the CPU stand-in for the GPU backends
    for name in gpu_check.GPU_BACKENDS:
        result = summary["backends"][name]
        if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            # The kernel tests' conftest turned the interpreter on for this process: Triton runs here.
            assert result["status"] == "ok", result
        else:
            assert result["status"] in ("unavailable", "failed") and result["reason"]
    assert set(summary["bench"]) == {"llama-tiny-eager", "llama-tiny-graphs", "llama-tiny-graphs-async"}
    for run in summary["bench"].values():
        assert run["status"] == "ok" and run["output_tokens_per_s"] > 0 and 0 < run["hbm_share"] < 1
        # The share is the read time over the step time.
        assert run["hbm_share"] == pytest.approx(run["read_time_ms"] / run["decode_step_ms"])
        assert run["cuda_graphs"] == "not used"  # never on the CPU
    assert json.loads((out / "summary.json").read_text())["bench"].keys() == summary["bench"].keys()
    table = (out / "summary.md").read_text()
    assert "| llama-tiny-graphs |" in table and "HBM share" in table


@pytest.mark.slow
def test_the_written_llama_loads_in_transformers(dry_run):
    from transformers import AutoModelForCausalLM

    _, out = dry_run
    model = AutoModelForCausalLM.from_pretrained(out / "llama-tiny", dtype=torch.float32)
    assert model.config.num_hidden_layers == gpu_check.LLAMA_TINY.layers
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[-1] == model.config.vocab_size


@pytest.mark.slow
def test_pytest_stage_collects_the_gpu_tests_without_ray(tmp_path):
    # On the CPU every gpu test is skipped; the stage must still collect them all without errors.
    result = gpu_check.run_pytest(tmp_path, timeout_s=300)
    assert result["status"] == "ok", result
    assert "skipped" in result["summary"] and "error" not in result["summary"]
