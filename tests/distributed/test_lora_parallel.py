"""LoRA adapters under tensor and pipeline parallelism (mp executor): each rank holds its shard of
every adapter, cut like the base layer, and the outputs are still token-identical to transformers
with the adapter merged by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.model.hf_reference import hf_greedy
from tests.model.lora_adapters import merged_reference, write_peft_adapter
from tests.model.tiny_models import write_tiny_model

PROMPTS = [[1, 5, 9, 200, 31, 7], [4, 4, 80, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    ("parallel", "num_kv_heads"),
    [
        # One KV head over two ranks: each rank keeps a replica of K and V, and of their adapters.
        ({"tensor_parallel_size": 2}, 1),
        ({"pipeline_parallel_size": 2}, 2),
    ],
    ids=["tp2", "pp2"],
)
def test_parallel_adapters_equal_the_merged_reference(
    tmp_path: Path, parallel: dict[str, int], num_kv_heads: int
) -> None:
    base = write_tiny_model(tmp_path / "base", num_kv_heads=num_kv_heads)
    folders = [write_peft_adapter(tmp_path / f"a{seed}", base, rank=8, seed=seed) for seed in (1, 2)]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
    expected = [
        hf_greedy(merged_reference(base, folder), prompt, GREEDY.max_tokens)
        for prompt in PROMPTS
        for folder in [None, *folders]
    ]
    llm = LLM(
        str(base),
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        distributed_executor_backend="mp",
        **parallel,
    )
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt in PROMPTS for _ in loras],
            GREEDY,
            use_tqdm=False,
            lora_request=[lora for _ in PROMPTS for lora in loras],
        )
    finally:
        llm.llm_engine.shutdown()
    assert [list(output.outputs[0].token_ids) for output in outputs] == expected
