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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

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

void check_rows(const at::Tensor& t, const at::Tensor& kv_cache, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(1) == kv_cache.size(1) && t.size(2) == kv_cache.size(4),
              "reshape_and_cache: ", name, " must be a CPU tensor [tokens, ", kv_cache.size(1), ", ",
              kv_cache.size(4), "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1, "reshape_and_cache: ", name, " must be contiguous along head_dim");
  TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type(), "reshape_and_cache: ", name, " is ", t.scalar_type(),
              ", the cache ", kv_cache.scalar_type());
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "reshape_and_cache: kv_cache must be a contiguous CPU [2, kv_heads, blocks, block_size, head_dim]");
  check_rows(key, kv_cache, "key");
  check_rows(value, kv_cache, "value");
  const int64_t tokens = key.size(0), heads = kv_cache.size(1), head_dim = kv_cache.size(4);
  TORCH_CHECK(value.size(0) == tokens && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong,
              "reshape_and_cache: slot_mapping must be int64 [tokens], one slot per key and value row");
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "reshape_and_cache: slot ", slot, " of token ", t,
                " is outside the cache's ", num_slots, " slots");
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }
