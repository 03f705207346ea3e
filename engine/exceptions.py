"""Typed errors the engine raises to its front ends (the HTTP layer maps them to status codes)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died, or its step loop raised): every pending request
    fails with this error, and so does every new one. The only recovery is a new engine."""


class EngineStartupError(RuntimeError):
    """The engine core process could not start: the message says why (the core's own error, its
    exit code, or the timeout)."""


class EngineOverloadedError(RuntimeError):
    """A new request was refused because the engine already holds as many unfinished requests as it
    admits (max_num_seqs + max_waiting_requests); nothing was queued, and the caller may retry."""
