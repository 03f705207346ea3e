"""SamplingParams, BeamSearchParams and StructuredOutputsParams: how a request picks its tokens, what
shape its output must take, and when it stops.

vLLM's names, defaults and messages. Msgspec Structs, so that they cross process boundaries inside
`EngineCoreRequest` without pickle. Every check runs at construction and raises `ValueError`
naming the field and its limit; checks that need the model (vocabulary, max_logprobs) run in the
input processor.
"""

from __future__ import annotations

import enum

import msgspec

# Below this temperature sampling is greedy, as in vLLM: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5
# OpenAI clamps logit_bias values to this range.
LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each streamed output carries: everything so far, only what is new, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """The shape the output must take (vLLM's names): exactly one of a JSON schema, a regular
    expression, a choice of strings, a grammar (Lark, or llama.cpp's GBNF), or any JSON object.

    The engine enforces it token by token: only tokens that keep the output inside the constraint
    can be sampled, and the end of sequence only where the constraint may end. JSON is generated
    compact (no whitespace between tokens of the syntax). Whether a schema, regex or grammar is
    valid (and enforceable) is checked by the input processor, before the request is scheduled.
    """

    json: str | dict | None = None  # a JSON schema, as an object or as its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = self.constraint_kinds
        if not given:
            raise ValueError(
                "structured_outputs: you must use one kind of constraint (json, regex, choice, grammar "
                "or json_object), but none is specified."
            )
        if len(given) > 1:
            raise ValueError(
                "structured_outputs: you can only use one kind of constraint, but several are "
                f"specified: {', '.join(given)}."
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @property
    def constraint_kinds(self) -> list[str]:
        """The names of the constraints given (valid params have exactly one)."""
        values = {
            "json": self.json,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        return [name for name, value in values.items() if value is not None]


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling and stopping settings of one request (vLLM's fields and defaults)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_counts()
        self._check_sampling()
        self._check_stops()
        if self.logit_bias:
            self.logit_bias = {
                int(token): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
                for token, bias in self.logit_bias.items()
            }
        if self.is_greedy:
            # Greedy: the filters cannot change the argmax, so drop them (vLLM does the same).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_counts(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            if self.best_of < 1:
                raise ValueError(f"best_of must be at least 1, got {self.best_of}.")
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
                )
        if self.temperature < GREEDY_TEMPERATURE and self.num_sequences > 1:
            raise ValueError(
                f"n and best_of must be 1 with greedy sampling (temperature 0), got n={self.n}, "
                f"best_of={self.best_of}: every sequence would be the same."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")

    def _check_sampling(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        # Up to 2**64: a request resumed on another replica (failover) carries its seed advanced
        # past the tokens already sent (`engine.worker.input_batch.position_seed`), modulo 2**64.
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}.")

    def _check_stops(self) -> None:
        if self.stop is not None and any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop cannot contain an empty string (or a non-string), got {self.stop!r}.")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Sequences generated: best_of of them, of which the n best are returned."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Beam search settings (vLLM's names): the `beam_width` best sequences by length-normalized
    cumulative log-probability are kept at every step."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # raypage's extension: the beams stay within a constraint (each beam's tokens are masked).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature != 0.0:
            raise ValueError(
                f"temperature must be 0 for beam search (it is deterministic), got {self.temperature}."
            )
