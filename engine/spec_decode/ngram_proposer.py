"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or its
own output. Cheap and model-free; it pays on input-grounded text (code edits, quotes, repeated keys)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Proposes up to num_speculative_tokens drafts for a sequence from its own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """At most `max_drafts` (and num_speculative_tokens) tokens; [] where no n-gram matches."""
        num_drafts = min(self.num_speculative_tokens, max_drafts)
        if num_drafts <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Every window but the suffix itself (the last one starts at len - n).
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + num_drafts].tolist()
        return []
