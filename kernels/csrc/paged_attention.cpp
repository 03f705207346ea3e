// Decode attention over the paged KV cache on the CPU, reading each sequence's blocks in place.
//
// torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale):
//   out, query   [num_seqs, num_heads, head_dim], one query token per sequence
//   kv_cache     [2, num_kv_heads, num_blocks, block_size, head_dim], contiguous (keys, then values)
//   block_table  [num_seqs, >= blocks needed] int64, any strides (a slice of the batch's table)
//   seq_lens     [num_seqs] int64, tokens each sequence attends to (its cached context and itself)
//
// One work item is a (sequence, KV head) pair: the query heads that share the KV head are attended
// together, so each key and value row is read from memory once for the whole group. Items are
// handed out dynamically from an atomic counter because decode rows come sorted longest first: a
// static split would give one thread all the long sequences.
//
// Numerics follow the torch decode path (kernels/attention/sdpa.py) so that bf16 greedy outputs do
// not drift between backends: dot products accumulate in float32 and are rounded to the cache dtype
// (a bf16 matmul's output), the softmax runs in float32, its probabilities are rounded to the cache
// dtype before the PV product, which accumulates in float32 and is rounded once at the end. For a
// float32 cache every rounding is the identity.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats; the loops below are written so -O3 vectorizes them

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// dst[0:n] = float(src[0:n]); for bf16 a 16-bit shift per element, which the compiler vectorizes.
template <typename T>
inline void widen(float* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Sum of a[i] * b[i] in kLanes independent partial sums, so the loop vectorizes without -ffast-math.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) partial[l] += a[i + l] * b[i + l];
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens, float scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), group = num_heads / num_kv_heads;
  const int64_t table_width = block_table.size(1);
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_seq_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t bt_seq_stride = block_table.stride(0), bt_block_stride = block_table.stride(1);
  const int64_t lens_stride = seq_lens.stride(0);
  const int64_t block_elems = block_size * head_dim;
  const int64_t head_elems = num_blocks * block_elems;  // one KV head's keys (or values), all blocks

  const T* q_data = query.const_data_ptr<T>();
  const T* k_data = kv_cache.const_data_ptr<T>();
  const T* v_data = k_data + num_kv_heads * head_elems;
  const int64_t* bt_data = block_table.const_data_ptr<int64_t>();
  const int64_t* lens_data = seq_lens.const_data_ptr<int64_t>();
  T* o_data = out.mutable_data_ptr<T>();

  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens_data[s * lens_stride];
    TORCH_CHECK(len >= 1, "paged_decode_attention: seq_lens[", s, "] is ", len, ", must be at least 1");
    TORCH_CHECK((len + block_size - 1) / block_size <= table_width, "paged_decode_attention: seq_lens[",
                s, "] = ", len, " needs more blocks than block_table's ", table_width, " columns");
    max_len = std::max(max_len, len);
  }

  const int64_t num_items = num_seqs * num_kv_heads;
  std::atomic<int64_t> next_item{0};
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(group * head_dim), row(head_dim), acc(group * head_dim), scores(group * max_len);
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens_data[s * lens_stride];
      for (int64_t g = 0; g < group; ++g) {
        widen(&q[g * head_dim], q_data + s * q_seq_stride + (h * group + g) * q_head_stride, head_dim);
      }
      // Pass 1: every query head's score against every key, block by block where the keys lie.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = bt_data[s * bt_seq_stride + (t0 / block_size) * bt_block_stride];
        TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block,
                    " out of range [0, ", num_blocks, ")");
        const T* keys = k_data + h * head_elems + block * block_elems;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t) {
          widen(row.data(), keys + (t - t0) * head_dim, head_dim);
          for (int64_t g = 0; g < group; ++g) {
            scores[g * max_len + t] = round_to<T>(dot(&q[g * head_dim], row.data(), head_dim)) * scale;
          }
        }
      }
      // Softmax in float32 per query head; probabilities rounded to the cache dtype.
      for (int64_t g = 0; g < group; ++g) {
        float* p = &scores[g * max_len];
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, p[t]);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          p[t] = std::exp(p[t] - peak);
          total += p[t];
        }
        for (int64_t t = 0; t < len; ++t) p[t] = round_to<T>(p[t] / total);
      }
      // Pass 2: the probability-weighted sum of the values, read block by block in place.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = bt_data[s * bt_seq_stride + (t0 / block_size) * bt_block_stride];
        const T* values = v_data + h * head_elems + block * block_elems;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t) {
          widen(row.data(), values + (t - t0) * head_dim, head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * max_len + t];
            float* __restrict a = &acc[g * head_dim];
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = o_data + s * o_seq_stride + (h * group + g) * o_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_decode_attention: query and out must both be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be a contiguous [2, kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "paged_decode_attention: query, out and kv_cache must share a dtype, got ", query.scalar_type(),
              ", ", out.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "paged_decode_attention: query and out must be contiguous along head_dim");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "paged_decode_attention: head_dim ", query.size(2),
              " of query differs from the cache's ", kv_cache.size(4));
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "paged_decode_attention: ", query.size(1),
              " query heads are not a multiple of the cache's ", kv_cache.size(1), " KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kLong &&
                  block_table.size(0) == query.size(0),
              "paged_decode_attention: block_table must be int64 [num_seqs, blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && seq_lens.size(0) == query.size(0),
              "paged_decode_attention: seq_lens must be int64 [num_seqs]");
  if (query.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention",
                                  [&] { decode_kernel<scalar_t>(out, query, kv_cache, block_table, seq_lens, static_cast<float>(scale)); });
}

}  // namespace

TORCH_LIBRARY(raypage, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
