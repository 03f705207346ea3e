"""kernels.host_malloc: the sampler's freed buffers stay in the heap, so the next call faults no pages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def sampler_page_faults(mode: str) -> dict[str, float]:
    """The median call's minor page faults by row count (Sampler at temperature 1.0, SmolLM2's
    vocabulary), in a fresh process: the thresholds are process-wide and stay set."""
    command = [sys.executable, "-m", "benchmarks.host_malloc", "--child", mode]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    return {rows: figures["faults"] for rows, figures in result.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_sampler_buffers_are_reused_without_page_faults():
    default, kept = sampler_page_faults("default"), sampler_page_faults("kept")
    # With glibc's own thresholds, 64 rows of float32 logits (12 MB, 3,072 pages) and the buffers
    # derived from them are mapped afresh, or trimmed off the heap, and faulted in at every call.
    assert default["64"] > 3072
    assert kept["64"] < default["64"] / 100
