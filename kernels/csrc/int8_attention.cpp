// Attention over an int8 KV cache (kv_cache_dtype="int8") on the CPU: every row of a batch, decodes
// and prefill chunks alike, in one call.
//
// torch.ops.raypage.int8_paged_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc,
//                                         scale, window=0, soft_cap=0.0):
//   out, query       [tokens, num_heads, head_dim] float32, bf16 or float16, contiguous along head_dim
//   kv_cache         int8 [2, num_kv_heads, num_blocks, block_size, head_dim + 4], contiguous: rows of
//                    head_dim values and their float32 scale (the format of int8_kv.h)
//   block_table      [num_seqs, >= blocks needed] int64, any strides
//   seq_lens         [num_seqs] int64: each sequence's cached context plus its query rows
//   query_start_loc  [num_seqs + 1] int32: sequence s's query rows are rows query_start_loc[s] to
//                    query_start_loc[s + 1] of query (one for a decode), at the last positions of its
//                    seq_lens[s] tokens, each causal to its own position
//   window           a sliding window (0: none): a row at position p sees keys p - window + 1 .. p, and
//                    blocks wholly before that are never read (the KV cache manager may have freed them)
//   soft_cap         0, or the soft cap of the scaled scores: cap * tanh(score / cap) (Gemma 2)
//
// One work item is a sequence, one of its KV heads and a run of its query rows: the run's rows and
// the query heads that share the KV head are attended together, so each key and value row is read
// from memory and dequantized once per item, whatever the GQA group. The keys come a block at a time
// from where they lie, dequantized to float32 (int8 widened, times the row's scale: kLanes at a time
// on AVX-512 or AVX2, one at a time elsewhere), scored against every row that sees them and folded
// into each row's running softmax (its peak and sum so far, the output rescaled when the peak grows),
// so no row holds anything the length of its sequence. Scores, the softmax and the output accumulate
// in float32; the output is rounded to the query's dtype once.
//
// Items are sorted by the keys they read, most first, and handed out from an atomic counter: a long
// prefill chunk's items start before the decodes' short ones, which then fill in the threads' ends.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "int8_kv.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

using namespace raypage::attention_rows;  // dot, accumulate_rows, soft caps, exponentials
namespace int8_kv = raypage::int8_kv;

// Query vectors (rows x the group's heads) of one item: enough to read a prefill chunk's keys once
// per 32 vectors, few enough that their float32 outputs and one block's scores stay in L1 and L2.
constexpr int64_t kVectorsPerItem = 32;
// Blocks prefetched ahead of the one being attended: a block's rows are a kilobyte or two, read in
// less time than a miss to memory takes, so a few must be in flight at once.
constexpr int64_t kBlocksAhead = 2;

struct Item {
  int64_t s, h;      // sequence, KV head
  int64_t row;       // the run's first row of query and out
  int64_t rows;      // how many
  int64_t position;  // the first row's position in its sequence
  int64_t keys;      // keys read, for ordering the items
};

// The call's tensors as base pointers and strides.
template <typename T>
struct Batch {
  int64_t head_dim, row_bytes, block_size, group, num_blocks, block_bytes, head_bytes;
  int64_t q_row_stride, q_head_stride, o_row_stride, o_head_stride, bt_seq_stride, bt_block_stride;
  int64_t window;
  float scale, soft_cap;
  const T* q_data;
  T* o_data;
  const int8_t *k_data, *v_data;
  const int64_t* bt_data;

  Batch(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
        double scale, int64_t window, double soft_cap)
      : head_dim(query.size(2)),
        row_bytes(kv_cache.size(4)),
        block_size(kv_cache.size(3)),
        group(query.size(1) / kv_cache.size(1)),
        num_blocks(kv_cache.size(2)),
        block_bytes(block_size * row_bytes),
        head_bytes(num_blocks * block_bytes),  // one KV head's keys (or values), all blocks
        q_row_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        o_row_stride(out.stride(0)),
        o_head_stride(out.stride(1)),
        bt_seq_stride(block_table.stride(0)),
        bt_block_stride(block_table.stride(1)),
        window(window),
        scale(static_cast<float>(scale)),
        soft_cap(static_cast<float>(soft_cap)),
        q_data(query.const_data_ptr<T>()),
        o_data(out.mutable_data_ptr<T>()),
        k_data(kv_cache.const_data_ptr<int8_t>()),
        v_data(k_data + kv_cache.size(1) * head_bytes),
        bt_data(block_table.const_data_ptr<int64_t>()) {}

  // The first row of block b of sequence s (keys or values of KV head h: `cache` is k_data or
  // v_data), its id checked against the cache's size.
  const int8_t* block(const int8_t* cache, int64_t s, int64_t h, int64_t b) const {
    const int64_t id = bt_data[s * bt_seq_stride + b * bt_block_stride];
    TORCH_CHECK(id >= 0 && id < num_blocks, "int8_paged_attention: block id ", id, " out of range [0, ", num_blocks,
                ")");
    return cache + h * head_bytes + id * block_bytes;
  }
  // The first key position a row at `position` sees.
  int64_t first_visible(int64_t position) const {
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }
};

// Per-thread scratch, kept across calls: a layer's call would otherwise allocate it again each time.
float* scratch(int64_t n) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

void prefetch(const int8_t* data, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(data + offset, 0, 3);
}

// dst[t * head_dim + d] = row t's value d times row t's scale, for n rows of the cache from `rows`.
void dequantize_rows(float* __restrict dst, const int8_t* __restrict rows, int64_t n, int64_t head_dim,
                     int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t, rows += row_bytes, dst += head_dim) {
    const float scale = int8_kv::scale_of(rows, head_dim);
    int64_t d = 0;
#if defined(RAYPAGE_SIMD)
    for (; d + kLanes <= head_dim; d += kLanes) store_floats(dst + d, mul(load_floats(rows + d), set1(scale)));
#endif
    for (; d < head_dim; ++d) dst[d] = static_cast<float>(rows[d]) * scale;
  }
}

// x[0:n] *= factor
void scale_in_place(float* x, int64_t n, float factor) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= n; i += kLanes) store_floats(x + i, mul(load_floats(x + i), set1(factor)));
#endif
  for (; i < n; ++i) x[i] *= factor;
}

template <typename T>
void attend_item(const Batch<T>& B, const Item& item) {
  const int64_t head_dim = B.head_dim, group = B.group, block_size = B.block_size, row_bytes = B.row_bytes;
  const int64_t vectors = item.rows * group;  // vector v: row v / group, head h * group + v % group
  float* q = scratch(2 * vectors * head_dim + 2 * block_size * head_dim + vectors * block_size + 2 * vectors);
  float* acc = q + vectors * head_dim;
  float* keys = acc + vectors * head_dim;  // one block's rows, dequantized
  float* values = keys + block_size * head_dim;
  float* probs = values + block_size * head_dim;  // each vector's scores, then probabilities, in the block
  float* peak = probs + vectors * block_size;     // each vector's running softmax: its largest score...
  float* total = peak + vectors;                  // ...and its sum of e^(score - peak)
  for (int64_t v = 0; v < vectors; ++v) {
    const T* row = B.q_data + (item.row + v / group) * B.q_row_stride + (item.h * group + v % group) * B.q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) q[v * head_dim + d] = static_cast<float>(row[d]) * B.scale;
  }
  std::fill(acc, acc + vectors * head_dim, 0.f);
  std::fill(peak, peak + vectors, -std::numeric_limits<float>::infinity());
  std::fill(total, total + vectors, 0.f);
  const int64_t first = B.first_visible(item.position), last = item.position + item.rows - 1;
  const int64_t first_block = first / block_size, last_block = last / block_size;
  const auto prefetch_block = [&](int64_t b) {
    if (b > last_block) return;
    prefetch(B.block(B.k_data, item.s, item.h, b), B.block_bytes);
    prefetch(B.block(B.v_data, item.s, item.h, b), B.block_bytes);
  };
  for (int64_t b = first_block; b < first_block + kBlocksAhead; ++b) prefetch_block(b);
  for (int64_t b = first_block; b <= last_block; ++b) {
    prefetch_block(b + kBlocksAhead);
    const int64_t t0 = b * block_size, lo = std::max(t0, first), hi = std::min(t0 + block_size, last + 1);
    // The keys [a, e) of this block that row i sees: causal to its position, inside the window.
    const auto seen = [&](int64_t i) {
      const int64_t position = item.position + i;
      return std::pair<int64_t, int64_t>{std::max(lo, B.first_visible(position)), std::min(hi, position + 1)};
    };
    dequantize_rows(keys, B.block(B.k_data, item.s, item.h, b) + (lo - t0) * row_bytes, hi - lo, head_dim, row_bytes);
    for (int64_t v = 0; v < vectors; ++v) {
      const auto [a, e] = seen(v / group);
      if (a >= e) continue;
      float* p = probs + v * block_size;
      for (int64_t t = a; t < e; ++t) p[t - a] = dot(q + v * head_dim, keys + (t - lo) * head_dim, head_dim);
      if (B.soft_cap > 0.f) soft_cap_scores(p, e - a, B.soft_cap);
      const float top = std::max(peak[v], *std::max_element(p, p + (e - a)));
      if (top > peak[v] && total[v] > 0.f) {  // the sums so far were of e^(score - an older, lower peak)
        const float correction = std::exp(peak[v] - top);
        total[v] *= correction;
        scale_in_place(acc + v * head_dim, head_dim, correction);
      }
      peak[v] = top;
      total[v] += exp_shifted(p, e - a, top);
    }
    dequantize_rows(values, B.block(B.v_data, item.s, item.h, b) + (lo - t0) * row_bytes, hi - lo, head_dim,
                    row_bytes);
    for (int64_t v = 0; v < vectors; ++v) {
      const auto [a, e] = seen(v / group);
      if (a >= e) continue;
      accumulate_rows(acc + v * head_dim, probs + v * block_size, values + (a - lo) * head_dim, e - a, head_dim);
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {  // every row sees at least its own key: total > 0
    T* o = B.o_data + (item.row + v / group) * B.o_row_stride + (item.h * group + v % group) * B.o_head_stride;
    const float inverse = 1.f / total[v];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[v * head_dim + d] * inverse);
  }
}

// The call's items, checking each sequence's rows and block table on the way.
std::vector<Item> work_items(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t window) {
  const int64_t group = query.size(1) / kv_cache.size(1), block_size = kv_cache.size(3);
  const int64_t rows_per_item = std::max<int64_t>(1, kVectorsPerItem / group);
  const auto lens = seq_lens.accessor<int64_t, 1>();
  const auto starts = query_start_loc.accessor<int32_t, 1>();
  std::vector<Item> items;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t query_len = starts[s + 1] - starts[s], context = lens[s] - query_len;
    TORCH_CHECK(query_len >= 0 && context >= 0 && starts[s] >= 0 && starts[s + 1] <= query.size(0) &&
                    (lens[s] + block_size - 1) / block_size <= block_table.size(1),
                "int8_paged_attention: sequence ", s, " has ", query_len, " query rows over ", lens[s],
                " tokens, which its rows and block table cannot hold");
    for (int64_t j = 0; j < query_len; j += rows_per_item) {
      const int64_t rows = std::min(rows_per_item, query_len - j), position = context + j;
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      for (int64_t h = 0; h < kv_cache.size(1); ++h) {
        items.push_back(Item{s, h, starts[s] + j, rows, position, position + rows - first});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  return items;
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
         const std::vector<Item>& items, double scale, int64_t window, double soft_cap) {
  const Batch<T> batch(out, query, kv_cache, block_table, scale, window, soft_cap);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < num_items; i = next++) attend_item(batch, items[i]);
  });
}

void int8_paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  query.stride(2) == 1 && out.stride(2) == 1,
              "int8_paged_attention: query and out must be [num_tokens, num_heads, head_dim] of one dtype, "
              "contiguous along head_dim");
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous() && kv_cache.size(4) == int8_kv::row_bytes(query.size(2)) &&
                  query.size(1) % kv_cache.size(1) == 0,
              "int8_paged_attention: kv_cache must be a contiguous int8 "
              "[2, kv_heads, blocks, block_size, head_dim + 4] matching the query's head_dim (", query.size(2), ") and dividing its heads, got ", kv_cache.sizes(),
              " of ", kv_cache.scalar_type());
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.scalar_type() == at::kLong && block_table.size(0) == num_seqs &&
                  query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.size(0) == num_seqs + 1,
              "int8_paged_attention: seq_lens int64 [num_seqs], block_table int64 [num_seqs, blocks] and "
              "query_start_loc int32 [num_seqs + 1]");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "int8_paged_attention: window (", window, ") and soft_cap (", soft_cap,
              ") must not be negative");
  const std::vector<Item> items = work_items(query, kv_cache, block_table, seq_lens, query_start_loc, window);
  switch (query.scalar_type()) {
    case at::kFloat: return run<float>(out, query, kv_cache, block_table, items, scale, window, soft_cap);
    case at::kBFloat16: return run<c10::BFloat16>(out, query, kv_cache, block_table, items, scale, window, soft_cap);
    case at::kHalf: return run<c10::Half>(out, query, kv_cache, block_table, items, scale, window, soft_cap);
    default:
      TORCH_CHECK(false, "int8_paged_attention: dtype ", query.scalar_type(),
                  " is not supported (float32, bfloat16, float16)");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def(
      "int8_paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int window=0, float soft_cap=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("int8_paged_attention", &int8_paged_attention); }
