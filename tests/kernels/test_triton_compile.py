"""The Triton kernels compile for the GPU (sm_90) here, without one: tests/kernels/triton_aot.py in a
process without Triton's interpreter. The other Triton tests run the kernels in the interpreter,
which checks the arithmetic but not what only the compiler does (types, tile shapes, registers)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_aot"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(": ok") == 11, done.stdout
