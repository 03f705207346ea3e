"""make_logprobs_dict: vLLM's per-position dict of Logprob, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.frontend.logprobs import Logprob, decode_logprob_token, make_logprobs_dict
from tests.unit.smollm2_tokens import IM_END, encode


def test_logprob_defaults_and_round_trip() -> None:
    assert Logprob(-1.5) == Logprob(logprob=-1.5, rank=None, decoded_token=None)
    value = Logprob(logprob=-0.25, rank=3, decoded_token=" fox")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=Logprob) == value


def test_chosen_token_first_then_top_k_ranks(tok: Tokenizer) -> None:
    chosen, first, second, third = encode(tok, " fox cat dog bird")
    result = make_logprobs_dict(tok, [chosen, first, second, third], [-3.0, -0.5, -1.0, -2.0], 7, 2)
    assert list(result) == [chosen, first, second]  # the column past num_logprobs is left out
    assert [(p.logprob, p.rank) for p in result.values()] == [(-3.0, 7), (-0.5, 1), (-1.0, 2)]
    assert [p.decoded_token for p in result.values()] == [" fox", " cat", " dog"]


def test_num_logprobs_zero_gives_the_chosen_token_only(tok: Tokenizer) -> None:
    chosen, first = encode(tok, " fox cat")
    assert make_logprobs_dict(tok, [chosen, first], [-3.0, -0.5], 4, 0) == {chosen: Logprob(-3.0, 4, " fox")}


@pytest.mark.parametrize("position", [1, 2])
def test_chosen_token_also_in_the_top_k_has_one_entry_first(tok: Tokenizer, position: int) -> None:
    chosen, other = encode(tok, " fox cat")
    row = [chosen, other, chosen] if position == 2 else [chosen, chosen, other]
    logprobs = [-0.7, -0.5, -0.7] if position == 2 else [-0.5, -0.5, -0.7]
    result = make_logprobs_dict(tok, row, logprobs, position, 2)
    assert list(result) == [chosen, other]  # insertion order: the chosen token first
    # One entry, with the top-k column's values (vLLM's dict comprehension keeps the last).
    assert result[chosen] == Logprob(logprobs[0], position, " fox")
    assert result[other].rank == 3 - position


def test_chosen_token_in_the_top_k_takes_the_top_k_rank_on_ties(tok: Tokenizer) -> None:
    # Tied logprobs: the sampler may rank the chosen token 1 while the top-k lists it second.
    chosen, other = encode(tok, " fox cat")
    result = make_logprobs_dict(tok, [chosen, other, chosen], [-0.5, -0.5, -0.5], 1, 2)
    assert [(token, p.rank) for token, p in result.items()] == [(chosen, 2), (other, 1)]


def test_decoded_tokens_keep_special_tokens_and_spaces(tok: Tokenizer) -> None:
    hello, space_world = encode(tok, "Hello world")
    result = make_logprobs_dict(tok, [IM_END, hello, space_world], [-0.1, -0.2, -0.3], 1, 2)
    assert [p.decoded_token for p in result.values()] == ["<|im_end|>", "Hello", " world"]
    for token, logprob in result.items():
        assert logprob.decoded_token == tok.decode([token], skip_special_tokens=False)


def test_incomplete_characters_decode_with_the_preceding_chosen_tokens(tok: Tokenizer) -> None:
    text = "Hi 😀 café 日本語 👩‍💻 ok"
    generated = encode(tok, text)
    assert any(tok.decode([token]).endswith("\ufffd") for token in generated)
    decoded = []
    for position, token in enumerate(generated):
        result = make_logprobs_dict(tok, [token], [-1.0], 1, 0, context_token_ids=generated[:position])
        decoded.append(result[token].decoded_token)
    # As in vLLM: a token ending inside a character reports "", the one completing it reports the
    # whole character, so the tokens' texts add up to the text.
    assert "\ufffd" not in "".join(decoded)
    assert "".join(decoded) == text
    emoji_tokens = encode(tok, " 😀")
    assert [decoded[generated.index(t)] for t in emoji_tokens] == ["", " 😀"]


def test_incomplete_character_without_context_is_empty(tok: Tokenizer) -> None:
    first, last = encode(tok, " 😀")
    assert tok.decode([last]) == "\ufffd"
    assert decode_logprob_token(tok, last) == ""
    # A top-k alternative whose bytes do not complete a character after the chosen tokens is "" too.
    assert decode_logprob_token(tok, last, encode(tok, "Hello")) == ""
    assert decode_logprob_token(tok, last, [first]) == " 😀"


def test_numpy_rows_give_python_numbers(tok: Tokenizer) -> None:
    chosen, first = encode(tok, " fox cat")
    result = make_logprobs_dict(
        tok, np.array([chosen, first], dtype=np.int64), np.array([-1.0, -0.5], dtype=np.float32), 2, 1
    )
    assert all(type(token) is int for token in result)
    assert all(type(p.logprob) is float for p in result.values())
    msgspec.msgpack.encode(result)


def test_malformed_rows_are_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="differ in length"):
        make_logprobs_dict(tok, [1, 2], [-1.0], 1, 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        make_logprobs_dict(tok, [1, 2], [-1.0, -2.0], 1, 2)
