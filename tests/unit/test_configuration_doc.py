"""docs/configuration.md is exactly what `python -m cluster.config_reference` generates."""

from __future__ import annotations

from cluster.config_reference import DOC_PATH, REGENERATE, render


def test_configuration_doc_matches_the_code() -> None:
    assert DOC_PATH.read_text() == render(), (
        f"{DOC_PATH.name} differs from the settings in the code: regenerate it with `{REGENERATE}`"
    )
