// One add_lora call's operands, shared by its kernels (kernels/csrc/lora.cpp, lora_amx.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "moe_tiles.h"

namespace {

using namespace raypage::moe_tiles;

constexpr int64_t kRowBlock = 16;  // rows of a shrink item: one AMX tile's rows
constexpr int kExpandRows = 4;     // rows that share each load of B in the float32 expand
constexpr int kBlockVecs = static_cast<int>(kBlockCols / 16);  // kBlockCols in vectors of 16 floats

// One call's operands. Row i of the call is out's and x's row token_order[i]; shrunk holds a row of
// shrink_width floats for each.
template <typename T>
struct LoRACall {
  T* out;
  int64_t out_stride;
  const T* x;
  int64_t x_stride;
  const T *lora_a, *lora_b;
  int64_t in_features, out_features, rank, shrink_width;
  std::vector<int64_t> part_starts;  // [P + 1]: the first output column of each part, then O
  const int64_t* token_order;
  float* shrunk;

  const T* a_of(int64_t s) const { return lora_a + s * shrink_width * in_features; }
  const T* b_of(int64_t s) const { return lora_b + s * out_features * rank; }
  T* out_row(int64_t i) const { return out + token_order[i] * out_stride; }
  const T* x_row(int64_t i) const { return x + token_order[i] * x_stride; }
};

// Rows [first, first + rows) of the call, all of slot `slot`.
struct RowRange {
  int64_t slot, first, rows;
};

// out[c] = T(out[c] + sums[c]) for c < n: the one rounding of the added products.
template <typename T>
inline void add_row(const float* sums, int64_t n, T* out) {
  int64_t c = 0;
#if defined(RAYPAGE_SIMD)
  for (; c + kLanes <= n; c += kLanes)
    store_rounded(out + c, round_lanes<T>(add(load_floats(out + c), load_floats(sums + c))));
#endif
  for (; c < n; ++c) out[c] = static_cast<T>(static_cast<float>(out[c]) + sums[c]);
}

#if defined(__AVX512BF16__)
// bf16 sums rounded by the CPU's own conversion, one instruction for 16 values: to nearest even, as
// c10::BFloat16 rounds, but for values below 2^-126 (1.2e-38), which it flushes to zero.
template <>
inline void add_row<bf16>(const float* sums, int64_t n, bf16* out) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 sum = _mm512_add_ps(load_floats(out + c), _mm512_loadu_ps(sums + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
  for (; c < n; ++c) out[c] = static_cast<bf16>(static_cast<float>(out[c]) + sums[c]);
}
#endif



}  // namespace
