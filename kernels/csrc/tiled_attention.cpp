// Prefill attention over a bf16 paged KV cache on AVX-512 BF16: 16 query tokens at a time.
//
// torch.ops.raypage.tiled_prefill_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, scale,
//                                           window=0, soft_cap=0):
//   out, query       [num_tokens, num_heads, head_dim] bf16; sequence i's rows are
//                    query_start_loc[i]:query_start_loc[i+1] (int32, num_seqs + 1 offsets)
//   kv_cache         [2, num_kv_heads, num_blocks, block_size, head_dim] bf16, contiguous, holding
//                    every token's key and value, the new ones included
//   block_table      [num_seqs, >= blocks needed] int64, any strides
//   seq_lens         [num_seqs] int64: each sequence's cached context and its new tokens
// Token j of a sequence's new ones attends causally to its first seq_len - query_len + j + 1 tokens,
// or with a sliding window (window > 0) to the last `window` of them; with soft_cap > 0 its scaled
// scores become soft_cap * tanh(score / soft_cap) (Gemma 2). An item reads keys and values from the
// 16-token step holding its first token's first visible key: blocks wholly before it (which the KV
// cache manager may have freed) are never read.
// torch.ops.raypage.tiled_attention_serves(head_dim, group, block_size): whether this build has the
// kernel (AVX-512 BF16) for that shape: head_dim 32, 64 or 128, GQA groups of 1-4, 6 or 8, blocks
// of a multiple of 16 tokens.
//
// The decode kernel (paged_attention.cpp) attends one query row at a time, finishing each score
// with a horizontal sum; a prefill chunk's rows then read the same keys once per row. Here a work
// item is a sequence, one KV head and up to 16 of its new tokens: the query heads of the group are
// `group` vectors of 16 lanes, one lane per token, so that every `vdpbf16ps` multiplies one
// broadcast pair of a key's (or a value's) elements against 16 tokens at once and no score needs a
// horizontal sum. Per item:
//   1. scores S^T[key][token] for each query head, 8 keys x `group` heads of accumulators at a time
//      over the keys' pairs of elements, read from the blocks in place; rounded to bf16, scaled;
//      keys past a token's position masked;
//   2. an exact softmax along each token's keys (the lanes' maxima, e^(s - max) with simd.h's
//      exp_lanes, the sum, probabilities rounded to bf16), stored as pairs of keys per token;
//   3. O^T[element][token] = P V: the values interleaved two keys at a time, a broadcast pair of them
//      against each head's pairs of probabilities, 8 elements x `group` heads of accumulators;
//      rounded once to bf16 and written to each token's row.
// Items are handed out dynamically, longest first.
//
// Numerics are paged_attention.cpp's: products of bf16 pairs summed in float32 (only the order of
// the sums differs), scores rounded to bf16 and scaled in float32, the softmax in float32,
// probabilities rounded to bf16 (to nearest even), P V summed in float32 and rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_layout.h"
#include "simd.h"

namespace {

constexpr int64_t kTokens = 16;  // query tokens per item: one per float32 lane

#if defined(__AVX512BF16__)
using namespace raypage::simd;
using bf16 = c10::BFloat16;

// How far ahead of the scores the keys and values are prefetched, in blocks.
constexpr int64_t kBlocksAhead = 2;

// One item: tokens [row, row + tokens) of sequence s (rows of query/out), which see keys up to
// first_position + their index; kv_len = the last one's position + 1; the item reads keys from
// kv_start (0, or a multiple of kTokens at or before its first token's first visible key).
struct Item {
  int64_t s, h, row, tokens, first_position, kv_len, kv_start = 0;
};

// The call's layout (paged_layout.h), with what cascade attention's prefix pass merges into.
struct Layout : raypage::PagedLayout<bf16> {
  // Cascade's prefix pass: each row's log-sum-exp over its own keys (merge_lse_stride apart), whose
  // attention `out` already holds, to merge this pass's into.
  const float* merge_lse = nullptr;
  int64_t merge_lse_stride = 0;
  int64_t window = 0;    // 0: every earlier key is visible
  float soft_cap = 0.f;  // 0: scores uncapped

  Layout(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table)
      : PagedLayout("tiled_prefill_attention", out, query, kv_cache, block_table) {}

  // The keys of token t's block into L1, its values into L2 (if the item reads that far): blocks
  // lie anywhere in the cache, so the hardware's prefetcher cannot follow them.
  void prefetch_block(const Item& item, int64_t t) const {
    if (t >= item.kv_len) return;
    const char* keys = reinterpret_cast<const char*>(row(k_data, item.s, item.h, t));
    const char* values = reinterpret_cast<const char*>(row(v_data, item.s, item.h, t));
    for (int64_t offset = 0; offset < block_elems * 2; offset += 64) {
      _mm_prefetch(keys + offset, _MM_HINT_T0);
      _mm_prefetch(values + offset, _MM_HINT_T1);
    }
  }

  // Token t's row of keys (or values) of KV head h of sequence s.
  const bf16* row(const bf16* cache, int64_t s, int64_t h, int64_t t) const {
    return block(cache, s, h, t) + (t % block_size) * head_dim;
  }
};

// Per-thread scratch, kept across calls.
template <typename E>
E* scratch(int64_t n) {
  static thread_local std::vector<E> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// permutex2var indices that interleave two rows of 32 bf16 element by element: elements 0-15 of
// both (row a's, row b's, alternating), then elements 16-31.
alignas(64) constexpr int16_t kLowPairs[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr int16_t kHighPairs[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// r[i] lane j <-> r[j] lane i: 16 vectors of 16 32-bit lanes transposed in registers (pairs, then
// quadruples within 128-bit lanes, then the 128-bit lanes themselves).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

inline __m512bh broadcast_pair(const void* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Lanes (tokens) of an item that see key t: tokens j < tokens with first_position + j >= t and, with a
// window, first_position + j < t + window.
inline __mmask16 sees_key(const Item& item, int64_t t, int64_t window) {
  const int64_t first = std::max<int64_t>(0, t - item.first_position);
  const int64_t last = window > 0 ? std::min(item.tokens, t + window - item.first_position) : item.tokens;
  if (first >= last) return 0;
  return static_cast<__mmask16>(((1u << last) - 1) & ~((1u << first) - 1));
}

// Accumulators are `group` x kKeysStep (pass 1) and `group` x kElemsStep (pass 3) vectors: at most
// 24 of the 32 registers, the rest for the operands. Steps divide 16, so a step of keys stays in one
// block.
constexpr int keys_step(int group) { return group == 1 ? 16 : group <= 3 ? 8 : group <= 6 ? 4 : 2; }
constexpr int elems_step(int group) { return group == 1 ? 16 : group <= 3 ? 8 : group <= 6 ? 4 : 2; }

template <int kChunks, int kGroup, bool kMerge>
void attend_item(const Layout& L, const Item& item, float scale) {
  constexpr int64_t head_dim = 32 * kChunks, pairs = head_dim / 2;
  constexpr int kKeys = keys_step(kGroup), kElems = elems_step(kGroup);
  // Keys kv_start.. of the item, `span` of them, indexed from kv_start (even: pairs share a block).
  const int64_t kv_start = item.kv_start, kv_len = item.kv_len, span = kv_len - kv_start, kv_pairs = (span + 1) / 2;
  // Scratch, in vectors: packed queries, scores (then e^(s - max)), probability pairs, value pairs.
  __m512* base = scratch<__m512>(kGroup * pairs + kGroup * span + kGroup * kv_pairs + kv_pairs * head_dim / 16);
  __m512bh* q = reinterpret_cast<__m512bh*>(base);                        // [group][pairs]
  __m512* scores = base + kGroup * pairs;                                 // [group][span]
  __m512bh* probs = reinterpret_cast<__m512bh*>(scores + kGroup * span);  // [group][kv_pairs]
  int32_t* values = reinterpret_cast<int32_t*>(probs + kGroup * kv_pairs);  // [kv_pairs][head_dim]

  for (int64_t b = 0; b < kBlocksAhead; ++b) L.prefetch_block(item, kv_start + b * L.block_size);
  // Queries as [head][pair][token]: each token's pair of elements in its 32-bit lane; 16 tokens' rows
  // of 16 pairs transposed at a time (absent tokens' lanes zero).
  for (int g = 0; g < kGroup; ++g) {
    const bf16* head = L.query_row(item.row, item.h * kGroup + g);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512 rows[kTokens];
      for (int64_t j = 0; j < kTokens; ++j) {
        rows[j] = j < item.tokens ? _mm512_loadu_ps(head + j * L.q_row_stride + 2 * p0) : _mm512_setzero_ps();
      }
      transpose16(rows);
      for (int64_t p = 0; p < 16; ++p) q[g * pairs + p0 + p] = (__m512bh)rows[p];
    }
  }

  // 1. Scores, soft-capped if the layer caps them. Keys past kv_len in the last step are read (they
  // lie in the block) and dropped.
  const __m512 scale16 = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 peak[kGroup];
#pragma GCC unroll 16
  for (int g = 0; g < kGroup; ++g) peak[g] = minus_inf;
  for (int64_t t0 = kv_start; t0 < kv_len; t0 += kKeys) {
    const bf16* keys = L.row(L.k_data, item.s, item.h, t0);
    if (t0 % L.block_size == 0) L.prefetch_block(item, t0 + kBlocksAhead * L.block_size);
    __m512 acc[kGroup][kKeys];
#pragma GCC unroll 16
    for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh qp[kGroup];
#pragma GCC unroll 16
      for (int g = 0; g < kGroup; ++g) qp[g] = q[g * pairs + p];
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) {
        const __m512bh k = broadcast_pair(keys + j * head_dim + 2 * p);
#pragma GCC unroll 16
        for (int g = 0; g < kGroup; ++g) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], k, qp[g]);
      }
    }
    for (int j = 0; j < kKeys && t0 + j < kv_len; ++j) {
      const __mmask16 sees = sees_key(item, t0 + j, L.window);
#pragma GCC unroll 16
      for (int g = 0; g < kGroup; ++g) {
        __m512 s = _mm512_mul_ps(round_lanes<bf16>(acc[g][j]), scale16);
        if (L.soft_cap > 0.f) s = soft_cap_lanes(s, L.soft_cap);
        s = _mm512_mask_mov_ps(minus_inf, sees, s);
        scores[g * span + t0 - kv_start + j] = s;
        peak[g] = _mm512_max_ps(peak[g], s);
      }
    }
  }

  // 2. Softmax along each token's keys. A probability pair is two keys' bf16 values in one 32-bit
  // lane, the first key's in the low half, as `vdpbf16ps` pairs them with two values.
  alignas(64) float lane_peak[kGroup][kTokens], lane_total[kGroup][kTokens];  // for a merge
#pragma GCC unroll 16
  for (int g = 0; g < kGroup; ++g) {
    __m512* row = scores + g * span;
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < span; ++t) {
      const __mmask16 seen = _mm512_cmp_ps_mask(row[t], minus_inf, _CMP_NEQ_OQ);
      row[t] = _mm512_maskz_mov_ps(seen, exp_lanes(_mm512_sub_ps(row[t], peak[g])));
      total = _mm512_add_ps(total, row[t]);
    }
    // Lanes of absent tokens see no key: their total is 0 and their probabilities go unused.
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.f), total);
    if constexpr (kMerge) {
      _mm512_store_ps(lane_peak[g], peak[g]);
      _mm512_store_ps(lane_total[g], total);
    }
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t t = 0; t < span; t += 2) {
      const __m512i first = _mm512_castps_si512(round_lanes<bf16>(_mm512_mul_ps(row[t], inverse)));
      const __m512i second = t + 1 < span
                                 ? _mm512_castps_si512(round_lanes<bf16>(_mm512_mul_ps(row[t + 1], inverse)))
                                 : _mm512_setzero_si512();
      probs[g * kv_pairs + t / 2] =
          (__m512bh)_mm512_or_si512(_mm512_srli_epi32(first, 16), _mm512_and_si512(second, high_half));
    }
  }

  // 3. Values two keys at a time: element d of key t and of key t + 1 side by side (a missing
  // second key of an odd kv_len is zeros, not what its row holds). Then O^T = P V.
  const __m512i low_pairs = _mm512_load_si512(kLowPairs), high_pairs = _mm512_load_si512(kHighPairs);
  for (int64_t t = kv_start; t < kv_len; t += 2) {
    const bf16* first = L.row(L.v_data, item.s, item.h, t);  // an even t's pair shares its block
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c);
      const __m512i b = t + 1 < kv_len ? _mm512_loadu_si512(first + head_dim + 32 * c) : _mm512_setzero_si512();
      int32_t* pair_row = values + ((t - kv_start) / 2) * head_dim + 32 * c;
      _mm512_storeu_si512(pair_row, _mm512_permutex2var_epi16(a, low_pairs, b));
      _mm512_storeu_si512(pair_row + 16, _mm512_permutex2var_epi16(a, high_pairs, b));
    }
  }
  // O^T of each head, [element][token], summed over blocks of kPairsBlock key pairs: their
  // probabilities and values (about 28 KB at a group of 3) stay in L1 across the elements.
  constexpr int64_t kPairsBlock = 64;
  alignas(64) float out_t[kGroup][head_dim * kTokens];
  for (int64_t tp0 = 0; tp0 < kv_pairs; tp0 += kPairsBlock) {
    const int64_t tp1 = std::min(kv_pairs, tp0 + kPairsBlock);
    for (int64_t d0 = 0; d0 < head_dim; d0 += kElems) {
      __m512 acc[kGroup][kElems];
#pragma GCC unroll 16
      for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
        for (int e = 0; e < kElems; ++e)
          acc[g][e] = tp0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out_t[g] + (d0 + e) * kTokens);
      for (int64_t tp = tp0; tp < tp1; ++tp) {
        __m512bh p[kGroup];
#pragma GCC unroll 16
        for (int g = 0; g < kGroup; ++g) p[g] = probs[g * kv_pairs + tp];
#pragma GCC unroll 16
        for (int e = 0; e < kElems; ++e) {
          const __m512bh v = broadcast_pair(values + tp * head_dim + d0 + e);
#pragma GCC unroll 16
          for (int g = 0; g < kGroup; ++g) acc[g][e] = _mm512_dpbf16_ps(acc[g][e], v, p[g]);
        }
      }
#pragma GCC unroll 16
      for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
        for (int e = 0; e < kElems; ++e) _mm512_store_ps(out_t[g] + (d0 + e) * kTokens, acc[g][e]);
    }
  }
  // Each head's O^T back to token rows, 16 elements at a time, rounded to bf16 once; with a merge,
  // first weighted with the row's own part (already in `out`) by each part's share of the softmax.
  for (int g = 0; g < kGroup; ++g) {
    alignas(64) float w_mine[kTokens] = {}, w_own[kTokens] = {};
    if constexpr (kMerge) {
      for (int64_t j = 0; j < item.tokens; ++j) {
        const float own = L.merge_lse[(item.row + j) * L.merge_lse_stride + item.h * kGroup + g];
        const float mine = lane_peak[g][j] + std::log(lane_total[g][j]), top = std::max(own, mine);
        const float a = std::exp(mine - top), b = std::exp(own - top);
        w_mine[j] = a / (a + b);
        w_own[j] = b / (a + b);
      }
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      __m512 rows[kTokens];
      for (int64_t e = 0; e < 16; ++e) rows[e] = _mm512_load_ps(out_t[g] + (d0 + e) * kTokens);
      transpose16(rows);
      for (int64_t j = 0; j < item.tokens; ++j) {
        bf16* o = L.out_row(item.row + j, item.h * kGroup + g) + d0;
        __m512 value = rows[j];
        if constexpr (kMerge) {
          value = _mm512_fmadd_ps(_mm512_set1_ps(w_mine[j]), value, _mm512_mul_ps(_mm512_set1_ps(w_own[j]), load_floats(o)));
        }
        store_rounded(o, round_lanes<bf16>(value));
      }
    }
  }
}

using AttendItem = void (*)(const Layout&, const Item&, float);

template <int kChunks, bool kMerge>
AttendItem for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_item<kChunks, 1, kMerge>;
    case 2: return &attend_item<kChunks, 2, kMerge>;
    case 3: return &attend_item<kChunks, 3, kMerge>;
    case 4: return &attend_item<kChunks, 4, kMerge>;
    case 6: return &attend_item<kChunks, 6, kMerge>;
    case 8: return &attend_item<kChunks, 8, kMerge>;
    default: return nullptr;
  }
}

template <bool kMerge = false>
AttendItem kernel_for(int64_t head_dim, int64_t group, int64_t block_size) {
  if (block_size % kTokens != 0) return nullptr;
  switch (head_dim) {
    case 32: return for_group<1, kMerge>(group);
    case 64: return for_group<2, kMerge>(group);
    case 128: return for_group<4, kMerge>(group);
    default: return nullptr;
  }
}

// Runs attend(L, item, scale) for every item on the intra-op threads, handed out in order.
void run_items(const Layout& L, AttendItem attend, const std::vector<Item>& items, float scale) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items.size()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) attend(L, items[i], scale);
  });
}
#endif  // __AVX512BF16__

bool tiled_attention_serves(int64_t head_dim, int64_t group, int64_t block_size) {
#if defined(__AVX512BF16__)
  return kernel_for(head_dim, group, block_size) != nullptr;
#else
  return false;
#endif
}

void tiled_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && query.stride(2) == 1 && out.stride(2) == 1,
              "tiled_prefill_attention: query and out must be bf16 [num_tokens, num_heads, head_dim], contiguous "
              "along head_dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kBFloat16 && kv_cache.size(4) == query.size(2) &&
                  query.size(1) % kv_cache.size(1) == 0,
              "tiled_prefill_attention: kv_cache must be a contiguous bf16 [2, kv_heads, blocks, block_size, head_dim] "
              "matching the query's head_dim and dividing its heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.scalar_type() == at::kLong && block_table.size(0) == num_seqs &&
                  query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.size(0) == num_seqs + 1,
              "tiled_prefill_attention: seq_lens int64 [num_seqs], block_table int64 [num_seqs, blocks] and "
              "query_start_loc int32 [num_seqs + 1]");
  TORCH_CHECK(tiled_attention_serves(query.size(2), query.size(1) / kv_cache.size(1), kv_cache.size(3)),
              "tiled_prefill_attention: head_dim ", query.size(2), ", ", query.size(1) / kv_cache.size(1),
              " query heads per KV head and blocks of ", kv_cache.size(3), " are not served here");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "tiled_prefill_attention: window (", window, ") and soft_cap (",
              soft_cap, ") must not be negative");
#if defined(__AVX512BF16__)
  Layout L(out, query, kv_cache, block_table);
  L.window = window;
  L.soft_cap = static_cast<float>(soft_cap);
  const AttendItem attend = kernel_for(L.head_dim, L.group, L.block_size);
  const auto lens = seq_lens.accessor<int64_t, 1>();
  const auto starts = query_start_loc.accessor<int32_t, 1>();
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = starts[s + 1] - starts[s], context = lens[s] - query_len;
    TORCH_CHECK(query_len >= 0 && context >= 0 && starts[s + 1] <= query.size(0) &&
                    (lens[s] + L.block_size - 1) / L.block_size <= block_table.size(1),
                "tiled_prefill_attention: sequence ", s, " has ", query_len, " query rows over ", lens[s],
                " tokens, which its rows and block table cannot hold");
    for (int64_t j = 0; j < query_len; j += kTokens) {
      const int64_t tokens = std::min(kTokens, query_len - j), position = context + j;
      const int64_t kv_start = window > 0 ? std::max<int64_t>(0, position - window + 1) / kTokens * kTokens : 0;
      for (int64_t h = 0; h < kv_cache.size(1); ++h) {
        items.push_back({s, h, starts[s] + j, tokens, position, position + tokens, kv_start});
      }
    }
  }
  // The most keys first.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.kv_len - a.kv_start > b.kv_len - b.kv_start;
  });
  run_items(L, attend, items, static_cast<float>(scale));
#endif
}

void cascade_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t shared_blocks,
                              double scale) {
  const int64_t num_seqs = query.size(0), block_size = kv_cache.size(3), shared_len = shared_blocks * block_size;
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs &&
                  block_table.dim() == 2 && block_table.size(0) == num_seqs && kv_cache.dim() == 5,
              "cascade_decode_attention: query and out [num_seqs, num_heads, head_dim], seq_lens [num_seqs], "
              "block_table [num_seqs, blocks], kv_cache [2, kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(shared_blocks >= 1 && shared_blocks < block_table.size(1) && seq_lens.scalar_type() == at::kLong &&
                  block_table.scalar_type() == at::kLong,
              "cascade_decode_attention: shared_blocks must leave a block of the table's ", block_table.size(1),
              ", and seq_lens and block_table be int64");
  const auto lens = seq_lens.accessor<int64_t, 1>();
  const auto table = block_table.accessor<int64_t, 2>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    bool shares = lens[s] > shared_len;
    for (int64_t b = 0; b < shared_blocks && shares; ++b) shares = table[s][b] == table[0][b];
    TORCH_CHECK(shares, "cascade_decode_attention: sequence ", s, " does not hold the first ", shared_blocks,
                " blocks of sequence 0 and tokens past them");
  }
  TORCH_CHECK(tiled_attention_serves(query.size(2), query.size(1) / kv_cache.size(1), block_size),
              "cascade_decode_attention: head_dim ", query.size(2), ", ", query.size(1) / kv_cache.size(1),
              " query heads per KV head and blocks of ", block_size, " are not served here");
  if (num_seqs == 0) return;
  // 1. Each row over its own tokens past the prefix, with each row's log-sum-exp.
  static const auto decode = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("raypage::paged_decode_attention", "")
                                 .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, double, const std::optional<at::Tensor>&, int64_t,
                                             double)>();
  const at::Tensor own_lse = at::empty({num_seqs, query.size(1)}, query.options().dtype(at::kFloat));
  // No window and no cap: cascade serves plain layers only (kernels/attention/cpu_paged.py).
  decode.call(out, query, kv_cache, block_table.narrow(1, shared_blocks, block_table.size(1) - shared_blocks),
              seq_lens - shared_len, scale, own_lse, 0, 0.0);
#if defined(__AVX512BF16__)
  // 2. The shared prefix, 16 rows (sequences) a tile, its keys read once for all of them through
  // sequence 0's table, merged into each row's own part.
  Layout L(out, query, kv_cache, block_table);
  L.merge_lse = own_lse.const_data_ptr<float>();
  L.merge_lse_stride = own_lse.stride(0);
  std::vector<Item> items;
  for (int64_t row = 0; row < num_seqs; row += kTokens) {
    for (int64_t h = 0; h < kv_cache.size(1); ++h) {
      // Every row sees every key of the prefix: the first "position" is past its last key.
      items.push_back({0, h, row, std::min(kTokens, num_seqs - row), shared_len, shared_len});
    }
  }
  run_items(L, kernel_for<true>(L.head_dim, L.group, L.block_size), items, static_cast<float>(scale));
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def(
      "tiled_prefill_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int window=0, float soft_cap=0.0) -> ()");
  m.def(
      "cascade_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "int shared_blocks, float scale) -> ()");
  m.def("tiled_attention_serves(int head_dim, int group, int block_size) -> bool", &tiled_attention_serves);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("tiled_prefill_attention", &tiled_prefill_attention);
  m.impl("cascade_decode_attention", &cascade_decode_attention);
}
