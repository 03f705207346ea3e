"""Decoding features against transformers on SmolLM2 in float32: beam search token for token,
logprobs within 1e-3, and the logits processors transformers also has (repetition penalty,
min_new_tokens, sequence_bias) token for token under greedy decoding."""

from __future__ import annotations

import pytest
import torch

from engine import BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow  # loads transformers' GGUF reference

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Q: What is 2+2?\nA:",
    "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n",
]


def hf_generate(model, tokenizer, prompt: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(generated tokens without the prompt, sequence scores when beam searching)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pad_token_id=tokenizer.eos_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    return out.sequences[:, ids.shape[1] :], getattr(out, "sequences_scores", None)


def until_eos(row: list[int], eos: int) -> list[int]:
    """transformers pads finished beams with EOS; the engine stops at the first one."""
    return row[: row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("beam_width,max_tokens", [(2, 12), (4, 16)])
def test_beam_search_matches_transformers(llm, hf_smollm2, hf_tokenizer, beam_width, max_tokens):
    # BeamSearchParams(length_penalty=1.0) corresponds to generate(num_beams=beam_width,
    # do_sample=False, length_penalty=1.0, early_stopping=True): the engine stops a request once
    # beam_width hypotheses have finished, like early_stopping=True.
    results = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens))
    eos = hf_tokenizer.eos_token_id
    for prompt, result in zip(PROMPTS, results, strict=True):
        tokens, hf_scores = hf_generate(
            hf_smollm2,
            hf_tokenizer,
            prompt,
            num_beams=beam_width,
            num_return_sequences=beam_width,
            do_sample=False,
            length_penalty=1.0,
            early_stopping=True,
            max_new_tokens=max_tokens,
        )
        expected = [until_eos(row, eos) for row in tokens.tolist()]
        assert [seq.output_token_ids for seq in result.sequences] == expected, prompt
        scores = [seq.cum_logprob / len(seq.output_token_ids) for seq in result.sequences]
        assert scores == pytest.approx(hf_scores.tolist(), abs=1e-3)
    assert llm.get_stats()["kv_cache_usage"] == 0.0


def test_greedy_logprobs_match_transformers_log_softmax(llm, hf_smollm2, hf_tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, prompt_logprobs=3)
    for output in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        completion = output.outputs[0]
        ids = torch.tensor([output.prompt_token_ids + completion.token_ids])
        with torch.inference_mode():
            reference = torch.log_softmax(hf_smollm2(ids).logits[0].float(), dim=-1)
        num_prompt = len(output.prompt_token_ids)
        for step, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            row = reference[num_prompt - 1 + step]
            assert logprobs[token].logprob == pytest.approx(row[token].item(), abs=1e-3)
            assert logprobs[token].rank == 1  # greedy picks the most likely token
            top5 = row.topk(5).indices.tolist()
            assert set(top5) <= set(logprobs)
        cumulative = sum(
            lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
        )
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)
        assert output.prompt_logprobs[0] is None
        for position in range(1, num_prompt):
            token = output.prompt_token_ids[position]
            expected = reference[position - 1]
            assert output.prompt_logprobs[position][token].logprob == pytest.approx(
                expected[token].item(), abs=1e-3
            )
            assert output.prompt_logprobs[position][token].rank == int((expected > expected[token]).sum()) + 1


@pytest.mark.parametrize(
    "ours,theirs",
    [
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"repetition_penalty": 0.8}, {"repetition_penalty": 0.8}),
        ({"min_tokens": 12}, {"min_new_tokens": 12}),
        ({"logit_bias": {11: 6.0, 29: -50.0}}, {"sequence_bias": {(11,): 6.0, (29,): -50.0}}),
    ],
)
def test_logits_processors_match_transformers_greedy(llm, hf_smollm2, hf_tokenizer, ours, theirs):
    params = SamplingParams(temperature=0.0, max_tokens=16, **ours)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected, _ = hf_generate(
            hf_smollm2, hf_tokenizer, prompt, do_sample=False, max_new_tokens=16, **theirs
        )
        assert output.outputs[0].token_ids == until_eos(expected.tolist()[0], hf_tokenizer.eos_token_id), (
            prompt
        )
