"""A mixture of experts under tensor parallelism (each expert split) and expert parallelism (the
experts split) on the multiprocess executor, against the single worker; and the layout checks.

The ranks sum their shares in another order than one worker does, so the rule is
tests/distributed/test_parallel_model.py's: identical up to a near tie, log-probabilities close.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from cluster.engine_args import add_engine_args, engine_settings_from_args
from engine import LLM, SamplingParams
from engine.config_resolve import check_expert_layout
from engine.models.model_files import ModelSource, read_arch_config
from tests.distributed.test_parallel_model import assert_logprobs_close
from tests.model.tiny_moe import write_tiny_moe

PROMPTS = [[5, 17, 300, 42], [1000, 2000, 3000], list(range(100, 140)), [7]]
TINY = {
    "dtype": "float32",
    "num_kv_blocks": 64,
    "block_size": 8,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    # Both layers sparse; top-k weights renormalized, as Qwen3-30B-A3B's config says.
    return write_tiny_moe(tmp_path_factory.mktemp("qwen3-moe") / "model", norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    # A shared expert beside the routed ones: split over the ranks like a dense MLP under both layouts.
    return write_tiny_moe(tmp_path_factory.mktemp("qwen2-moe") / "model", family="qwen2_moe")


def generate(llm: LLM):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


@pytest.mark.slow  # worker processes
# Qwen3's routed experts each split (TP) and the experts split (EP); Qwen2's shared expert, which
# both layouts split as they split a dense MLP, under EP only.
@pytest.mark.parametrize(
    ("family", "expert_parallel"),
    [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", True)],
    ids=["qwen3_moe-tp", "qwen3_moe-ep", "qwen2_moe-ep"],
)
def test_tensor_and_expert_parallel_match_one_worker(request, family, expert_parallel):
    folder = request.getfixturevalue(family)
    reference = generate(LLM(str(folder), **TINY))
    llm = LLM(
        str(folder),
        distributed_executor_backend="mp",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        **TINY,
    )
    try:
        assert_logprobs_close(reference, generate(llm), exact=False)
    finally:
        llm.llm_engine.shutdown()


def test_expert_layout_errors_name_the_setting(qwen3_moe):
    arch = read_arch_config(ModelSource(qwen3_moe, "hf"))
    check_expert_layout(True, 2, arch)
    with pytest.raises(ValueError, match="4 experts do not split evenly over tensor_parallel_size 3"):
        check_expert_layout(True, 3, arch)
    with pytest.raises(
        ValueError, match=r"intermediate size 32 does not split evenly .* enable_expert_parallel"
    ):
        check_expert_layout(False, 3, arch)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: .* is not a mixture of experts"):
        check_expert_layout(True, 2, dataclasses.replace(arch, num_experts=0))


def test_expert_parallel_is_a_command_line_switch():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    settings = engine_settings_from_args(parser.parse_args(["--enable-expert-parallel"]))
    assert settings["enable_expert_parallel"] is True
