"""LLM: offline batch generation with vLLM's names, so that user code carries over."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.tokenizer import render_chat_prompt
from engine.lora.request import LoRARequest
from engine.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline inference.

    `LLM(model=None, **settings)`: `model` is a Hugging Face folder or a GGUF file (None: the packaged
    SmolLM2-135M-Instruct); `settings` are the flat engine settings with vLLM's names and defaults
    (dtype="auto", seed=0, max_model_len=None, block_size=16, max_num_seqs=256,
    max_num_batched_tokens=2048, enable_prefix_caching=True, kv_cache_memory=None, num_kv_blocks=None,
    gpu_memory_utilization=0.9, tensor_parallel_size=1, pipeline_parallel_size=1,
    distributed_executor_backend=None, device="auto"); see `engine.config` for every one.
    `multiprocess_mode`: run the engine core in its own process; None picks one for the `mp` and
    `ray` executors and none for `uni` (see `LLMEngine`).
    """

    def __init__(
        self, model: str | None = None, *, multiprocess_mode: bool | None = None, **settings: Any
    ) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_flat(model=model, **settings), multiprocess_mode)
        self._request_counter = itertools.count()

    @classmethod
    def from_config(cls, path: str | Path, multiprocess_mode: bool | None = None, **overrides: Any) -> LLM:
        """An LLM from a flat YAML engine config (such as configs/engine/smollm2.yaml)."""
        settings = EngineConfig.from_yaml(path, **overrides).to_flat()
        return cls(multiprocess_mode=multiprocess_mode, **settings)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A prompt is a string or a dict
        (`{"prompt": ...}` or `{"prompt_token_ids": [...]}`), which may hold a `cache_salt`: only
        prompts with the same salt share prefix-cache blocks. `lora_request`: the LoRA adapter of
        every prompt, or one per prompt (None: the base model)."""
        prompt_list = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        return self._run(prompt_list, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the model's chat template (with
        `tools`, OpenAI's tool definitions, when given)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            render_chat_prompt(
                tokenizer, list(conversation), add_generation_prompt, chat_template, tools=tools
            )
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt: the beams, best (length-normalized) score first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        outputs = self._run_engine(self._add_requests(prompt_list, [params] * len(prompt_list)), use_tqdm)
        tokenizer = self.get_tokenizer()
        results = []
        for output in outputs:
            sequences = []
            for completion in output.outputs:
                tokens = [*output.prompt_token_ids, *completion.token_ids]
                sequences.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        text=tokenizer.decode(tokens, skip_special_tokens=True),
                        cum_logprob=completion.cumulative_logprob,
                        num_prompt_tokens=len(output.prompt_token_ids),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call a Worker method on every rank; their results in rank order."""
        return self.llm_engine.collective_rpc(method, args)

    def get_stats(self) -> dict[str, Any]:
        """Running and waiting requests, KV cache usage and size, preemptions, prefix-cache counters."""
        return self.llm_engine.get_stats()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check a LoRA adapter and read it into the workers' host caches ahead of its requests."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in the workers' host caches."""
        return self.llm_engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name), so that the next requests compute theirs again;
        False, changing nothing, while a request still holds KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        params = self._final_only(self._expand_per_prompt(sampling_params, len(prompts), "sampling_params"))
        loras = self._expand_per_prompt(lora_request, len(prompts), "lora_request")
        request_ids = self._add_requests(prompts, params, loras)
        return self._run_engine(request_ids, use_tqdm)

    @staticmethod
    def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
        """The same params with output_kind FINAL_ONLY: LLM returns each request's last output
        only, so the front end need not build the others (each a copy of everything so far)."""
        converted: dict[int, SamplingParams] = {}
        for param in params:
            # (Anything else is left for the input processor to reject with its message.)
            if id(param) not in converted and isinstance(param, SamplingParams):
                converted[id(param)] = msgspec.structs.replace(
                    param, output_kind=RequestOutputKind.FINAL_ONLY
                )
        return [converted.get(id(param), param) for param in params]

    @staticmethod
    def _expand_per_prompt(given: Any, count: int, name: str) -> list[Any]:
        """`given` for every prompt: one value (None: the default) repeated, or one per prompt."""
        if given is None and name == "sampling_params":
            given = SamplingParams()
        if given is None or isinstance(given, SamplingParams | LoRARequest):
            return [given] * count
        values = list(given)
        if len(values) != count:
            raise ValueError(f"{name}: got {len(values)} for {count} prompts; pass one, or one per prompt")
        return values

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams] | list[BeamSearchParams],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queue every request, or none: a bad prompt withdraws the ones already queued."""
        request_ids: list[str] = []
        try:
            for prompt, param, lora in zip(prompts, params, loras or [None] * len(prompts), strict=True):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, param, lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        input_tokens = output_tokens = 0
        with bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    input_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(
                        f"est. speed input: {input_tokens / elapsed:.2f} toks/s, output: {output_tokens / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        return [finished[request_id] for request_id in request_ids]
