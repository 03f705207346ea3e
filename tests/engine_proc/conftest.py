"""Fixtures of the engine-process tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_proc.helpers import SETTINGS
from tests.model.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def engine_settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SETTINGS on a tiny random Llama (SmolLM2's tokenizer, no EOS). These tests are about the core's
    process (start-up, messages, aborts, shutdown, death), not the weights: SmolLM2 would add seconds
    of loading to each of their dozen engines, and its steps are slower."""
    model = write_tiny_model(tmp_path_factory.mktemp("engine-proc") / "model")
    return {"model": str(model), **SETTINGS}
