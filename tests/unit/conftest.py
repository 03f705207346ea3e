"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.unit.smollm2_tokens import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(params=["schedule", "update"])
def worker_runs(request) -> str:
    """When the fake worker runs an async step: as soon as it is scheduled, or when its output is
    due (tests/unit/scheduler_async_core.py)."""
    return request.param
