"""Picks the attention backend from the `attention_backend` setting, $RAYPAGE_ATTENTION_BACKEND and
the device.

Names: `auto`; `torch` (plain torch over gathered blocks, the same function as `sdpa`); `triton`
(kernels/attention/triton_paged.py); `flash_attn` (kernels/attention/flash_attn.py, with the `gpu`
extra); and the CPU backends `cpu_paged` (the C++ decode kernel), `sdpa` and `reference`.

`auto` picks flash_attn on CUDA when it can run there (installed, block size allowed), else triton,
else torch; elsewhere cpu_paged (which is sdpa where its C++ kernel cannot be built). Like vLLM's
VLLM_ATTENTION_BACKEND, the environment variable overrides `auto` for every worker it reaches. An
explicit choice that cannot run here is a ValueError saying what is missing. The GPU backends are
imported only when considered, so that neither triton nor flash_attn is needed elsewhere; each
module names a backend function and an `*_unavailable_reason(device, block_size) -> str | None`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable

import torch

from kernels.attention.cpu_paged import cpu_paged_attention
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.reference import reference_attention
from kernels.attention.sdpa import sdpa_attention
from kernels.build import cpu_kernels_available

logger = logging.getLogger(__name__)

# (query, key, value, kv_cache, metadata, the layer's params) -> attention output; writes key/value
# to the cache.
AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, AttentionParams], torch.Tensor
]

BACKEND_ENV = "RAYPAGE_ATTENTION_BACKEND"

_TORCH_BACKENDS: dict[str, AttentionBackend] = {
    "cpu_paged": cpu_paged_attention,
    "reference": reference_attention,
    "sdpa": sdpa_attention,
    "torch": sdpa_attention,
}
# name -> (module, backend function, reason function); imported on demand.
_GPU_BACKENDS: dict[str, tuple[str, str, str]] = {
    "flash_attn": ("kernels.attention.flash_attn", "flash_attn_attention", "flash_attn_unavailable_reason"),
    "triton": ("kernels.attention.triton_paged", "triton_attention", "triton_unavailable_reason"),
}
BACKEND_NAMES = ("auto", *sorted([*_TORCH_BACKENDS, *_GPU_BACKENDS]))


def get_attention_backend(
    name: str | None = None, device: torch.device | str = "cpu", block_size: int = 16
) -> AttentionBackend:
    """The backend `name` asks for (None: `auto`) on `device` with KV blocks of `block_size` tokens.

    `cpu_paged` asked for where its kernel cannot be built is `sdpa`: serving never fails for a
    missing compiler (kernels.build logs why, once).
    """
    setting = f"attention_backend={name!r}"
    if name in (None, "auto") and os.environ.get(BACKEND_ENV):
        name = os.environ[BACKEND_ENV]
        setting = f"${BACKEND_ENV}={name!r}"
    name = name or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r} (attention_backend or ${BACKEND_ENV}); "
            f"available: {', '.join(BACKEND_NAMES)}"
        )
    device = torch.device(device)
    if name == "auto":
        name, passed_over = _auto_choice(device, block_size)
        setting = f"auto on {device.type}{passed_over}"
    elif name in _GPU_BACKENDS:
        reason = _unavailable_reason(name, device, block_size)
        if reason is not None:
            raise ValueError(f"{setting} cannot run here: {reason}")
    logger.info("attention backend: %s (%s)", name, setting)
    if name in _GPU_BACKENDS:
        module, function, _ = _GPU_BACKENDS[name]
        return getattr(importlib.import_module(module), function)
    if name == "cpu_paged" and not cpu_kernels_available():
        name = "sdpa"
    return _TORCH_BACKENDS[name]


def _auto_choice(device: torch.device, block_size: int) -> tuple[str, str]:
    """`auto`'s pick and, when it passed over a backend, why (for the start-up log)."""
    if device.type != "cuda":
        return "cpu_paged", ""
    passed_over = []
    for candidate in ("flash_attn", "triton"):
        reason = _unavailable_reason(candidate, device, block_size)
        if reason is None:
            return candidate, "".join(passed_over)
        passed_over.append(f"; {candidate} unavailable: {reason}")
    return "torch", "".join(passed_over)


def _unavailable_reason(name: str, device: torch.device, block_size: int) -> str | None:
    module, _, reason_function = _GPU_BACKENDS[name]
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:  # the package (or, before its module exists, the backend) is missing
        return f"{name} is not installed ({exc})"
    return getattr(imported, reason_function)(device, block_size)
