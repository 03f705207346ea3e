"""Triton's interpreter for the kernel tests on a machine without CUDA.

Triton decides at `@triton.jit` time (when a kernel module is imported) whether a kernel compiles for
the GPU or runs in its interpreter on CPU tensors, from TRITON_INTERPRET; this conftest is imported
before any test module here, so the kernels are made for the interpreter. Without CUDA nothing could
run a Triton kernel natively anyway, so the variable changes nothing for other tests of the session
(or for their subprocesses, which inherit it). With CUDA it stays unset and the same tests run the
kernels on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
