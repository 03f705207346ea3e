"""Choosing the attention backend: the `attention_backend` setting, $RAYPAGE_ATTENTION_BACKEND, the
device, and clear errors for a choice that cannot run here."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest
import torch

from engine import LLM
from engine.config import AttentionBackendName, EngineConfig
from kernels.attention import get_attention_backend
from kernels.attention.cpu_paged import cpu_paged_attention
from kernels.attention.sdpa import sdpa_attention
from kernels.attention.selector import BACKEND_ENV, BACKEND_NAMES
from kernels.attention.triton_paged import triton_attention
from kernels.build import cpu_kernels_available

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without CUDA")


@pytest.fixture(autouse=True)
def _no_backend_in_the_environment(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_the_config_offers_every_backend_name():
    assert set(typing.get_args(AttentionBackendName)) == set(BACKEND_NAMES)
    assert EngineConfig().model.attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig.from_flat(attention_backend="flash")


def test_auto_on_the_cpu_is_cpu_paged_and_the_environment_overrides_it(monkeypatch):
    cpu_default = cpu_paged_attention if cpu_kernels_available() else sdpa_attention
    assert get_attention_backend("auto", "cpu") is cpu_default
    assert get_attention_backend(None, "cpu") is cpu_default
    assert get_attention_backend("torch", "cpu") is sdpa_attention
    monkeypatch.setenv(BACKEND_ENV, "sdpa")
    assert get_attention_backend("auto", "cpu") is sdpa_attention
    # An explicit setting wins over the environment (triton runs on CPU tensors in the interpreter).
    assert get_attention_backend("triton", TRITON_DEVICE) is triton_attention


def test_unknown_names_are_refused_listing_the_names(monkeypatch):
    with pytest.raises(
        ValueError, match=r"unknown attention backend 'flash'.*available: auto, cpu_paged, flash_attn"
    ):
        get_attention_backend("flash", "cpu")
    monkeypatch.setenv(BACKEND_ENV, "paged")
    with pytest.raises(
        ValueError, match=rf"unknown attention backend 'paged' \(attention_backend or \${BACKEND_ENV}\)"
    ):
        get_attention_backend("auto", "cpu")


@needs_cpu
def test_flash_attn_without_cuda_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn' cannot run here: "):
        get_attention_backend("flash_attn", "cpu")
    monkeypatch.setenv(BACKEND_ENV, "flash_attn")
    with pytest.raises(ValueError, match=rf"\${BACKEND_ENV}='flash_attn' cannot run here"):
        get_attention_backend("auto", "cpu")


def test_triton_refuses_a_block_size_its_kernels_cannot_tile():
    with pytest.raises(
        ValueError, match="attention_backend='triton' cannot run here: block_size 8 is not a power"
    ):
        get_attention_backend("triton", "cpu", block_size=8)
    with pytest.raises(ValueError, match="block_size 48 is not a power of two >= 16"):
        LLM(dtype="float32", num_kv_blocks=16, attention_backend="triton", block_size=48)


@needs_cpu
def test_triton_without_cuda_or_the_interpreter_names_both():
    # A fresh process without TRITON_INTERPRET: this one made its kernels for the interpreter.
    script = (
        "from kernels.attention import get_attention_backend\n"
        "try:\n"
        "    get_attention_backend('triton', 'cpu')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", BACKEND_ENV)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "attention_backend='triton' cannot run here: needs CUDA tensors, or TRITON_INTERPRET=1"
    ), done.stdout


def test_triton_not_installed_is_named(monkeypatch):
    # Importing triton fails as it does where the package is missing.
    monkeypatch.setitem(sys.modules, "triton", None)
    for module in [name for name in sys.modules if name.startswith("kernels.attention.triton")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.delitem(sys.modules, "kernels.triton_cache")
    with pytest.raises(
        ValueError, match=r"attention_backend='triton' cannot run here: triton is not installed"
    ):
        get_attention_backend("triton", "cpu")


@pytest.mark.gpu
def test_auto_on_cuda_picks_a_gpu_kernel():
    backend = get_attention_backend("auto", "cuda", block_size=16)
    assert backend not in (sdpa_attention, cpu_paged_attention)
