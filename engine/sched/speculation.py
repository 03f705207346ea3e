"""Speculative decoding in the scheduler: drafts proposed after each step, scheduled with their
sequence's next token, and the rejected ones rolled back once the workers verified them.

A decoding sequence with drafts d1..dk computes 1 + k tokens in one step (its last token and the
drafts, a multi-token row like a prefill chunk). The workers sample each of the k + 1 positions as
if the drafts before it had been generated, and return the drafts they sampled themselves followed
by the first token they sampled differently (or the (k + 1)-th, all accepted): for n-gram drafts
(a point mass on each draft) that is exactly the rejection sampler of Leviathan et al., so outputs
keep the target's distribution, and with seeds or greedy they are the very tokens decoding one at a
time would give. The KV of rejected drafts is dropped: `num_computed_tokens` steps back and blocks
holding only rejected positions return to the pool. Blocks are published to the prefix cache only
up to the verified tokens, so no cached block ever holds a rejected draft.
"""

from __future__ import annotations

import logging

import msgspec

from engine.outputs import SchedulerStats, SpecDecodeStats
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request, Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram_proposer import NgramProposer

logger = logging.getLogger(__name__)


class Speculator:
    """Proposes drafts for the sequences that can take them, and settles them after a step."""

    def __init__(self, config: SpeculativeConfig, kv_cache_manager: KVCacheManager, max_seq_len: int) -> None:
        self.config = config
        # n-gram drafts are found here; a draft model's come back with the step's output, and
        # need `lookahead` slots past each proposing sequence's tokens.
        self.proposer = NgramProposer(config) if config.method == "ngram" else None
        self.lookahead = config.num_speculative_tokens if self.proposer is None else 0
        self.kv_cache_manager = kv_cache_manager
        self.max_seq_len = max_seq_len
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._reasons_logged: set[str] = set()

    @staticmethod
    def why_not(request: Request) -> str | None:
        """Why a request's sequences take no drafts, or None where they do: not beams or several
        sequences sharing blocks (forks), not under a grammar (its matcher would have to try each draft)."""
        if request.beam_search is not None:
            return "beam search"
        if request.sampling_params.num_sequences > 1:
            return "n > 1"
        if request.grammar is not None:
            return "structured output"
        return None

    @classmethod
    def speculates(cls, request: Request) -> bool:
        return cls.why_not(request) is None

    def log_if_off(self, request: Request) -> None:
        """Say why an arriving request decodes without speculation: the first time for each reason
        at INFO, later ones at DEBUG (a server may see many such requests)."""
        reason = self.why_not(request)
        if reason is None:
            return
        level = logging.DEBUG if reason in self._reasons_logged else logging.INFO
        self._reasons_logged.add(reason)
        logger.log(level, "request %s decodes without speculation: %s", request.request_id, reason)

    def lookahead_for(self, request: Request) -> int:
        """Slots past a sampling sequence's tokens for the draft model's proposals (none for n-grams)."""
        return self.lookahead if self.speculates(request) else 0

    def propose(
        self, requests: list[Request], num_running_seqs: int, draft_model_proposals: dict[str, list[int]]
    ) -> None:
        """Fresh drafts for every live sequence of the running requests that speculate (none at
        all where the next step would not take them): n-gram lookups, or the draft model's."""
        drafting = self.allows(num_running_seqs)
        for request in requests:
            if not self.speculates(request):
                continue
            max_tokens = request.sampling_params.max_tokens
            for seq in request.live_seqs:
                seq.spec_token_ids = []
                if not drafting or seq.spec_backoff.pauses():
                    continue
                # Drafts past max_tokens or the length limit would be computed for nothing.
                room = self.max_seq_len - seq.num_tokens - 1
                if max_tokens is not None:
                    room = min(room, max_tokens - seq.num_output_tokens - 1)
                if self.proposer is None:
                    seq.spec_token_ids = draft_model_proposals.get(seq.seq_id, [])[: max(room, 0)]
                else:
                    seq.spec_token_ids = self.proposer.propose(seq.all_token_ids, room)

    def allows(self, num_running_seqs: int) -> bool:
        """Whether this step speculates at all (`disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running_seqs <= limit

    def settle(self, seq: Sequence, num_drafts: int, num_sampled: int) -> None:
        """A step verified `num_drafts` drafts of `seq` and returned `num_sampled` tokens (the
        accepted drafts and one more): step back over the rejected ones and free their blocks."""
        num_accepted = max(num_sampled - 1, 0)
        seq.num_computed_tokens -= num_drafts - num_accepted
        # (With a draft model, also the lookahead slots its proposals were written to.)
        self.kv_cache_manager.free_blocks_after(seq, seq.num_computed_tokens)
        if not num_drafts:
            return
        seq.spec_backoff.record(num_accepted)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        # A copy: the totals go on changing after the stats are handed out.
        per_pos = list(self.stats.num_accepted_tokens_per_pos)
        stats.spec_decode = msgspec.structs.replace(self.stats, num_accepted_tokens_per_pos=per_pos)
        return stats
