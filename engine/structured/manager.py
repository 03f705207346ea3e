"""The engine core's structured-output manager: each request's grammar compiled off the step loop
(a thread; the request waits in the queue meanwhile, others go first), compiled grammars cached by
their text, and each step's token bitmask for the rows under a grammar.

The backend is built at the first request with a constraint (it needs the tokenizer's vocabulary),
on the compile thread, so an engine that never sees one never loads it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine.config import ResolvedModelConfig
from engine.models.tokenizer_files import tokenizer_json
from engine.outputs import GrammarBitmask, SchedulerStats
from engine.sampling_params import StructuredOutputsParams
from engine.sched.grammar import CompiledGrammar, GrammarMatcher
from engine.structured.backend import GrammarBackend
from engine.structured.guidance import GuidanceBackend

logger = logging.getLogger(__name__)

# Compiled grammars kept for requests that repeat a constraint (the same schema, tool set or regex).
MAX_CACHED_GRAMMARS = 512
# The grammar library (engine/structured/guidance.py says why this one).
BACKEND: type[GrammarBackend] = GuidanceBackend


def grammar_bitmask(backend: GrammarBackend, rows: list[tuple[str, GrammarMatcher]]) -> GrammarBitmask:
    """The token masks of (seq_id, matcher) rows, as the step sends them to the workers."""
    bitmask = np.empty((len(rows), backend.words), dtype=np.int32)
    backend.fill_bitmask([matcher for _, matcher in rows], bitmask)
    return GrammarBitmask([seq_id for seq_id, _ in rows], backend.words, bytearray(bitmask))


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """A ValueError naming the field when the constraint is invalid or cannot be enforced; run by
    the front end, before the request is scheduled."""
    BACKEND.grammar_text(params)


class StructuredOutputManager:
    """Grammars for the requests of one engine core, and the token masks of its steps."""

    def __init__(self, model: ResolvedModelConfig) -> None:
        self._model = model
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self._grammars: collections.OrderedDict[str, Future[CompiledGrammar]] = collections.OrderedDict()
        self.num_requests = 0
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_cache_hits = 0

    def grammar_for(
        self, params: StructuredOutputsParams, eos_token_id: int | None
    ) -> Future[CompiledGrammar]:
        """The compiled grammar of a request's constraint: from the cache, or compiling now on the
        compile thread. A constraint that cannot be compiled gives a future holding the error."""
        self.num_requests += 1
        try:
            text = BACKEND.grammar_text(params)
        except ValueError as exc:  # the front end checks first; a request sent around it fails alone
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(exc)
            return failed
        cached = self._grammars.get(text)
        if cached is not None and not (cached.done() and cached.exception() is not None):
            self.num_cache_hits += 1
            self._grammars.move_to_end(text)
            return cached
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._compile, text, eos_token_id)
        self._grammars[text] = future
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return future

    def start_bitmask(self, rows: list[tuple[str, GrammarMatcher]]) -> Future[GrammarBitmask] | None:
        """The step's token masks, computed on a thread of their own while the step's forward pass
        runs (the worker waits for them only to sample); None without rows. The matchers are not
        touched elsewhere until the step's tokens come back."""
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._mask_thread.submit(self.bitmask, rows)

    def bitmask(self, rows: list[tuple[str, GrammarMatcher]]) -> GrammarBitmask | None:
        """The step's token masks for (seq_id, matcher) rows; None without rows."""
        if not rows:
            return None
        assert self._backend is not None, "a matcher exists only once the backend compiled its grammar"
        return grammar_bitmask(self._backend, rows)

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """`stats` with the manager's running totals filled in."""
        stats.structured_output_requests = self.num_requests
        stats.grammar_compiles = self.num_compiles
        stats.grammar_compile_seconds = self.compile_seconds
        stats.grammar_cache_hits = self.num_cache_hits
        return stats

    def shutdown(self) -> None:
        for pool in (self._pool, self._mask_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, text: str, eos_token_id: int | None) -> CompiledGrammar:
        backend = self._get_backend(eos_token_id)
        start = time.perf_counter()
        compiled = backend.compile(text)
        self.num_compiles += 1
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def _get_backend(self, eos_token_id: int | None) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                model = self._model
                eos = [eos_token_id] if eos_token_id is not None else []
                eos += [token for token in model.hf_config.eos_token_ids if token not in eos]
                vocabulary = tokenizer_json(Path(model.model), model.model_format, model.tokenizer)
                self._backend = BACKEND(vocabulary, model.hf_config.vocab_size, eos)
                logger.info(
                    "structured outputs: %s over the model's vocabulary, ready in %.2f s",
                    BACKEND.__name__,
                    time.perf_counter() - start,
                )
            return self._backend
