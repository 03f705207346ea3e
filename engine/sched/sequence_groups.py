"""The sequences of every request, and how a request's group of them grows and shrinks.

Parallel sampling (n, best_of) forks the prompt's sequence once the prompt but its last token is
cached; beam search forks the beams chosen more than once and finishes (prunes) the others at
every step, as engine/sched/beam_search.py decides. Forks share their parent's KV blocks (copied on
write by the KV cache manager). Finishing a sequence frees its blocks at once.
"""

from __future__ import annotations

import math

from engine.outputs import EngineCoreOutput, LogprobsLists
from engine.sched.beam_search import BeamSearchState
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request, Sequence, SequenceStatus
from engine.sched.step_plan import WorkerSequences


class SequenceGroups:
    """Every live sequence by `seq_id`, the forks of parallel sampling and the steps of beam search."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, worker_sequences: WorkerSequences, max_seq_len: int
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.worker_sequences = worker_sequences
        self.max_seq_len = max_seq_len
        self.seqs: dict[str, Sequence] = {}  # live sequences by seq_id
        self.beam_states: dict[str, BeamSearchState] = {}
        # Per beam search request: the candidates of the beams that got theirs before the others.
        self.beam_candidates: dict[str, dict[str, LogprobsLists]] = {}

    def add_request(self, request: Request) -> None:
        """Register a request's first sequence (and its beam search, if it is one)."""
        if request.seqs[0].seq_id in self.seqs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.seqs[request.seqs[0].seq_id] = request.seqs[0]
        if request.beam_search is not None:
            beam = request.beam_search
            eos = frozenset() if beam.ignore_eos or request.eos_token_id is None else {request.eos_token_id}
            # Beams stop where a sampled sequence would: at max_seq_len tokens (the last one sampled).
            max_tokens = min(beam.max_tokens, max(self.max_seq_len - request.num_prompt_tokens, 1))
            self.beam_states[request.request_id] = BeamSearchState(
                beam.beam_width, max_tokens, beam.length_penalty, frozenset(eos)
            )

    def forget_request(self, request_id: str) -> None:
        """Drop what a finished request's group kept."""
        self.beam_states.pop(request_id, None)
        self.beam_candidates.pop(request_id, None)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark a sequence finished and release its blocks now."""
        seq.status = status
        self.kv_cache_manager.free(seq)
        self.kv_cache_manager.forget(seq)
        self.seqs.pop(seq.seq_id, None)
        self.worker_sequences.forget(seq.seq_id)

    # ---- parallel sampling ---------------------------------------------------------------------

    def fork_if_ready(self, request: Request) -> None:
        """Parallel sampling: once the prompt but its last token is cached, fork the other sequences."""
        if not request.num_pending_forks:
            return
        parent = request.seqs[0]
        if parent.num_computed_tokens < request.num_prompt_tokens - 1:
            return
        for _ in range(request.num_pending_forks):
            self._add_fork(parent, request.new_seq_index())
        request.num_pending_forks = 0

    def _add_fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index)
        parent.request.seqs.append(child)
        self.seqs[child.seq_id] = child
        self.kv_cache_manager.fork(parent, child)
        return child

    # ---- beam search ---------------------------------------------------------------------------

    def advance_beams(
        self, request: Request, logprobs: dict[str, LogprobsLists | None]
    ) -> list[EngineCoreOutput]:
        """One beam search step: keep the best beams (forking, pruning); the final beams when it ends.

        A step needs every live beam's candidates; beams that got theirs early (chunked recompute
        after a preemption) wait for the others.
        """
        pending = self.beam_candidates.setdefault(request.request_id, {})
        beams = request.live_seqs
        for seq in beams:
            if logprobs.get(seq.seq_id) is not None:
                pending[seq.seq_id] = logprobs[seq.seq_id]
        if any(seq.seq_id not in pending for seq in beams):
            return []
        options = [pending.pop(seq.seq_id) for seq in beams]
        state = self.beam_states[request.request_id]
        step = state.step(
            [seq.output_token_ids for seq in beams],
            [seq.cumulative_logprob for seq in beams],
            # A grammar's mask leaves some candidates impossible (-inf): they are no continuations.
            [
                [
                    (token, logprob)
                    for token, logprob in zip(o.token_ids[0][1:], o.logprobs[0][1:], strict=True)
                    if logprob != -math.inf
                ]
                for o in options
            ],
        )
        if step.done:
            for seq in beams:
                self.finish_seq(seq, SequenceStatus.FINISHED_PRUNED)
            return request.beam_outputs(state.results())
        # Fork every beam chosen more than once before extending any, so forks start from the same tokens.
        extended: set[int] = set()
        targets = []
        for candidate in step.next_beams:
            parent = beams[candidate.parent]
            targets.append(
                self._add_fork(parent, request.new_seq_index()) if candidate.parent in extended else parent
            )
            extended.add(candidate.parent)
        for candidate, seq in zip(step.next_beams, targets, strict=True):
            seq.append_output_token(candidate.token_id)
            seq.cumulative_logprob = candidate.cumulative_logprob
        for position, seq in enumerate(beams):
            if position not in extended:
                self.finish_seq(seq, SequenceStatus.FINISHED_PRUNED)
        return []
