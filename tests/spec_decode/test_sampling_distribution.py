"""Sampling with n-gram speculation keeps the target model's distribution.

A tiny random Llama with a 32-token vocabulary (written at test time) is sampled without seeds
thousands of times from a prompt whose n-gram lookup proposes drafts the model accepts about half
of the time, so both paths are taken often: tokens sampled after an accepted draft (conditioned on
it inside the verifying forward), and tokens sampled in the next step after a rejection. The
empirical distributions of the first three output tokens are compared with a chi-square test
against the exact distributions computed with transformers on the same weights (each token's
marginal over the tokens before it). The sample is large enough that
the test rejects the reference with 5% of its mass moved between two tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from tests.model.tiny_models import write_tiny_model

VOCAB = 32
NUM_SAMPLES = 4000
# A p-value below this rejects: a correct sampler fails about once in a thousand runs of fresh
# seeds (the engine's seed is fixed, so this test's outcome does not change between runs).
SIGNIFICANCE = 1e-3
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 2}
SETTINGS = {
    "temperature 1": {"temperature": 1.0},
    "top-k, presence penalty": {"temperature": 0.8, "top_k": 12, "presence_penalty": 0.7},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("small_vocab") / "model", vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def reference(model_path):
    return LlamaForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLM(model=str(model_path), dtype="float32", seed=0, max_num_seqs=256, speculative_config=SPEC)
    yield engine
    engine.llm_engine.shutdown()


def next_token_probs(reference, prompt: list[int], outputs: list[list[int]], settings: dict) -> torch.Tensor:
    """Per row of `outputs`, the distribution the sampler must draw from after `prompt` + that row,
    in vLLM's order: penalties on the logits, then temperature, then top-k. [rows, VOCAB]."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + row for row in outputs])).logits[:, -1].double()
    for logits_row, row in zip(logits, outputs, strict=True):
        logits_row[sorted(set(row))] -= settings.get("presence_penalty", 0.0)
    logits = logits / settings["temperature"]
    if "top_k" in settings:
        logits[logits < logits.topk(settings["top_k"], dim=-1).values[:, -1:]] = float("-inf")
    return logits.softmax(-1)


def reference_marginals(reference, prompt: list[int], settings: dict) -> list[torch.Tensor]:
    """The exact distributions of the first three output tokens, each summed over the tokens before it."""
    first = next_token_probs(reference, prompt, [[]], settings)[0]
    second = next_token_probs(reference, prompt, [[t] for t in range(VOCAB)], settings)  # [t1, t2]
    pairs = [[t1, t2] for t1 in range(VOCAB) for t2 in range(VOCAB)]
    third = next_token_probs(reference, prompt, pairs, settings).reshape(VOCAB, VOCAB, VOCAB)
    joint_two = first[:, None] * second
    return [first, joint_two.sum(0), (joint_two[:, :, None] * third).sum((0, 1))]


def draft_prompt(reference) -> list[int]:
    """A prompt `a b c d a b` the model likely continues with `c`, after which the lookup of `b c`
    drafts `d`, a token the model gives a probability near one half: drafts are accepted and
    rejected alike."""
    generator = torch.Generator().manual_seed(0)
    candidates = [
        [a, b, c, d, a, b] for a, b, c, d in torch.randint(0, VOCAB, (300, 4), generator=generator).tolist()
    ]

    def balance(prompt: list[int]) -> float:
        settings = {"temperature": 1.0}
        p_c = next_token_probs(reference, prompt, [[]], settings)[0, prompt[2]].item()
        p_d = next_token_probs(reference, prompt, [[prompt[2]]], settings)[0, prompt[3]].item()
        return p_c * min(p_d, 1 - p_d)

    return max(candidates, key=balance)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of the observed counts under `probs` (cells expecting fewer than 5 pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = len(expected) - 1
    return torch.special.gammaincc(torch.tensor(degrees / 2), statistic / 2).item()


def shifted(probs: torch.Tensor, mass: float = 0.05) -> torch.Tensor:
    """`probs` with `mass` moved from its likeliest token to its second likeliest."""
    first, second = probs.topk(2).indices.tolist()
    moved = probs.clone()
    moved[first] -= mass
    moved[second] += mass
    return moved


@pytest.mark.parametrize("name", SETTINGS)
def test_sampled_tokens_keep_the_target_distribution(llm, reference, name):
    settings = SETTINGS[name]
    prompt = draft_prompt(reference)
    before = llm.get_stats()["spec_decode"]
    params = SamplingParams(max_tokens=3, ignore_eos=True, **settings)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    after = llm.get_stats()["spec_decode"]
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert drafts > NUM_SAMPLES / 4 and 0.2 < accepted / drafts < 0.8

    samples = torch.tensor([output.outputs[0].token_ids for output in outputs])
    for position, probs in enumerate(reference_marginals(reference, prompt, settings)):
        counts = torch.bincount(samples[:, position], minlength=VOCAB).double()
        assert chi_square_p_value(counts, probs) > SIGNIFICANCE, f"output position {position}"
        assert chi_square_p_value(counts, shifted(probs)) < SIGNIFICANCE, "the sample cannot tell a 5% shift"
