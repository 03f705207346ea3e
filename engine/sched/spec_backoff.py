"""How often a sequence proposes speculative drafts, from how its recent drafts fared."""

from __future__ import annotations


class SpecBackoff:
    """Where a sequence's drafts keep failing (text that no longer repeats), verifying them costs
    compute for nothing: after a round with no draft accepted, the sequence skips as many rounds
    of proposals as rounds have failed in a row (up to MAX_PAUSE); an accepted draft resets it."""

    MAX_PAUSE = 8

    def __init__(self) -> None:
        self.failures = 0
        self.paused = 0

    def record(self, num_accepted: int) -> None:
        self.failures = 0 if num_accepted else min(self.failures + 1, self.MAX_PAUSE)
        self.paused = self.failures

    def pauses(self) -> bool:
        """Whether this round of proposals is skipped (counting it down)."""
        if self.paused:
            self.paused -= 1
            return True
        return False
