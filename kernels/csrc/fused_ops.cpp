// A decoder layer's elementwise ops, and the sampler's greedy argmax, each one pass over the rows.
//
// torch.ops.raypage.rms_norm(input, weight, eps) -> the normed rows
// torch.ops.raypage.fused_add_rms_norm(input, residual, weight, eps)   both in place:
//     residual += input; input = rms_norm(residual)
// torch.ops.raypage.rotary_embedding(positions, query, key, cos, sin)   query, key rotated in place
// torch.ops.raypage.silu_and_mul(input) -> silu(input[..., :d]) * input[..., d:]
// torch.ops.raypage.argmax_rows(logits) -> int64 [rows]   the first index of each row's maximum
//
// In plain torch each of these is two to ten operators, every one a dispatch and a pass over
// memory; at decode batch sizes those costs outweigh the arithmetic. Rows are the last dimension,
// contiguous; 2-D tensors may have any row stride (query and key are views into the fused QKV
// projection's output). The arithmetic
// runs on simd.h's vectors, kLanes floats at a time, and finishes each row's tail one at a time.
//
// Numerics follow the torch code in kernels/fused_ops.py operator by operator: every step that
// torch rounds to the model dtype is rounded here too (c10::BFloat16 and c10::Half arithmetic
// rounds each result), the norm's mean of squares is taken in float32, so bf16 outputs match the
// torch path's but for the order of the norm's float32 sum (four vector accumulators here), and for
// SiLU, by the exponential's last-place error (exp_lanes, about 2 ulp, against torch's 1).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace raypage::simd;

// One element at a time, for each row's tail (whole rows without SIMD): rounds a float32 to the
// nearest value of T and back, ties to even, as storing a torch result in T does, with integer
// operations for bf16 so that -O3 can vectorize the loops around it.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
}
template <>
inline float round_to<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  bits = std::isnan(x) ? bits : rounded;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A float32 that already holds a value of T, stored as T (exact, no rounding left to do).
template <typename T>
inline T from_rounded(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_rounded<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// The model dtypes the ops take (the Python wrappers send any other to torch): the vector layer
// widens each of them to float32.
#define RAYPAGE_DISPATCH(TYPE, NAME, ...)                                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Rows per parallel task: small batches stay on one thread, where waking a second costs more
// than it saves.
constexpr int64_t kRowsPerTask = 16;

// t as [rows, last dim]: itself when 2-D (any row stride), else reshaped (a view where the leading
// dimensions allow one, a copy otherwise).
at::Tensor as_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have contiguous rows (its last dimension)");
  return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
}

// The sum of x[i]², in four vector accumulators: one would wait on each add's latency.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  Vec acc[4] = {set1(0.f), set1(0.f), set1(0.f), set1(0.f)};
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) {
      const Vec v = load_floats(x + i + a * kLanes);
      acc[a] = fmadd(v, v, acc[a]);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load_floats(x + i);
    acc[0] = fmadd(v, v, acc[0]);
  }
  sum = reduce_add(add(add(acc[0], acc[1]), add(acc[2], acc[3])));
#endif
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

// out = round(weight * round(x * inv)), torch's two roundings.
template <typename T>
void scale_row(T* out, const T* x, const T* weight, int64_t n, float inv) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  const Vec scale = set1(inv);
  for (; i + kLanes <= n; i += kLanes) {
    const Vec normed = round_lanes<T>(mul(load_floats(x + i), scale));
    store_rounded(out + i, round_lanes<T>(mul(load_floats(weight + i), normed)));
  }
#endif
  for (; i < n; ++i) {
    const float normed = round_to<T>(to_float(x[i]) * inv);
    out[i] = from_rounded<T>(round_to<T>(to_float(weight[i]) * normed));
  }
}

inline float inverse_rms(float sum_of_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_of_squares / static_cast<float>(n) + eps);
}

// res = round(x + res), in place.
template <typename T>
void add_into(T* res, const T* x, int64_t n) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= n; i += kLanes) {
    store_rounded(res + i, round_lanes<T>(add(load_floats(x + i), load_floats(res + i))));
  }
#endif
  for (; i < n; ++i) res[i] = from_rounded<T>(round_to<T>(to_float(x[i]) + to_float(res[i])));
}

void check_weight(const at::Tensor& weight, const at::Tensor& rows) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == rows.size(1) && weight.scalar_type() == rows.scalar_type(),
              "weight must be [hidden] of the input's dtype");
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const at::Tensor x = as_rows(input, "input");
  check_weight(weight, x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  RAYPAGE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = x.const_data_ptr<scalar_t>() + r * x.stride(0);
        scale_row(out.mutable_data_ptr<scalar_t>() + r * n, row, w, n,
                  inverse_rms(sum_squares(row, n), n, static_cast<float>(eps)));
      }
    });
  });
  return out.view(input.sizes());
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const at::Tensor x = as_rows(input, "input"), res = as_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == res.sizes() && x.scalar_type() == res.scalar_type(),
              "input and residual must match in shape and dtype");
  TORCH_CHECK(x.data_ptr() == input.data_ptr() && res.data_ptr() == residual.data_ptr(),
              "input and residual are written in place: their rows must be viewable as [rows, hidden]");
  check_weight(weight, x);
  const int64_t rows = x.size(0), n = x.size(1);
  RAYPAGE_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* x_row = x.mutable_data_ptr<scalar_t>() + r * x.stride(0);
        scalar_t* res_row = res.mutable_data_ptr<scalar_t>() + r * res.stride(0);
        add_into(res_row, x_row, n);  // the row stays in L1 for the two passes that follow
        scale_row(x_row, res_row, w, n, inverse_rms(sum_squares(res_row, n), n, static_cast<float>(eps)));
      }
    });
  });
}

// "Rotate half": the first and second halves of each head are the two coordinates of each pair.
// Each slice of the angles' cos and sin, rounded to T as torch's `cos.to(x.dtype)` does, serves
// every head of the token.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos, const float* sin) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= half; i += kLanes) {
    const Vec c = round_lanes<T>(load_floats(cos + i)), s = round_lanes<T>(load_floats(sin + i));
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + h * head_stride + i;
      T* x2 = x1 + half;
      const Vec a = load_floats(x1), b = load_floats(x2);
      store_rounded(x1, round_lanes<T>(sub(round_lanes<T>(mul(a, c)), round_lanes<T>(mul(b, s)))));
      store_rounded(x2, round_lanes<T>(add(round_lanes<T>(mul(b, c)), round_lanes<T>(mul(a, s)))));
    }
  }
#endif
  for (; i < half; ++i) {
    const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + h * head_stride + i;
      T* x2 = x1 + half;
      const float a = to_float(*x1), b = to_float(*x2);
      *x1 = from_rounded<T>(round_to<T>(round_to<T>(a * c) - round_to<T>(b * s)));
      *x2 = from_rounded<T>(round_to<T>(round_to<T>(b * c) + round_to<T>(a * s)));
    }
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query and key must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query and key heads must be contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos and sin must be contiguous float32 tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  const int64_t tokens = query.size(0), half = query.size(2) / 2;
  TORCH_CHECK(positions.numel() == tokens && key.size(0) == tokens, "one position per token of query and key");
  TORCH_CHECK(cos.size(1) == half && key.size(2) == query.size(2), "cos and sin must have head_dim / 2 columns");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_position = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the rotary table");
  }
  RAYPAGE_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos.const_data_ptr<float>() + pos[t] * half;
        const float* s = sin.const_data_ptr<float>() + pos[t] * half;
        rotate_heads(query.mutable_data_ptr<scalar_t>() + t * query.stride(0), query.size(1), query.stride(1),
                     half, c, s);
        rotate_heads(key.mutable_data_ptr<scalar_t>() + t * key.stride(0), key.size(1), key.stride(1), half, c, s);
      }
    });
  });
}


// out = round(round(silu(gate)) * up), F.silu's then the product's rounding.
template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t n) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= n; i += kLanes) {
    const Vec activated = round_lanes<T>(silu_lanes(load_floats(gate + i)));
    store_rounded(out + i, round_lanes<T>(mul(activated, load_floats(up + i))));
  }
#endif
  for (; i < n; ++i) {
    const float g = to_float(gate[i]);
    out[i] = from_rounded<T>(round_to<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[i])));
  }
}

at::Tensor silu_and_mul(const at::Tensor& input) {
  const at::Tensor x = as_rows(input, "input");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the input's last dimension must be [gate | up], of even size");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  RAYPAGE_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = x.const_data_ptr<scalar_t>() + r * x.stride(0);
        silu_and_mul_row(out.mutable_data_ptr<scalar_t>() + r * n, gate, gate + n, n);
      }
    });
  });
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

// The first index of the row's maximum, NaN counting as larger than anything (the first NaN wins),
// as torch's max(dim).indices and argmax answer. Two passes: the maximum ignoring NaNs (maxps
// returns its second operand, the running maximum, when the first is NaN) while noting whether a
// NaN was seen; then the first element equal to it (equal compares -0 and +0 alike, as torch does),
// from a row that the first pass left in the core's caches.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  Vec acc[4] = {set1(peak), set1(peak), set1(peak), set1(peak)};
  uint32_t nans = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) {
      const Vec v = load_floats(x + i + a * kLanes);
      acc[a] = max(v, acc[a]);
      nans |= mask_bits(is_nan(v));
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load_floats(x + i);
    acc[0] = max(v, acc[0]);
    nans |= mask_bits(is_nan(v));
  }
  peak = reduce_max(max(max(acc[0], acc[1]), max(acc[2], acc[3])));
  has_nan = nans != 0;
#endif
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    has_nan |= std::isnan(v);
    peak = v > peak ? v : peak;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(to_float(x[j]))) return j;
    }
  }
  i = 0;
#if defined(RAYPAGE_SIMD)
  const Vec target = set1(peak);
  for (; i + kLanes <= n; i += kLanes) {
    if (const uint32_t hits = mask_bits(equal(load_floats(x + i), target))) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < n; ++i) {
    if (to_float(x[i]) == peak) return i;
  }
  return 0;  // not reached: the peak is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_rows: logits must be [rows, vocab]");
  as_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: rows must not be empty");
  at::Tensor indices = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = indices.mutable_data_ptr<int64_t>();
  RAYPAGE_DISPATCH(logits.scalar_type(), "argmax_rows", [&] {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {  // a row is tens of microseconds
      for (int64_t r = begin; r < end; ++r) {
        out[r] = argmax_row(logits.const_data_ptr<scalar_t>() + r * logits.stride(0), n);
      }
    });
  });
  return indices;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
