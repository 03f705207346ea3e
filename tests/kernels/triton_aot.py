"""Compiles the Triton kernels for an H100/H200 (sm_90) ahead of time, without a GPU.

Run as `python -m tests.kernels.triton_aot` in a process without TRITON_INTERPRET (the kernels must
be made for the compiler, not the interpreter). Triton's own compiler and ptxas (shipped in the
wheel) check what the interpreter never does: types, tl.dot's tile shapes, loop bounds, registers.
The shapes are the launcher's own picks (kernels.attention.triton_paged.attention_constants) for
real head layouts, in bf16.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.attention.triton_kernels import merge_splits_kernel, paged_attention_kernel
from kernels.attention.triton_paged import attention_constants
from kernels.triton_cache import reshape_and_cache_kernel

TARGET = GPUTarget("cuda", 90, 32)
# (query heads, KV heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B.
HEAD_LAYOUTS = [(9, 3, 64), (32, 8, 64), (32, 8, 128)]


def compile_for_gpu(
    kernel: triton.JITFunction, types: dict[str, str], constants: dict, num_warps: int = 4
) -> None:
    """Compile `kernel` with these argument types ("*bf16", "i32", …) and constexpr values."""
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    missing = [name for name in kernel.arg_names if name not in types and name not in constants]
    if missing:
        raise ValueError(f"{kernel.__name__}: no type or value for {missing}")
    triton.compile(
        ASTSource(kernel, signature, constexprs=constants), target=TARGET, options={"num_warps": num_warps}
    )


def attention_types(dtype: str) -> dict[str, str]:
    pointers = {"block_table_ptr": "*i64", "seq_lens_ptr": "*i64", "query_start_ptr": "*i32"}
    for name in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr"):
        pointers[name] = f"*{dtype}"
    for name in ("partial_out_ptr", "partial_max_ptr", "partial_sum_ptr"):
        pointers[name] = "*fp32"
    scalars = {"scale_log2": "fp32", "soft_cap_log2": "fp32", "stride_c_head": "i64"}
    return (
        pointers
        | scalars
        | {
            name: "i32"
            for name in paged_attention_kernel.arg_names
            if name not in pointers | scalars and name.islower()
        }
    )


def main() -> None:
    for heads, kv_heads, head_dim in HEAD_LAYOUTS:
        # Decodes, split decodes and prefill; soft-capped (Gemma 2) or not, so both variants compile.
        for max_query_len, num_splits, soft_cap in ((1, 1, False), (1, 4, True), (512, 1, True)):
            constants, num_warps = attention_constants(
                heads, kv_heads, head_dim, 16, max_query_len, torch.bfloat16, num_splits
            )
            constants["SOFT_CAP"] = soft_cap
            compile_for_gpu(paged_attention_kernel, attention_types("bf16"), constants, num_warps)
            print(f"attention {heads}/{kv_heads}x{head_dim} queries {max_query_len} splits {num_splits}: ok")
    merge_types = {name: "i32" for name in merge_splits_kernel.arg_names if name.islower()}
    merge_types |= {
        "out_ptr": "*bf16",
        "partial_out_ptr": "*fp32",
        "partial_max_ptr": "*fp32",
        "partial_sum_ptr": "*fp32",
    }
    compile_for_gpu(
        merge_splits_kernel, merge_types, {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "SPLITS_POW2": 4}
    )
    print("merge: ok")
    cache_types = {name: "i32" for name in reshape_and_cache_kernel.arg_names if name.islower()}
    for name in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"):
        cache_types[name] = "*bf16"
    cache_types["slot_mapping_ptr"] = "*i64"
    cache_constants = {
        "NUM_KV_HEADS": 8,
        "HEAD_DIM": 128,
        "HEADS_POW2": 8,
        "HEAD_DIM_POW2": 128,
        "BLOCK_SIZE": 16,
    }
    compile_for_gpu(reshape_and_cache_kernel, cache_types, cache_constants)
    print("reshape_and_cache: ok")


if __name__ == "__main__":
    main()
