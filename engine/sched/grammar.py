"""What the scheduling core needs of a grammar (structured outputs), whatever library compiles it.

A request with a constraint waits in the queue until its grammar is compiled (off the step loop, by
engine/structured/); each of its sequences then holds a matcher that follows its output token by
token: forked with the sequence (parallel sampling, beams), kept through preemption (the tokens it
has accepted stay the sequence's own), and asked after every token whether the output is complete.
The token mask each matcher allows is computed by engine/structured/ for the step's batch.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> None:
        """Advance by a sampled token (one the mask allowed); a token the grammar refuses puts the
        matcher in its error state."""

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position."""

    def is_terminated(self) -> bool:
        """The output is complete: nothing but the end of sequence may follow (or an error)."""

    def error(self) -> str | None:
        """Why the matcher cannot go on (a refused token, a limit of the grammar library), if so."""


class CompiledGrammar(Protocol):
    """A grammar compiled against the model's vocabulary."""

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start."""


# A grammar being compiled: its result, or the exception that says why it could not be.
PendingGrammar = Future  # Future[CompiledGrammar]
