"""Running an LLM to the end in a distributed test: its tokens, then the engine shut down and idle."""

from __future__ import annotations

from typing import Any

from engine import LLM, SamplingParams


def generate_and_shut_down(
    llm: LLM, prompts: list[Any], params: SamplingParams
) -> tuple[list[list[int]], dict[str, Any]]:
    """The first completion's token ids of each prompt and the engine's stats after them; the
    engine is shut down whatever happens."""
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    return got, stats


def assert_idle(stats: dict[str, Any]) -> None:
    """Nothing left running or waiting, and every KV block free."""
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
