"""Shared fixtures: the packaged SmolLM2 and its Hugging Face transformers reference.

Triton's interpreter is switched on here, for the whole session, where there is no CUDA: Triton
decides at `@triton.jit` time (when a kernel module is first imported, by whichever test module
collects first, e.g. the GPU check's) whether a kernel compiles for the GPU or runs on CPU tensors in
its interpreter. Without CUDA nothing could run a Triton kernel natively anyway, so the variable
changes nothing else (subprocesses inherit it too). With CUDA it stays unset and the same tests run
the kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
