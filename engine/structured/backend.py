"""The grammar backend interface: turning a request's constraint into a grammar, compiling it against
the model's vocabulary, and filling the token masks of a batch of matchers."""

from __future__ import annotations

import abc

import numpy as np

from engine.sampling_params import StructuredOutputsParams
from engine.sched.grammar import CompiledGrammar, GrammarMatcher


class GrammarBackend(abc.ABC):
    """A grammar library bound to one model's vocabulary.

    Grammar text (`grammar_text`) needs no vocabulary, so the front end checks a request with it
    before the request reaches the core; `compile` and the masks need the vocabulary, in the core.
    A mask row is `words` int32 words, bit t % 32 of word t // 32 allowing token t.
    """

    words: int

    @abc.abstractmethod
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        """Bind to a vocabulary: the tokenizer (the `tokenizers` library's JSON), the width of the
        model's logits, and the tokens that end a sequence (allowed where the grammar may end)."""

    @staticmethod
    @abc.abstractmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        """The backend's grammar for the constraint; a ValueError naming the field (and what the
        backend cannot enforce) when it is invalid."""

    @abc.abstractmethod
    def compile(self, grammar: str) -> CompiledGrammar:
        """The grammar compiled against the vocabulary; a ValueError saying why it cannot be."""

    @abc.abstractmethod
    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` ([len(matchers), words] int32) becomes the mask of matchers[i]."""
