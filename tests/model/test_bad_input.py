"""Bad input is refused before it reaches the scheduler, with the field and limit named, and the
engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"max_tokens": -1}, "max_tokens must be at least 1"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -0.5}, "temperature must be non-negative"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"n": 0}, "n must be at least 1"),
        ({"seed": -1}, "seed must be"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
    ],
)
def test_invalid_sampling_params(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "prompt must not be empty"),
        ({"prompt_token_ids": []}, "prompt must not be empty"),
        (
            {"prompt_token_ids": [1, 2, 10**6]},
            r"token id 1000000 is out of vocabulary \(valid ids are 0 to 49151\)",
        ),
        ({"prompt_token_ids": [-1]}, "token id -1 is out of vocabulary"),
        ({"prompt_token_ids": [5] * 129}, r"length 129\) is longer than the maximum model length of 128"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of integers"),
        (42, "prompt must be a string"),
    ],
)
def test_invalid_prompts_leave_the_engine_serving(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["A good prompt", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    # The good prompt queued before the bad one was withdrawn: nothing is left behind.
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_stats()["num_waiting_reqs"] == 0
    output = llm.generate("Still serving?", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
    assert llm.get_stats()["kv_cache_usage"] == 0.0


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params: got 1 for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_unknown_engine_setting_is_named():
    with pytest.raises(ValueError, match="unknown engine config key 'max_num_seq'"):
        LLM(max_num_seq=4)


def test_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*no config.json"):
        LLM(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights.bin.*must be a .gguf"):
        LLM(str(tmp_path / "weights.bin"))
