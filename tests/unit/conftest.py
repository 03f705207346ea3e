"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.unit.smollm2_tokens import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()
