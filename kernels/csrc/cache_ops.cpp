// Writes a step's keys and values into the paged KV cache, both in one call.
//
// torch.ops.raypage.reshape_and_cache(key, value, kv_cache, slot_mapping):
//   key, value    [tokens, kv_heads, head_dim] of the cache's dtype, any strides but a contiguous head
//   kv_cache      [2, kv_heads, num_blocks, block_size, head_dim], contiguous (keys, then values)
//   slot_mapping  [tokens] int64: token t's slot, block_id * block_size + offset
//
// Each (token, head) row is one copy of head_dim elements to its slot; the dtype only sets the row's
// size in bytes. torch's index_copy_ does the same per tensor in two calls, at tens of microseconds
// each for a decode step's few kilobytes. Every slot is checked against the cache's size before
// anything is written, so a bad slot mapping is an error, never a write outside the cache.
//
// torch.ops.raypage.reshape_and_cache_int8(key, value, kv_cache, slot_mapping) writes into an int8
// cache [2, kv_heads, num_blocks, block_size, head_dim + 4] instead (the row format of int8_kv.h):
// key and value rows of float32, bf16 or float16 are quantized on the way, with the same checks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "int8_kv.h"
#include "simd.h"

namespace {

// One row to its slot. The slot's lines were last touched long ago (the cache is hundreds of
// megabytes per layer), so an ordinary store first reads each line from memory, one miss after
// another; streaming stores write whole lines without reading them (a decode step's rows are written
// several times faster; docs/performance.md). Rows that are not whole 16-byte units, or not aligned
// to them, are copied.
inline void copy_row(char* dst, const char* src, int64_t bytes) {
#if defined(__SSE2__)
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (int64_t i = 0; i < bytes; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Tokens per parallel task: one token's rows are a few hundred bytes, so only a prefill chunk's
// thousands of tokens are worth a second thread.
constexpr int64_t kTokensPerTask = 512;

// key or value: [tokens, kv_heads, head_dim] on the CPU, contiguous along head_dim.
void check_rows(const char* op, const at::Tensor& t, const at::Tensor& kv_cache, int64_t head_dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(1) == kv_cache.size(1) && t.size(2) == head_dim, op,
              ": ", name, " must be a CPU tensor [tokens, ", kv_cache.size(1), ", ", head_dim, "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1, op, ": ", name, " must be contiguous along head_dim");
}

// Everything a write reads checked before anything is written: the cache's layout, the rows' shapes
// (head_dim values each) and every slot against the cache's size.
void check_write(const char* op, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, int64_t head_dim) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              op, ": kv_cache must be a contiguous CPU [2, kv_heads, blocks, block_size, row]");
  check_rows(op, key, kv_cache, head_dim, "key");
  check_rows(op, value, kv_cache, head_dim, "value");
  const int64_t tokens = key.size(0);
  TORCH_CHECK(value.size(0) == tokens && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong,
              op, ": slot_mapping must be int64 [tokens], one slot per key and value row");
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t * slot_mapping.stride(0)];
    TORCH_CHECK(slot >= 0 && slot < num_slots, op, ": slot ", slot, " of token ", t, " is outside the cache's ",
                num_slots, " slots");
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  check_write("reshape_and_cache", key, value, kv_cache, slot_mapping, kv_cache.size(4));
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->scalar_type() == kv_cache.scalar_type(), "reshape_and_cache: key and value must be of the "
                "cache's dtype ", kv_cache.scalar_type(), ", got ", rows->scalar_type());
  }
  const int64_t tokens = key.size(0), heads = kv_cache.size(1), head_dim = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const int64_t elem = kv_cache.element_size(), row_bytes = head_dim * elem;
  char* cache = static_cast<char*>(kv_cache.mutable_data_ptr());
  const char* sources[2] = {static_cast<const char*>(key.const_data_ptr()),
                            static_cast<const char*>(value.const_data_ptr())};
  const int64_t token_strides[2] = {key.stride(0) * elem, value.stride(0) * elem};
  const int64_t head_strides[2] = {key.stride(1) * elem, value.stride(1) * elem};
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      for (int64_t kv = 0; kv < 2; ++kv) {
        for (int64_t h = 0; h < heads; ++h) {
          char* dst = cache + ((kv * heads + h) * num_slots + slot) * row_bytes;
          copy_row(dst, sources[kv] + t * token_strides[kv] + h * head_strides[kv], row_bytes);
        }
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streaming stores are weakly ordered: done before the attention reads them
#endif
  });
}

using namespace raypage::simd;  // the per-ISA vector layer (simd.h)

// x[0:head_dim] quantized into `row` (int8_kv.h's format). The division is exact-rounded, as torch's,
// so a row's values are what round(x / scale) gives in float32. |x| / scale never rounds past 127:
// scale is within half an ulp of max |x| / 127, so max |x| / scale is 127 within a few ulps.
template <typename T>
void quantize_row(int8_t* row, const T* x, int64_t head_dim) {
  float peak = 0.f;
  int64_t d = 0;
#if defined(RAYPAGE_SIMD)
  Vec peaks = set1(0.f);
  for (; d + kLanes <= head_dim; d += kLanes) {
    const Vec v = load_floats(x + d);
    peaks = max(peaks, max(v, sub(set1(0.f), v)));
  }
  peak = reduce_max(peaks);
#endif
  for (; d < head_dim; ++d) peak = std::max(peak, std::abs(static_cast<float>(x[d])));
  const float scale = peak / 127.f;
  std::memcpy(row + head_dim, &scale, sizeof(scale));
  if (scale == 0.f) {  // a row of zeros: x / 0 would be NaN
    std::memset(row, 0, head_dim);
    return;
  }
  d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= head_dim; d += 16) {
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load_floats(x + d), _mm512_set1_ps(scale)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
#endif
  // std::nearbyint rounds in the default mode, to nearest with ties to even.
  for (; d < head_dim; ++d) row[d] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[d]) / scale));
}

template <typename T>
void quantize_into(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = kv_cache.size(1), head_dim = key.size(2);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3), row_bytes = kv_cache.size(4);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  int8_t* cache = kv_cache.mutable_data_ptr<int8_t>();
  const at::Tensor* sources[2] = {&key, &value};
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_mapping.stride(0)];
      for (int64_t kv = 0; kv < 2; ++kv) {
        const at::Tensor& rows = *sources[kv];
        for (int64_t h = 0; h < heads; ++h) {
          quantize_row(cache + ((kv * heads + h) * num_slots + slot) * row_bytes,
                       rows.const_data_ptr<T>() + t * rows.stride(0) + h * rows.stride(1), head_dim);
        }
      }
    }
  });
}

void reshape_and_cache_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5 &&
                  kv_cache.size(4) > raypage::int8_kv::kScaleBytes,
              "reshape_and_cache_int8: kv_cache must be int8 [2, kv_heads, blocks, block_size, head_dim + 4]");
  check_write("reshape_and_cache_int8", key, value, kv_cache, slot_mapping,
              kv_cache.size(4) - raypage::int8_kv::kScaleBytes);
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "reshape_and_cache_int8: key is ", key.scalar_type(),
              ", value ", value.scalar_type());
  switch (key.scalar_type()) {
    case at::kFloat: return quantize_into<float>(key, value, kv_cache, slot_mapping);
    case at::kBFloat16: return quantize_into<c10::BFloat16>(key, value, kv_cache, slot_mapping);
    case at::kHalf: return quantize_into<c10::Half>(key, value, kv_cache, slot_mapping);
    default:
      TORCH_CHECK(false, "reshape_and_cache_int8: key and value of ", key.scalar_type(),
                  " are not supported (float32, bfloat16, float16)");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("reshape_and_cache_int8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("reshape_and_cache_int8", &reshape_and_cache_int8);
}
