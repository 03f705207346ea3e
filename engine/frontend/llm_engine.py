"""LLMEngine: the synchronous engine API (vLLM's names) over an EngineCore client."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, ResolvedEngineConfig
from engine.config_resolve import resolve_engine_config
from engine.frontend.input_processor import InputProcessor, PromptType
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.tokenizer import load_tokenizer
from engine.lora.request import LoRARequest
from engine.models.model_files import ModelSource
from engine.outputs import RequestOutput
from engine.process.core_client import EngineCoreClient
from engine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


def build_front_end(
    config: EngineConfig,
) -> tuple[ResolvedEngineConfig, PreTrainedTokenizerBase, InputProcessor]:
    """Resolve the config (once: a resolved one passes through) and load what the front end needs:
    the tokenizer and the input processor that tokenizes and validates requests."""
    config = resolve_engine_config(config)
    tokenizer = load_tokenizer(ModelSource.of(config.model), config.model.tokenizer)
    return config, tokenizer, InputProcessor.from_config(config, tokenizer)


class LLMEngine:
    """Adds requests, steps the engine, and returns what each step produced.

    `multiprocess_mode`: run the EngineCore in its own process (True) or in this one (False).
    None (the default) uses a process when the executor's workers run outside this one anyway
    (`mp`, `ray`), and this process for the single in-process worker of `uni`: a core process
    costs seconds to start (it imports torch again) and buys overlap of tokenization with the
    model's steps, which matters to servers (AsyncLLMEngine always uses one) more than to batches.
    """

    def __init__(self, config: EngineConfig, multiprocess_mode: bool | None = None) -> None:
        self.config, self.tokenizer, self.input_processor = build_front_end(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        if multiprocess_mode is None:
            multiprocess_mode = self.config.parallel.executor_backend != "uni"
        self.engine_core = EngineCoreClient.make_client(self.config, multiprocess_mode)

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> LLMEngine:
        return cls(EngineConfig.from_yaml(path, **overrides))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        self.output_processor.add_request(request, prompt_text)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [output.request_id for output in self.output_processor.abort_requests(ids)]
        if live:
            self.engine_core.abort_requests(live)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs (per each request's output_kind) of the requests that
        progressed or finished. With no unfinished request there is nothing to wait for: []."""
        if not self.output_processor.has_unfinished_requests():
            return []
        outputs = self.engine_core.get_output()
        stats = outputs.scheduler_stats
        idle = stats is not None and not stats.num_running_reqs + stats.num_waiting_reqs
        # When the report is current, an idle one with nothing in it is the truth: the core lost the
        # requests the front end waits for; fail loudly rather than spin forever.
        if self.engine_core.idle_report_is_current and idle and not outputs.outputs:
            lost = sorted(self.output_processor.requests)
            self.output_processor.abort_requests(lost)
            raise RuntimeError(f"the engine core finished requests {lost} without reporting them")
        results, stops = self.output_processor.process_outputs(outputs.outputs)
        for stop in stops:
            self.engine_core.stop_sequence(stop.request_id, stop.index, stop.stop_reason)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def get_stats(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self.engine_core.get_stats())

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """A Worker method's results on every rank, in rank order (vLLM's LLM.collective_rpc)."""
        return self.engine_core.collective_rpc(method, args)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check a LoRA adapter (ValueError naming it and the field) and read it into the workers'
        host caches; False if they held it already."""
        self.input_processor.check_lora(lora_request)
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from the workers' host caches; False if none held it."""
        self.input_processor.forget_lora(lora_int_id)
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in the workers' host caches."""
        return self.engine_core.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds KV blocks."""
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
