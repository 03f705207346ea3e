// A decoder layer's norms and rotary embedding, each fused into one pass over the rows.
//
// torch.ops.raypage.rms_norm(out, input, weight, eps)
// torch.ops.raypage.fused_add_rms_norm(input, residual, weight, eps)   both in place:
//     residual += input; input = rms_norm(residual)
// torch.ops.raypage.rotary_embedding(positions, query, key, cos, sin)   query, key rotated in place
//
// In plain torch each of these is five to ten operators, every one a dispatch and a pass over
// memory; at decode batch sizes those costs outweigh the arithmetic. (SiLU-and-multiply stays in
// torch: its two operators use a vectorized exp, which a scalar loop here loses to.) Rows are [tokens, hidden] with
// any row stride (query and key are views into the fused QKV projection's output).
//
// Numerics follow the torch code in kernels/fused_ops.py operator by operator: every step that
// torch rounds to the model dtype is rounded here too (c10::BFloat16 and c10::Half arithmetic
// rounds each result), the norm's mean of squares is taken in float32, so bf16 outputs match the
// torch path's; float32 differs from it only by the order of the float32 sum.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Rounds a float32 to the nearest value of T and back, ties to even, as storing a torch result in T
// does. Written with integer operations for bf16 so that -O3 vectorizes the loops around it.
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

// Rows per parallel task: small batches stay on one thread, where waking a second costs more
// than it saves.
constexpr int64_t kRowsPerTask = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [tokens, hidden] with contiguous rows");
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = round_to<T>(to_float(x[i]) * inv);
    out[i] = from_rounded<T>(round_to<T>(to_float(weight[i]) * normed));
  }
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(input, "input");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == input.size(1), "weight must be [hidden]");
  const int64_t rows = input.size(0), n = input.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rms_norm_row(out.data_ptr<scalar_t>() + r * out.stride(0),
                     input.data_ptr<scalar_t>() + r * input.stride(0), w, n, static_cast<float>(eps));
      }
    });
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(input, "input");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == input.size(1), "weight must be [hidden]");
  const int64_t rows = input.size(0), n = input.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* x = input.data_ptr<scalar_t>() + r * input.stride(0);
        scalar_t* res = residual.data_ptr<scalar_t>() + r * residual.stride(0);
        for (int64_t i = 0; i < n; ++i) {
          res[i] = from_rounded<scalar_t>(round_to<scalar_t>(to_float(x[i]) + to_float(res[i])));
        }
        rms_norm_row(x, res, w, n, static_cast<float>(eps));
      }
    });
  });
}

// "Rotate half": the first and second halves of each head are the two coordinates of each pair.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
      const float a = to_float(x1[i]), b = to_float(x2[i]);
      x1[i] = from_rounded<T>(round_to<T>(round_to<T>(a * c) - round_to<T>(b * s)));
      x2[i] = from_rounded<T>(round_to<T>(round_to<T>(b * c) + round_to<T>(a * s)));
    }
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query and key must be [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query and key heads must be contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous float32 tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  const int64_t tokens = query.size(0), half = query.size(2) / 2;
  TORCH_CHECK(cos.size(1) == half, "cos and sin must have head_dim / 2 columns");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the rotary table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos.data_ptr<float>() + pos[t] * half;
        const float* s = sin.data_ptr<float>() + pos[t] * half;
        rotate_heads(query.data_ptr<scalar_t>() + t * query.stride(0), query.size(1), query.stride(1), half, c, s);
        rotate_heads(key.data_ptr<scalar_t>() + t * key.stride(0), key.size(1), key.stride(1), half, c, s);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
}
