"""Skips the multi-host tests, with the reason, where network namespaces cannot be made."""

from __future__ import annotations

import pytest

from tests.multihost.netns_cluster import unavailable_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if "tests/multihost/" in item.nodeid]
    if not mine:
        return
    reason = unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"multi-host tests need network namespaces: {reason}")
    for item in mine:
        item.add_marker(skip)
