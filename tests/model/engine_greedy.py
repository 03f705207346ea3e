"""The engine's greedy continuations of token-id prompts on a checkpoint folder or GGUF file, with a
small paged cache, for comparison with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams


def engine_greedy(model: Path, prompts: list[list[int]], max_tokens: int, **settings: Any) -> list[list[int]]:
    """Greedy token ids of each prompt (float32, blocks of 8 tokens, up to 4 sequences a step);
    the engine is shut down after."""
    llm = LLM(str(model), dtype="float32", block_size=8, max_num_seqs=4, **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [output.outputs[0].token_ids for output in outputs]
    finally:
        llm.llm_engine.shutdown()
