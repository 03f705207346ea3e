"""Prompts in, validated `EngineCoreRequest`s out: tokenization and every check happen here,
before a request reaches the scheduler, so a bad request never disturbs the others."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Union

import msgspec
from transformers import PreTrainedTokenizerBase

from engine.config import ResolvedEngineConfig
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreRequest
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.structured.manager import check_structured_outputs

# A string, {"prompt": str} or {"prompt_token_ids": [int, ...]} (optionally with "prompt" for display);
# either mapping may carry "cache_salt" (vLLM's TextPrompt / TokensPrompt key).
PromptType = Union[str, Mapping[str, Any]]  # noqa: UP007 (a runtime alias must work on Python 3.10 too)


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """The prompt's `cache_salt`, if it has one: a non-empty string, else a ValueError naming it.

    Only requests with equal salts share prefix-cache blocks, which keeps one tenant from timing
    another's cached prompts. An empty salt is refused rather than taken as no salt (vLLM's API
    server refuses it too): a tenant key that came out empty must not land in the shared cache.
    """
    if not isinstance(prompt, Mapping) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        # The type, never the value: a salt is a secret.
        given = "an empty string" if isinstance(salt, str) else f"a {type(salt).__name__}"
        raise ValueError(f"cache_salt must be a non-empty string if given, got {given}")
    try:
        salt.encode()  # hashed as UTF-8, and sent to the core process as msgpack
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be valid Unicode (it holds a lone surrogate)") from None
    return salt


class InputProcessor:
    """Tokenizes and validates prompts for one model."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        extra_eos_token_ids: tuple[int, ...] = (),
        max_logprobs: int = 20,
        max_num_seqs: int = 256,
        lora_registry: LoRARegistry | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.max_num_seqs = max_num_seqs
        self.lora_registry = lora_registry
        self.eos_token_id = eos_token_id
        # Further end-of-sequence ids from the generation config stop a request like stop_token_ids.
        self.extra_eos_token_ids = tuple(t for t in extra_eos_token_ids if t != eos_token_id)

    @classmethod
    def from_config(cls, config: ResolvedEngineConfig, tokenizer: PreTrainedTokenizerBase) -> InputProcessor:
        """The processor for the model `config` names, with its limits."""
        arch = config.model.hf_config
        eos = tokenizer.eos_token_id
        if eos is None and arch.eos_token_ids:
            eos = arch.eos_token_ids[0]
        return cls(
            tokenizer,
            config.model.max_model_len,
            arch.vocab_size,
            eos,
            arch.eos_token_ids,
            max_logprobs=config.model.max_logprobs,
            max_num_seqs=config.scheduler.max_num_seqs,
            lora_registry=LoRARegistry(arch, config.lora),
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text if known, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise ValueError(
            f"prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}"
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        beam_search = None
        if isinstance(params, BeamSearchParams):
            # Beams are picked from each step's log-probabilities; the per-token sampling is greedy.
            beam_search = params
            params = SamplingParams(
                temperature=0.0,
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                structured_outputs=params.structured_outputs,
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self.tokenize_prompt(prompt)
        cache_salt = prompt_cache_salt(prompt)
        self._check_prompt(token_ids)
        self._check_params(params)
        if lora_request is not None:
            self.check_lora(lora_request)
        width = beam_search.beam_width if beam_search else params.num_sequences
        if width > self.max_num_seqs:
            name = "beam_width" if beam_search else ("best_of" if params.best_of else "n")
            raise ValueError(
                f"{name}={width} is more sequences than one step runs (max_num_seqs={self.max_num_seqs})"
            )
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = list(dict.fromkeys([*(params.stop_token_ids or ()), *self.extra_eos_token_ids]))
            params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            beam_search=beam_search,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        return request, text

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise ValueError, naming the adapter and the field, unless the adapter can run here."""
        if self.lora_registry is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters")
        self.lora_registry.check(lora_request)

    def forget_lora(self, lora_int_id: int) -> None:
        """An adapter removed: its id and name may name another one from now on."""
        if self.lora_registry is not None:
            self.lora_registry.forget(lora_int_id)

    def _check_params(self, params: SamplingParams) -> None:
        """The checks SamplingParams cannot make alone: they need the model's limits."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name}: requested {value} log-probabilities, more than max_logprobs={self.max_logprobs}"
                )
        outside = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias: token id {outside[0]} is out of vocabulary (valid ids are 0 to {self.vocab_size - 1})"
            )
        if params.structured_outputs is not None:
            # An invalid schema, regex or grammar (or one the backend cannot enforce) fails here,
            # before the request is scheduled, naming the field.
            check_structured_outputs(params.structured_outputs)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty: it has 0 tokens")
        out_of_vocab = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if out_of_vocab:
            raise ValueError(
                f"prompt_token_ids: token id {out_of_vocab[0]} is out of vocabulary (valid ids are 0 to {self.vocab_size - 1})"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} (max_model_len). Make sure that `max_model_len` is no smaller than "
                "the number of text tokens."
            )
