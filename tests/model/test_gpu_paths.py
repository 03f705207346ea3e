"""The CUDA paths end to end on a tiny random-weight Llama (gpu-marked: skipped without CUDA):
decode through CUDA graphs equals eager decode and transformers, and tensor parallelism over two
GPUs (NCCL) equals one GPU. The graphs need a graph-safe attention backend: the Triton kernels, and flash-attn where installed."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.model.hf_reference import hf_greedy
from tests.model.tiny_models import write_tiny_model

# Enough prompts that batches pad to captured sizes (3 -> 4, 5 -> 8) and decodes span two 256-token blocks.
PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 400)), [7], list(range(50, 60))]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def greedy_tokens(folder, **settings) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens, and the decode sizes rank 0 replays as CUDA graphs."""
    llm = LLM(str(folder), dtype="float16", device="cuda", max_num_seqs=8, max_model_len=512, **settings)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [output.outputs[0].token_ids for output in outputs], llm.collective_rpc("cuda_graph_sizes")[0]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "flash_attn",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn"
            ),
        ),
    ],
)
def test_cuda_graph_decode_equals_eager_and_transformers(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("RAYPAGE_ATTENTION_BACKEND", backend)  # both are graph-safe
    folder = write_tiny_model(tmp_path / "model")
    graphed, sizes = greedy_tokens(folder, block_size=256, enforce_eager=False)
    assert sizes == [1, 2, 4, 8]
    eager, no_sizes = greedy_tokens(folder, block_size=256, enforce_eager=True)
    assert no_sizes == [] and graphed == eager
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16).cuda().eval()
    assert graphed == [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]


@pytest.mark.gpu
def test_steps_wait_on_the_device_only_for_their_results(tmp_path, monkeypatch):
    """Inputs go through pinned staging without waiting and results come back in one event wait
    (engine/transfers.py): torch's sync debug mode sees no implicit synchronization in a run of
    greedy, seeded, filtered and penalized requests with logprobs, prefill and decode steps alike."""
    monkeypatch.setenv("RAYPAGE_ATTENTION_BACKEND", "triton")
    folder = write_tiny_model(tmp_path / "model")
    llm = LLM(str(folder), dtype="float16", device="cuda", max_num_seqs=8, max_model_len=512)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=MAX_TOKENS, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=MAX_TOKENS, prompt_logprobs=1),
        SamplingParams(temperature=0.9, logit_bias={5: 2.0}, min_tokens=4, max_tokens=MAX_TOKENS),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    try:
        llm.generate(prompts, params, use_tqdm=False)  # the kernels compile and tune on first use
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        llm.llm_engine.shutdown()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_on_two_gpus_equals_one(tmp_path):
    folder = write_tiny_model(tmp_path / "model")
    one, _ = greedy_tokens(folder, enforce_eager=True)
    two, _ = greedy_tokens(
        folder, enforce_eager=True, tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    assert two == one


@pytest.mark.gpu
def test_a_cpu_engine_on_a_gpu_machine_keeps_gloo(tmp_path):
    # NCCL cannot move CPU tensors: the run only succeeds when the backend follows the device.
    folder = write_tiny_model(tmp_path / "model")
    settings = dict(dtype="float32", device="cpu", max_num_seqs=8, max_model_len=512, num_kv_blocks=64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=tp, distributed_executor_backend="mp", **settings)
        try:
            outputs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    assert outputs[2] == outputs[1]
