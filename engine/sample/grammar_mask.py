"""Applying a step's grammar bitmask (structured outputs) to the logits, before any sampling processor.

The scheduler sends one mask row per sampling sequence under a grammar, keyed by seq_id; rows of
the batch without a grammar are left as they are and cost nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.outputs import GrammarBitmask
from engine.transfers import host_to_device
from kernels.token_bitmask import apply_token_bitmask_


def apply_grammar_bitmask(logits: torch.Tensor, row_seq_ids: list[str], grammar: GrammarBitmask) -> None:
    """Set to -inf, in place, every logit of `logits` ([rows, vocab], row i sampling for
    `row_seq_ids[i]`) that its sequence's grammar does not allow."""
    row_of = {seq_id: row for row, seq_id in enumerate(row_seq_ids)}
    rows = np.array([row_of[seq_id] for seq_id in grammar.seq_ids], dtype=np.int64)
    bitmask = np.frombuffer(grammar.data, dtype="<i4").reshape(len(grammar.seq_ids), grammar.words)
    apply_token_bitmask_(logits, host_to_device(bitmask, logits.device), host_to_device(rows, logits.device))
