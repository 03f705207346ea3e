"""`speculative_config`: vLLM's settings of speculative decoding, checked at start-up.

Two methods, with vLLM's names and defaults: n-gram prompt lookup,
`{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}`,
and a smaller draft model with the target's tokenizer, `{"model": PATH, "num_speculative_tokens": 3}`
(method "draft_model", implied by `model`). Given as a JSON string (`--speculative-config '{...}'`)
or a mapping (`LLM(speculative_config={...})`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's default n-gram size when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
SUPPORTED_METHODS = ("ngram", "draft_model")


class SpeculativeConfig(BaseModel):
    """How tokens are proposed for the target model to verify in one forward pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = Field(
        description="How drafts are proposed: ngram (prompt lookup) or draft_model (a smaller model)"
    )
    model: str | None = Field(
        None, description="draft_model: the draft's Hugging Face folder or GGUF file (the target's tokenizer)"
    )
    num_speculative_tokens: int = Field(ge=1, le=32, description="Tokens proposed per step and sequence")
    prompt_lookup_max: int | None = Field(
        None, ge=1, description="Longest n-gram matched (ngram); default prompt_lookup_min, else 5"
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, description="Shortest n-gram matched (ngram); default prompt_lookup_max, else 5"
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="No speculation in a step whose batch has more sequences than this (where the "
        "forward pass is no longer bound by reading the weights); None: always speculate, but for a "
        "target running from GGUF blocks, which speculates up to 4 sequences",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_method(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("method") is None and data.get("model") is not None:
            data = {**data, "method": "draft_model"}  # as vLLM infers it
        method = data.get("method")
        if method not in SUPPORTED_METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)}"
            )
        if (method == "draft_model") != (data.get("model") is not None):
            raise ValueError("speculative_config needs a model for method draft_model, and only for it")
        return data

    @model_validator(mode="after")
    def _lookup_bounds(self) -> SpeculativeConfig:
        low = self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP
        high = self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        return self


def parse_speculative_config(value: Any) -> Any:
    """A JSON string (the command line's form) as the mapping pydantic validates."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    return value
