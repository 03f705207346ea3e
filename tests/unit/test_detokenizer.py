"""IncrementalDetokenizer against an independent reference: decode the whole sequence at once, then
find the stop strings in the generated part with str.find."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.frontend.detokenizer import IncrementalDetokenizer
from tests.unit.smollm2_tokens import IM_END, encode, smollm2_tokenizer


def reference(
    tok: Tokenizer,
    prompt: list[int],
    generated: list[int],
    stop: list[str],
    include: bool,
    skip_special_tokens: bool = True,
) -> tuple[str, str | None]:
    """(text, stop_reason) from one full decode: the stop string completed first in the generated
    text wins, ties going to the longer one."""
    prompt_text = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    full = tok.decode(prompt + generated, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt_text)
    text = full[len(prompt_text) :]
    matches = [(start + len(s), start, s) for s in stop if (start := text.find(s)) != -1]
    if not matches:
        return text, None
    end, start, stop_string = min(matches)
    return text[: end if include else start], stop_string


def run(
    tok: Tokenizer,
    prompt: list[int],
    generated: list[int],
    stop: list[str] | None,
    include: bool,
    chunks: list[int] | None = None,
    **kwargs: object,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `generated` in calls of `chunks` tokens (default one each), then finish; checks on the
    way that released text is never taken back. Returns the detokenizer and every delta."""
    detok = IncrementalDetokenizer(tok, prompt, True, stop, include, **kwargs)
    deltas = []
    sizes = iter(chunks or [1] * len(generated))
    i = 0
    while i < len(generated):
        size = next(sizes)
        deltas.append(detok.add_tokens(generated[i : i + size]))
        i += size
        assert detok.text == "".join(deltas)
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return detok, deltas


def check(
    tok: Tokenizer,
    prompt: list[int],
    generated: list[int],
    stop: list[str],
    include: bool,
    chunks: list[int] | None = None,
) -> IncrementalDetokenizer:
    """Incremental result == reference, and no delta carries stop-string text it should not."""
    detok, deltas = run(tok, prompt, generated, stop, include, chunks)
    assert (detok.text, detok.stop_reason) == reference(tok, prompt, generated, stop, include)
    if not include:
        assert not any(s in delta for s in stop for delta in deltas)
    return detok


def tokens_spanned(tok: Tokenizer, text: str, sub: str) -> int:
    """How many of `text`'s tokens the first occurrence of `sub` overlaps."""
    start = text.index(sub)
    end = start + len(sub)
    return sum(a < end and b > start for a, b in tok.encode(text, add_special_tokens=False).offsets)


PROMPT = "<|im_start|>user\nTell me about foxes.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "The quick brown fox jumps over the lazy dog, then sleeps."


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("stop", "num_tokens"),
    [
        ("quick", 1),  # inside " quick": starts after the token's first character
        ("ick", 1),
        ("brown fox", 2),
        ("own fox jumps ov", 4),
        ("lazy dog, then sleeps.", 7),
    ],
)
def test_stop_string_spanning_tokens(tok: Tokenizer, stop: str, num_tokens: int, include: bool) -> None:
    assert tokens_spanned(tok, TEXT, stop) == num_tokens
    detok = check(tok, encode(tok, PROMPT), encode(tok, TEXT), [stop], include)
    assert detok.stop_reason == stop
    start = TEXT.index(stop)
    assert detok.text == TEXT[: start + len(stop) if include else start]


@pytest.mark.parametrize("include", [False, True])
def test_no_stop_string_gives_the_whole_text(tok: Tokenizer, include: bool) -> None:
    detok = check(tok, encode(tok, PROMPT), encode(tok, TEXT), ["zebra", "cat"], include)
    assert (detok.text, detok.stop_reason) == (TEXT, None)


def test_without_stop_strings_nothing_is_held_back(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), True)
    words = [detok.add_tokens([token]) for token in encode(tok, TEXT)]
    assert "".join(words) == detok.text == TEXT
    assert detok.finish() == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_the_start_of_generation(tok: Tokenizer, include: bool) -> None:
    detok = check(tok, encode(tok, PROMPT), encode(tok, TEXT), ["The q"], include)
    assert (detok.text, detok.stop_reason) == ("The q" if include else "", "The q")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_starting_in_the_prompt_does_not_match(tok: Tokenizer, include: bool) -> None:
    prompt, generated = encode(tok, "Say: Hel"), encode(tok, "lo world, hello.")
    # "Hello" is completed by the generated text but starts in the prompt; "Say" is all prompt.
    detok = check(tok, prompt, generated, ["Hello", "Say"], include)
    assert (detok.text, detok.stop_reason) == ("lo world, hello.", None)
    # A stop string wholly in the generated text right after the boundary does match.
    detok = check(tok, prompt, generated, ["Hello", "lo w"], include)
    assert (detok.text, detok.stop_reason) == ("lo w" if include else "", "lo w")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("stop", "expected_reason"),
    [
        (["sleeps", "lazy", "fox"], "fox"),  # the earliest in the text, whatever the list order
        (["The quick brown fox", "quick"], "quick"),  # completed first, though it starts later
        (["fox", "brown fox"], "brown fox"),  # both end together: the longer one
    ],
)
def test_several_stop_strings_the_first_completed_wins(
    tok: Tokenizer, stop: list[str], expected_reason: str, include: bool
) -> None:
    generated = encode(tok, TEXT)
    for chunks in (None, [len(generated)], [3] * len(generated)):
        detok = check(tok, encode(tok, PROMPT), generated, stop, include, chunks)
        assert detok.stop_reason == expected_reason


MULTIBYTE = "Grüße 😀🎉 from 日本語 and café—done 👩‍💻!"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["😀🎉", "🎉", "日本", "é—d", "👩‍💻", "💻!"])
def test_multibyte_stop_strings(tok: Tokenizer, stop: str, include: bool) -> None:
    generated = encode(tok, MULTIBYTE)
    # The emoji are split across byte-level tokens: decoded alone, a token is an incomplete character.
    assert any(tok.decode([token]).endswith("\ufffd") for token in generated)
    detok = check(tok, encode(tok, PROMPT), generated, [stop], include)
    assert detok.stop_reason == stop


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = encode(tok, "Look: 😀 yes")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok, _ = run(tok, ids[:split], ids[split:], None, False)
    # As in vLLM, the prompt's unfinished last token (" " and the emoji's first bytes) comes out with
    # the generated token that completes it; the rest of the prompt's text is not repeated.
    assert [tok.decode([token]) for token in ids[split - 1 : split + 1]] == [" \ufffd", "\ufffd"]
    assert detok.text == " 😀 yes"


@pytest.mark.parametrize("include", [False, True])
def test_chunking_does_not_change_the_result(tok: Tokenizer, include: bool) -> None:
    generated = encode(tok, TEXT + " " + MULTIBYTE)
    stop = ["日本", "then", "🎉 f"]
    rng = random.Random(0)
    results = set()
    for _ in range(10):
        chunks = [rng.randint(1, 5) for _ in generated]
        detok = check(tok, encode(tok, PROMPT), generated, stop, include, chunks)
        results.add((detok.text, detok.stop_reason))
    detok = check(tok, encode(tok, PROMPT), generated, stop, include)
    results.add((detok.text, detok.stop_reason))
    assert results == {(TEXT[: TEXT.index("then") + (4 if include else 0)], "then")}


def test_stream_holds_back_the_last_characters_that_could_start_a_stop_string(tok: Tokenizer) -> None:
    # As vLLM, a fixed max(len(stop)) - 1 = 3 characters, whatever they are.
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), True, ["dog!"], False)
    assert detok.add_tokens(encode(tok, "The lazy")) == "The l"
    assert detok.text == "The l"
    assert detok.add_tokens(encode(tok, " do")) == "azy"
    assert detok.add_tokens(encode(tok, "g.")) == " d"
    assert detok.finish() == "og."
    assert (detok.text, detok.stop_reason) == ("The lazy dog.", None)
    assert detok.add_tokens(encode(tok, " more")) == ""  # finished: nothing more is shown


def test_tokens_after_a_stop_string_are_ignored(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), True, ["fox"], False)
    assert detok.add_tokens(encode(tok, "The brown fox and more")) == "The brown "
    assert detok.finished
    assert detok.add_tokens(encode(tok, " text")) == ""
    assert detok.finish() == ""
    assert (detok.text, detok.stop_reason) == ("The brown ", "fox")


def test_stop_strings_need_min_tokens_first(tok: Tokenizer) -> None:
    generated = encode(tok, " a fox, a fox, a fox")
    assert tok.decode(generated[:2]) == " a fox"
    # A match wholly inside the first min_tokens tokens' text does not count; one ending after does.
    detok, _ = run(tok, [], generated, ["fox"], False, min_tokens=2)
    assert (detok.text, detok.stop_reason) == (" a fox, a ", "fox")
    for chunks in ([len(generated)], [2] * len(generated)):
        other, _ = run(tok, [], generated, ["fox"], False, chunks, min_tokens=2)
        assert (other.text, other.stop_reason) == (detok.text, detok.stop_reason)
    # It may start inside them: "x," ends in the third token's text.
    detok, _ = run(tok, [], generated, ["x,"], False, min_tokens=2)
    assert (detok.text, detok.stop_reason) == (" a fo", "x,")
    detok, _ = run(tok, [], generated, ["fox"], False, min_tokens=100)
    assert (detok.text, detok.stop_reason) == (tok.decode(generated), None)


def test_special_tokens_as_stop_strings_when_kept(tok: Tokenizer) -> None:
    generated = [*encode(tok, "Done."), IM_END, *encode(tok, "\nextra")]
    kept = IncrementalDetokenizer(tok, encode(tok, PROMPT), False, ["<|im_end|>"], False)
    assert [kept.add_tokens([token]) for token in generated][-1] == ""
    assert (kept.text, kept.stop_reason) == ("Done.", "<|im_end|>")
    skipped, _ = run(tok, encode(tok, PROMPT), generated, ["<|im_end|>"], False)
    assert (skipped.text, skipped.stop_reason) == ("Done.\nextra", None)


# Whole words, so that every unit decodes to complete characters on its own; some are several tokens.
WORDS = [
    " the", " cat", " sat", " on", " mat", "Hello", ",", ".", "!", " world", "ab", "c", "\n", " 😀",
    "🎉", " café", " naïve", " 日本", "語", " Grüße", " 👩‍💻", " x", "xx", " ", "  ",
]  # fmt: skip


@functools.cache
def word_units() -> list[list[int]]:
    tok = smollm2_tokenizer()
    return [encode(tok, word) for word in WORDS] + [[IM_END]]


@st.composite
def detokenizer_cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[str], bool, list[int]]:
    tok = smollm2_tokenizer()
    units = st.sampled_from(word_units())
    prompt = [t for unit in draw(st.lists(units, max_size=4)) for t in unit]
    generated = [t for unit in draw(st.lists(units, min_size=1, max_size=12)) for t in unit]
    # Stop strings cut from the decoded text, so that they do occur, some across the prompt boundary.
    full = tok.decode(prompt + generated, skip_special_tokens=True)
    stop = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) or not full:
            stop.append(draw(st.text(alphabet="abcx .,😀", min_size=1, max_size=4)))
        else:
            start = draw(st.integers(0, len(full) - 1))
            stop.append(full[start : start + draw(st.integers(1, 8))])
    chunks = draw(st.lists(st.integers(1, 4), min_size=len(generated), max_size=len(generated)))
    return prompt, generated, stop, draw(st.booleans()), chunks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(detokenizer_cases())
def test_matches_full_decode_reference(case: tuple[list[int], list[int], list[str], bool, list[int]]) -> None:
    prompt, generated, stop, include, chunks = case
    tok = smollm2_tokenizer()
    one_at_a_time = check(tok, prompt, generated, stop, include)
    chunked = check(tok, prompt, generated, stop, include, chunks)
    assert (chunked.text, chunked.stop_reason) == (one_at_a_time.text, one_at_a_time.stop_reason)
