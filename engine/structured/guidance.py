"""The grammar backend over llguidance (Microsoft's Guidance engine, also a vLLM backend).

Chosen over xgrammar by measuring both on SmolLM2's vocabulary of 49,152 tokens
(docs/performance.md has the figures and `python -m benchmarks.grammar_backends` measures them):
xgrammar's masks are cheaper per row, but both cost a small share of a decode step, and llguidance
enforces what it accepts: it refuses the JSON Schema keywords it cannot enforce ("Unimplemented
keys") where xgrammar ignores some (uniqueItems, not, allOf, contains, if/then) and lets strings
with minLength hold raw control characters. It also compiles in a fraction of xgrammar's time,
needs no torch, and reads both Lark and llama.cpp's GBNF grammars.

JSON is compact: no whitespace between the tokens of the syntax (a small model free to add it
tends to emit newlines until max_tokens).
"""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from engine.sampling_params import StructuredOutputsParams
from engine.sched.grammar import GrammarMatcher
from engine.structured.backend import GrammarBackend

# What every JSON schema is compiled with: compact JSON.
_JSON_OPTIONS = {"whitespace_flexible": False}
# The JSON schema of `json_object`: any JSON object.
_ANY_OBJECT = {"type": "object"}


class GuidanceMatcher:
    """One sequence's llguidance matcher (engine.sched.grammar.GrammarMatcher)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    def fork(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.matcher.deep_copy())

    def is_terminated(self) -> bool:
        # Stopped: only the end of sequence may follow (it is also stopped in its error state).
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        return self.matcher.get_error() or None


class GuidanceGrammar:
    """A compiled grammar: a matcher at the start whose lexer has already computed its first mask,
    copied for each sequence (a copy is microseconds; a first mask from scratch is a millisecond)."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy())


def _json_schema_text(schema: str | dict, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON schema object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise ValueError(f"{field} is not a valid JSON schema: {exc}") from None


class GuidanceBackend(GrammarBackend):
    """llguidance bound to one model's vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_token_ids)
        if vocab_size > tokenizer.vocab_size:
            # The model's logits are wider than the tokenizer's vocabulary (padded): ids past it
            # are no tokens, and the masks leave them out.
            tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.tokenizer = tokenizer
        self.words = (tokenizer.vocab_size + 31) // 32

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        (kind,) = params.constraint_kinds
        field = f"structured_outputs.{kind}"
        if params.json is not None:
            text = _json_schema_text(params.json, field)
        elif params.json_object:
            text = _json_schema_text(_ANY_OBJECT, field)
        elif params.regex is not None:
            text = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif params.choice is not None:
            text = llguidance.grammar_from("choice", params.choice)
        else:
            try:
                text = llguidance.grammar_from("grammar", params.grammar)
            except ValueError as exc:
                raise ValueError(f"{field} is not a valid grammar: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise ValueError(f"{field} cannot be enforced: {error.strip()}")
        return text

    def compile(self, grammar: str) -> GuidanceGrammar:
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        # Its first mask builds the lexer's tables once, for every copy made from it.
        llguidance.numpy.fill_next_token_bitmask(template, np.empty((1, self.words), dtype=np.int32))
        if template.is_error():
            raise ValueError(template.get_error())
        return GuidanceGrammar(template)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        # One row after another on this thread: llguidance's parallel executor was no faster in the
        # step loop (its threads find the cores held by torch's, which spin between operators).
        for row, matcher in enumerate(matchers):
            llguidance.numpy.fill_next_token_bitmask(matcher.matcher, bitmask, row)  # type: ignore[attr-defined]
