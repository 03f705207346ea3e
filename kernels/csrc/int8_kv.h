// The row format of an int8 KV cache (kv_cache_dtype="int8"), shared by the op that writes it
// (reshape_and_cache_int8, cache_ops.cpp) and the one that attends over it (int8_attention.cpp).
//
// The cache is one int8 tensor [2, kv_heads, num_blocks, block_size, head_dim + 4]: each (token, KV
// head) row holds head_dim int8 values, then that row's float32 scale in its last 4 bytes, so that a
// block of a layer is still one slice of one tensor (block copies, swaps and shared prefixes move it
// unchanged) and a row's scale arrives with its values. Quantization is symmetric per row: scale =
// max |x| / 127, value = x / scale rounded to nearest, ties to even (0 and scale 0 for a row of zeros).

#pragma once

#include <cstdint>
#include <cstring>

namespace raypage::int8_kv {

constexpr int64_t kScaleBytes = sizeof(float);

// Bytes of one row of a cache whose rows hold head_dim values.
inline int64_t row_bytes(int64_t head_dim) { return head_dim + kScaleBytes; }

// The scale stored after a row's head_dim values (4-byte aligned only where head_dim is).
inline float scale_of(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(scale));
  return scale;
}

}  // namespace raypage::int8_kv
