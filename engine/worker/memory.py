"""Host and device memory readings used to size the KV cache after a profiling forward pass."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

GiB = 2**30
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def host_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


@dataclasses.dataclass
class ProfileResult:
    """Peak memory a profiling run took beyond what was held before it."""

    peak_bytes: int
    available_after: int  # memory still free for the KV cache (device, or host on the CPU)


def profile_host_memory(run: Callable[[], None]) -> ProfileResult:
    """Run `run` and measure how far the process's resident set grew at its peak."""
    before = _proc_status_kib("VmRSS") * 1024
    # Writing 5 to clear_refs resets the high-water mark, so VmHWM afterwards is this run's peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    run()
    peak = _proc_status_kib("VmHWM") * 1024
    return ProfileResult(max(peak - before, 0), host_available_bytes())


def profile_cuda_memory(run: Callable[[], None], device: torch.device, utilization: float) -> ProfileResult:
    """Run `run`; what is left of `utilization` of the GPU after weights, peak activations and others."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_elsewhere = total - free - torch.cuda.memory_reserved(device)  # other processes, CUDA context
    return ProfileResult(peak, int(total * utilization) - peak - used_elsewhere)
