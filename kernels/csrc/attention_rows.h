// Row primitives of the CPU attention kernels over float32 scores and values: a dot product,
// acc += p * rows, soft-capping and the softmax's exponentials, each kLanes floats at a time (simd.h)
// and then the rest one at a time. Shared by paged_attention.cpp and int8_attention.cpp.

#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace raypage::attention_rows {

using namespace raypage::simd;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  Vec partial = set1(0.f);
  for (; i + kLanes <= n; i += kLanes) partial = fmadd(load_floats(a + i), load_floats(b + i), partial);
  sum = reduce_add(partial);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[0:dim] += sum over t < n of p[t] * float(rows[t * dim : (t + 1) * dim]): one block's values.
// Each kLanes-float slice of acc stays in a register across the block's rows instead of going
// through memory once per row.
template <typename T>
inline void accumulate_rows(float* __restrict acc, const float* __restrict p, const T* __restrict rows, int64_t n,
                            int64_t dim) {
  int64_t d = 0;
#if defined(RAYPAGE_SIMD)
  for (; d + kLanes <= dim; d += kLanes) {
    Vec sum = load_floats(acc + d);
    for (int64_t t = 0; t < n; ++t) sum = fmadd(set1(p[t]), load_floats(rows + t * dim + d), sum);
    store_floats(acc + d, sum);
  }
#endif
  for (; d < dim; ++d) {
    for (int64_t t = 0; t < n; ++t) acc[d] += p[t] * static_cast<float>(rows[t * dim + d]);
  }
}

// p[0:n] = cap * tanh(p / cap)
inline void soft_cap_scores(float* p, int64_t n, float cap) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= n; i += kLanes) store_floats(p + i, soft_cap_lanes(load_floats(p + i), cap));
#endif
  for (; i < n; ++i) p[i] = cap * std::tanh(p[i] / cap);
}

// p[0:n] = e^(p - peak); returns their sum.
inline float exp_shifted(float* p, int64_t n, float peak) {
  float total = 0.f;
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  const Vec shift = set1(peak);
  Vec sums = set1(0.f);
  for (; i + kLanes <= n; i += kLanes) {
    const Vec e = exp_lanes(sub(load_floats(p + i), shift));
    store_floats(p + i, e);
    sums = add(sums, e);
  }
  total = reduce_add(sums);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - peak);
    total += p[i];
  }
  return total;
}

}  // namespace raypage::attention_rows
