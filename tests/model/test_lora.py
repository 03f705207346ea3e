"""LoRA adapters on a tiny random Llama, each checked against transformers with the adapter merged
into the base weights by hand (W + scaling * B A, tests/model/lora_adapters.py), never against the
engine itself: a mixed batch of the base and several adapters, more adapters than device slots
(eviction and reload), rsLoRA and partial targets, prefix caching that never shares KV across
adapters, and bad adapters refused with the adapter and the field named while the engine serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from tests.model.hf_reference import hf_greedy
from tests.model.lora_adapters import merged_reference, write_peft_adapter
from tests.model.tiny_models import write_tiny_model

MAX_TOKENS = 10
PROMPTS = [[1, 5, 9, 200, 31, 7], [4, 4, 80, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="module")
def adapters(base: Path) -> dict[str, Path]:
    """Four adapters, more than the engine's two slots: every projection, attention only (rank 4
    under the slots' 8), the MLP only, and rsLoRA scaling."""
    folder = base.parent
    return {
        "all": write_peft_adapter(folder / "all", base, rank=8, seed=1),
        "attention": write_peft_adapter(
            folder / "attention", base, rank=4, seed=2, targets=("q_proj", "v_proj")
        ),
        "mlp": write_peft_adapter(folder / "mlp", base, rank=8, seed=3, targets=("gate_proj", "down_proj")),
        "rslora": write_peft_adapter(folder / "rslora", base, rank=8, alpha=4.0, seed=4, use_rslora=True),
    }


@pytest.fixture(scope="module")
def requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {
        name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(adapters.items())
    }


@pytest.fixture(scope="module")
def references(base: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """Each adapter's (and the base model's) greedy tokens for every prompt, from transformers."""
    results = {}
    for name, folder in [(None, None), *adapters.items()]:
        model = merged_reference(base, folder)
        results[name] = [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return results


@pytest.fixture(scope="module")
def llm(base: Path) -> Iterator[LLM]:
    engine = LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128
    )
    yield engine
    engine.llm_engine.shutdown()


def _generate(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    output = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora)
    return list(output[0].outputs[0].token_ids)


def test_adapters_change_the_reference(references: dict[str | None, list[list[int]]]) -> None:
    """The adapters are strong enough to change the greedy tokens: the exactness tests below mean something."""
    for name in ("all", "attention", "mlp", "rslora"):
        assert references[name] != references[None], name


def test_one_batch_mixes_the_base_and_adapters(
    llm: LLM, requests: dict[str, LoRARequest], references: dict[str | None, list[list[int]]]
) -> None:
    """One generate, base rows and rows of all four adapters together (two slots: adapters wait,
    load and evict as the batch runs), each row token-identical to its own merged reference."""
    names = [None, "all", "attention", "mlp", "rslora"]
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS for _ in names]
    loras = [None if name is None else requests[name] for _ in PROMPTS for name in names]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    assert [output.lora_request for output in outputs] == loras
    expected = [references[name][index] for index in range(len(PROMPTS)) for name in names]
    assert got == expected
    stats = llm.get_stats()["lora"]
    assert stats.max_loras == 2 and stats.num_evictions >= 2 and not stats.running


def test_evicted_adapters_reload_exactly(
    llm: LLM, requests: dict[str, LoRARequest], references: dict[str | None, list[list[int]]]
) -> None:
    """Adapters taken in turn, each evicting another from the two slots, come back exact."""
    for name in ["all", "attention", "mlp", "rslora", "all", "mlp"]:
        assert _generate(llm, PROMPTS[0], requests[name]) == references[name][0], name


def test_prefix_cache_never_shares_kv_across_adapters(
    llm: LLM, requests: dict[str, LoRARequest], base: Path, adapters: dict[str, Path]
) -> None:
    """The same long prompt under one adapter, another, and the first again: only the repeat finds
    cached blocks, and the second adapter's tokens are still its own reference's."""
    prompt = {"prompt_token_ids": list(range(3, 70))}  # four full blocks of 16
    first, second = requests["all"], requests["mlp"]
    outputs = [
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        for lora in (first, second, first, None)
    ]
    assert [output.num_cached_tokens for output in outputs] == [0, 0, 64, 0]
    reference = hf_greedy(merged_reference(base, adapters["mlp"]), prompt["prompt_token_ids"], MAX_TOKENS)
    assert list(outputs[1].outputs[0].token_ids) == reference


def _rewrite_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_adapters_are_refused_naming_adapter_and_field(
    llm: LLM, base: Path, tmp_path: Path, references: dict[str | None, list[list[int]]]
) -> None:
    too_big = write_peft_adapter(tmp_path / "big", base, rank=16, seed=5)
    embedding = write_peft_adapter(tmp_path / "embed", base, rank=4, seed=6, targets=("q_proj",))
    _rewrite_config(embedding, target_modules=["q_proj", "embed_tokens"])
    other_base = write_tiny_model(tmp_path / "wide", hidden_size=96)
    mismatched = write_peft_adapter(tmp_path / "mismatch", other_base, rank=4, seed=7, targets=("q_proj",))
    cases = [
        (tmp_path / "missing", "lora_path is not a folder"),
        (too_big, "r (16) is above max_lora_rank (8)"),
        (embedding, "target_modules has 'embed_tokens'"),
        (mismatched, "the base model's q_proj needs (4, 64)"),
    ]
    for index, (folder, message) in enumerate(cases):
        lora = LoRARequest(f"bad{index}", 100 + index, str(folder))
        with pytest.raises(
            ValueError, match=f"LoRA adapter 'bad{index}'.*{message}".replace("(", r"\(").replace(")", r"\)")
        ):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=lora)
    # Nothing was queued, and the engine serves on.
    assert _generate(llm, PROMPTS[0], None) == references[None][0]


def test_one_id_names_one_adapter(llm: LLM, requests: dict[str, LoRARequest]) -> None:
    known = requests["all"]
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all'"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, known.lora_path))
    with pytest.raises(ValueError, match="lora_name 'all' is already adapter id 1"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 99, known.lora_path))


def test_add_list_remove(llm: LLM, requests: dict[str, LoRARequest]) -> None:
    lora = requests["attention"]
    llm.add_lora(lora)
    assert lora.lora_int_id in llm.list_loras()
    assert llm.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in llm.list_loras()


def test_lora_request_without_enable_lora(base: Path, requests: dict[str, LoRARequest]) -> None:
    engine = LLM(str(base), dtype="float32", num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="LoRA adapters are not enabled"):
            engine.generate("hi", GREEDY, use_tqdm=False, lora_request=requests["all"])
    finally:
        engine.llm_engine.shutdown()
