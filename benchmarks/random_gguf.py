"""A random-weight Llama written as a GGUF file with gguf-py, for side-by-side runs at sizes no
packaged model has (by default about 1B parameters: Llama 3.2 1B's shape with SmolLM2's tokenizer).

    python -m benchmarks.random_gguf OUT.gguf [--type Q8_0|F16] [--layers 16] [--hidden 2048] ...

Q8_0 and F16 are written directly; K-quants (Q4_K_M) come from llama.cpp's own quantizer on the F16
file (`llama-quantize OUT-f16.gguf OUT-q4_k_m.gguf Q4_K_M`), as users' files do. Weights are
normal with standard deviation 0.02, norms ones; the outputs are meaningless, the bytes a step
reads are a real model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from tests.model.tiny_gguf import copy_tokenizer

VOCAB = 49152  # SmolLM2's tokenizer


def write_random_llama(
    target: Path, qtype: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int
) -> None:
    """The model's tensors under llama.cpp's names, projections in `qtype`, norms in float32."""
    arch = gguf.MODEL_ARCH.LLAMA
    writer = gguf.GGUFWriter(target, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_freq_base(500000.0)
    copy_tokenizer(writer)
    rng = np.random.default_rng(0)
    block_type = gguf.GGMLQuantizationType[qtype]
    head_dim = hidden // heads

    def projection(name: str, rows: int, columns: int) -> None:
        weights = rng.standard_normal((rows, columns), dtype=np.float32) * 0.02
        if block_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, weights.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(weights, block_type), raw_dtype=block_type)

    projection("token_embd.weight", VOCAB, hidden)  # tied: also the LM head
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        projection(f"{block}.attn_q.weight", hidden, hidden)
        projection(f"{block}.attn_k.weight", kv_heads * head_dim, hidden)
        projection(f"{block}.attn_v.weight", kv_heads * head_dim, hidden)
        projection(f"{block}.attn_output.weight", hidden, hidden)
        projection(f"{block}.ffn_gate.weight", intermediate, hidden)
        projection(f"{block}.ffn_up.weight", intermediate, hidden)
        projection(f"{block}.ffn_down.weight", hidden, intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", type=Path)
    parser.add_argument("--type", default="Q8_0", choices=["Q8_0", "F16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    write_random_llama(
        args.target, args.type, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads
    )


if __name__ == "__main__":
    main()
