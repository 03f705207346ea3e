"""Compiles the C++ CPU kernels in kernels/csrc once, and loads them into the process.

`python -m kernels.build` (a step of `make install`) compiles them ahead of time with
`torch.utils.cpp_extension` into a folder named by the hash of the sources and headers, the torch
version and the compiler flags, inside the virtualenv (or ~/.cache/raypage/kernels outside one);
later runs only load the compiled library. At run time `cpu_kernels_available()` loads it, compiling first if it is
missing, and answers False with one log line when that fails (no compiler, no ninja): attention then
stays on the plain torch path, and serving never fails for it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "amx_attention.cpp",
        "fused_ops.cpp",
        "cache_ops.cpp",
        "panel_gemm.cpp",
        "tiled_attention.cpp",
        "decoder_layer.cpp",
        "token_bitmask.cpp",
        "moe.cpp",
        "quant_linear.cpp",
        "int8_attention.cpp",
        "lora.cpp",
    )
]
# Every header in csrc, hashed with the sources that include them: a change to one builds a new library.
HEADERS = sorted(CSRC.glob("*.h"))
# -march=native: the library is built on the machine that runs it; the CPU's feature flags are in the
# hash, so a virtualenv copied to a different CPU builds its own instead of loading foreign code.
# -fopenmp: at::parallel_for is an inline `#pragma omp parallel`, serial without it; the library then
# needs libgomp.so.1, which resolves to the copy torch has already loaded.
# -ffp-contract=off: no fused multiply-adds where torch rounds between the multiply and the add.
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-ffp-contract=off"]


def _cpu_features() -> str:
    try:
        return next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.machine()


def _library_name() -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join([torch.__version__, _cpu_features(), *CFLAGS]).encode())
    return f"raypage_cpu_kernels_{digest.hexdigest()[:16]}"


def build_root() -> Path:
    """Where compiled kernels live: $RAYPAGE_KERNEL_CACHE, the virtualenv, or ~/.cache/raypage/kernels."""
    if configured := os.environ.get("RAYPAGE_KERNEL_CACHE"):
        return Path(configured).expanduser()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "share" / "raypage" / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "raypage" / "kernels"


def build_and_load() -> Path:
    """Load the compiled kernels, compiling them first if this version was never built; raises on failure."""
    name = _library_name()
    directory = build_root() / name
    library = directory / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return library
    from torch.utils import cpp_extension  # imports setuptools: only paid when compiling

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    _remove_other_builds(keep=directory)
    return library


def _remove_other_builds(keep: Path) -> None:
    """Builds of earlier sources are never loaded again (a process that has one mapped keeps it)."""
    for stale in keep.parent.glob("raypage_cpu_kernels_*"):
        if stale != keep:
            shutil.rmtree(stale, ignore_errors=True)


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether torch.ops.raypage's CPU kernels are loaded (compiling them if needed); logs once if not."""
    try:
        build_and_load()
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path serves instead
        logger.warning("raypage C++ CPU kernels unavailable, attention uses the torch sdpa path: %s", exc)
        return False
    return True


def main() -> None:
    """Compile now (make install); a failure is reported, not raised: the torch path still serves."""
    started = time.perf_counter()
    try:
        library = build_and_load()
    except Exception as exc:
        print(f"raypage CPU kernels not built, attention will use the torch sdpa path: {exc}")
        return
    print(f"raypage CPU kernels ready in {time.perf_counter() - started:.1f} s: {library}")


if __name__ == "__main__":
    main()
