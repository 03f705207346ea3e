"""Fixtures the Serve modules share: a tiny random-weight Llama, and the offline engine's greedy
texts on it that the served ones must equal (once per module that asks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.serve_checks import offline_greedy_texts
from tests.model.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> dict[str, str]:
    return offline_greedy_texts(tiny_model)
