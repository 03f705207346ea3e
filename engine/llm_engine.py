"""LLMEngine: the synchronous engine API (vLLM's names) over an EngineCore client."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core_client import InprocClient
from engine.input_processor import InputProcessor, PromptType
from engine.models.model_files import read_arch_config, resolve_engine_config, resolve_model_source
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests, steps the engine, and returns what each step produced."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = resolve_engine_config(config)
        source = resolve_model_source(self.config.model.model)
        arch = read_arch_config(source)
        self.tokenizer = load_tokenizer(source, self.config.model.tokenizer)
        eos = self.tokenizer.eos_token_id
        if eos is None and arch.eos_token_ids:
            eos = arch.eos_token_ids[0]
        max_model_len = self.config.model.max_model_len
        assert max_model_len is not None
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len,
            arch.vocab_size,
            eos,
            arch.eos_token_ids,
            max_logprobs=self.config.model.max_logprobs,
            max_num_seqs=self.config.scheduler.max_num_seqs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = InprocClient(self.config)

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
    ) -> None:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, prompt_text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority
        )
        self.output_processor.add_request(request, prompt_text)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = self.output_processor.abort_requests(ids)
        if live:
            self.engine_core.abort_requests(live)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of every request that progressed or finished."""
        outputs = self.engine_core.get_output()
        stats = outputs.scheduler_stats
        if not outputs.outputs and stats and not stats.num_running_reqs + stats.num_waiting_reqs:
            # The core holds nothing yet the front end waits: fail loudly rather than spin forever.
            lost = sorted(self.output_processor.requests)
            if lost:
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

    def shutdown(self) -> None:
        self.engine_core.shutdown()
