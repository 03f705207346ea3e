"""Tensor and pipeline parallelism on the multiprocess executor, against the single worker.

Pipeline stages run exactly the same arithmetic, so their greedy outputs must be token-identical.
Tensor-parallel ranks sum partial products in a different order, so a near-tie may flip a token:
there the rule is vLLM's check_logprobs_close — identical up to the first difference, top-5
log-probabilities within 1e-3 until then, and each side's token at the difference among the other
side's top 5.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from engine.config_resolve import resolve_engine_config
from engine.exceptions import EngineDeadError
from tests.model.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow  # every engine here starts worker processes

PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 160)), [7], list(range(900, 941))]
TINY = {
    "dtype": "float32",
    "num_kv_blocks": 96,
    "block_size": 8,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_logprobs_close(reference, tested, exact: bool) -> None:
    for ref, test in zip(reference, tested, strict=True):
        ref_out, test_out = ref.outputs[0], test.outputs[0]
        if exact:
            assert test_out.token_ids == ref_out.token_ids
        for position, (ref_token, test_token) in enumerate(
            zip(ref_out.token_ids, test_out.token_ids, strict=True)
        ):
            ref_top, test_top = ref_out.logprobs[position], test_out.logprobs[position]
            if ref_token != test_token:  # a near tie flipped: each choice is in the other's top 5
                assert ref_token in test_top and test_token in ref_top, (position, ref_top, test_top)
                break
            for token in set(ref_top) & set(test_top):
                assert abs(ref_top[token].logprob - test_top[token].logprob) < 1e-3, (position, token)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[bool, Path]:
    """The tiny model by whether its LM head is tied to the embedding table."""
    folder = tmp_path_factory.mktemp("tiny-parallel")
    return {
        tied: write_tiny_model(folder / f"tied-{tied}", num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
        for tied in (False, True)
    }


@pytest.fixture(scope="module")
def tiny_references(tiny_models):
    return {tied: generate(LLM(str(model), **TINY)) for tied, model in tiny_models.items()}


# Every layout with a tied head, whose table the last stage and each TP rank must find though the first
# stage owns the embedding; an untied head where both splits are.
@pytest.mark.parametrize(
    ("layout", "tied"),
    [("tp2", True), ("pp2", True), ("tp2pp2", True), ("tp2pp2", False)],
    ids=["tied-tp2", "tied-pp2", "tied-tp2pp2", "untied-tp2pp2"],
)
def test_tiny_model_layouts_match_one_worker(tiny_models, tiny_references, layout, tied):
    llm = LLM(str(tiny_models[tied]), distributed_executor_backend="mp", **TINY, **LAYOUTS[layout])
    try:
        assert_logprobs_close(tiny_references[tied], generate(llm), exact=layout == "pp2")
        check_structured_outputs(llm)
        check_kv_cache_shards(llm, **LAYOUTS[layout])
        if layout == "pp2":
            check_stages_overlap(llm)
    finally:
        llm.llm_engine.shutdown()


def check_structured_outputs(llm: LLM) -> None:
    """The step's grammar masks reach the rank that samples (the last stage's), each on its row."""
    pattern = r"[a-z]{3,6}-\d{2,4}"
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
        for seed in range(3)
    ]
    params.append(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # a row without one
    outputs = generate(llm, PROMPTS[:4], params)
    for output in outputs[:3]:
        # The tokens' own text: the prompts' raw ids end mid-character, which the streamed text shows.
        text = llm.get_tokenizer().decode(output.outputs[0].token_ids, skip_special_tokens=True)
        assert re.fullmatch(pattern, text) and output.outputs[0].finish_reason == "stop", output.outputs
    assert len(outputs[3].outputs[0].token_ids) == 4


def check_kv_cache_shards(llm: LLM, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Each worker holds only its KV heads (2 / TP) and, under PP, only its stage's layers (2 / PP)."""
    shapes = llm.collective_rpc("kv_cache_shapes")
    assert len(shapes) == tensor_parallel_size * pipeline_parallel_size
    for rank, layers in enumerate(shapes):
        stage = rank // tensor_parallel_size
        per_stage = 2 // pipeline_parallel_size
        assert sorted(int(layer) for layer in layers) == list(
            range(stage * per_stage, (stage + 1) * per_stage)
        )
        for shape in layers.values():
            assert shape[1] == 2 // tensor_parallel_size  # [2, kv_heads, blocks, block_size, head_dim]


def check_stages_overlap(llm: LLM) -> None:
    """With two batches in flight, stage 0 computes one while stage 1 computes the other."""
    llm.collective_rpc("forward_times")  # forget the earlier runs
    prompts = [list(range(200 + 40 * i, 230 + 40 * i)) for i in range(8)]  # 30 tokens each, budget 32
    generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first, second = llm.collective_rpc("forward_times")
    overlaps = sum(1 for a0, a1 in first for b0, b1 in second if a0 < b1 and b0 < a1)
    assert overlaps > 0, "the stages never ran at the same time"


SMOLLM2 = {"dtype": "float32", "num_kv_blocks": 96, "max_num_seqs": 8}
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]
SMOLLM2_PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5)


@pytest.fixture(scope="module")
def smollm2_reference():
    """SmolLM2's outputs on one worker, once for both layouts below (a load and a run of its own)."""
    llm = LLM(**SMOLLM2)
    try:
        return llm.generate(SMOLLM2_PROMPTS, SMOLLM2_PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}], ids=["tp3", "pp2"]
)
def test_smollm2_layouts_match_one_worker(smollm2_reference, layout):
    llm = LLM(distributed_executor_backend="mp", **SMOLLM2, **layout)
    try:
        assert_logprobs_close(
            smollm2_reference,
            llm.generate(SMOLLM2_PROMPTS, SMOLLM2_PARAMS, use_tqdm=False),
            exact="pipeline_parallel_size" in layout,
        )
    finally:
        llm.llm_engine.shutdown()


def test_layout_errors_say_what_would_work():
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 3 or 9, got 2"):
        LLM(tensor_parallel_size=2, num_kv_blocks=16)
    with pytest.raises(
        ValueError, match=r"pipeline_partition \[10, 10\] must .* sum to the model's 30 layers"
    ):
        LLM(pipeline_parallel_size=2, pipeline_partition=[10, 10], num_kv_blocks=16)
    with pytest.raises(
        ValueError, match=r"pipeline_partition has 3 entries, but pipeline_parallel_size is 2"
    ):
        LLM(pipeline_parallel_size=2, pipeline_partition=[10, 10, 10], num_kv_blocks=16)
    with pytest.raises(ValueError, match="workers, but this machine has"):
        LLM(tensor_parallel_size=9, pipeline_parallel_size=30, num_kv_blocks=16)
    # Ray workers may span nodes: the cluster, not this machine, decides whether they fit.
    spread = EngineConfig.from_flat(
        tensor_parallel_size=9, pipeline_parallel_size=30, distributed_executor_backend="ray"
    )
    assert resolve_engine_config(spread).parallel.world_size == 270


def test_killed_tensor_parallel_worker_fails_generation(tiny_models):
    llm = LLM(str(tiny_models[False]), distributed_executor_backend="mp", tensor_parallel_size=2, **TINY)
    pids = [info["pid"] for info in llm.collective_rpc("process_info")]
    failure: list[BaseException] = []

    def run() -> None:
        try:
            generate(llm, PROMPTS * 8, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(2.0)
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive(), "generation hung after a worker died"
    assert failure and isinstance(failure[0], EngineDeadError), failure
    llm.llm_engine.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "a worker process outlived its engine"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers signal 0: it is dead once its state says so
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
