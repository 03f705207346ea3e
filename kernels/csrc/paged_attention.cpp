// Decode attention over the paged KV cache on the CPU, reading each sequence's blocks in place.
//
// torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale):
//   out, query   [num_seqs, num_heads, head_dim], one query token per sequence
//   kv_cache     [2, num_kv_heads, num_blocks, block_size, head_dim], contiguous (keys, then values)
//   block_table  [num_seqs, >= blocks needed] int64, any strides (a slice of the batch's table)
//   seq_lens     [num_seqs] int64, tokens each sequence attends to (its cached context and itself)
//   lse          optional float32 [num_seqs, num_heads]: each row's log-sum-exp of its scaled scores
//                (max + log of the softmax's sum), for merging with attention over other keys
//                (cascade_decode_attention in tiled_attention.cpp)
//   window       a sliding window (0: none): each row sees only its last `window` tokens, and the
//                blocks before the one holding the first of them are never read (the KV cache
//                manager may have freed them)
//   soft_cap     0, or the soft cap of the scaled scores: cap * tanh(score / cap) (Gemma 2)
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
//
// Two implementations: attend_bf16 (AVX-512 BF16, a bf16 cache with head_dim 32, 64 or 128, GQA
// groups of 1-4, 6 or 8 and blocks of a multiple of 16 tokens) multiplies bf16 pairs directly with
// `vdpbf16ps` and finishes 16 scores at once; attend_widened serves every other case, on AVX-512
// or AVX2 vectors where the CPU has them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "paged_layout.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

using namespace raypage::simd;  // the per-ISA vector layer (simd.h)
using namespace raypage::attention_rows;

// Five primitives carry all the arithmetic: widening a row of the cache to float32, a dot product,
// acc += p * x, rounding to the cache dtype and the softmax's exponentials (the shared ones in
// attention_rows.h). Each runs kLanes floats at a time, then finishes the rest (n % kLanes) one at a time.

// dst[0:n] = float(src[0:n])
template <typename T>
inline void widen(float* __restrict dst, const T* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  for (; i + kLanes <= n; i += kLanes) store_floats(dst + i, load_floats(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// p[0:n] = round_to<T>(p * pre) * post
template <typename T>
inline void round_scaled(float* p, int64_t n, float pre, float post) {
  int64_t i = 0;
#if defined(RAYPAGE_SIMD)
  const Vec before = set1(pre), after = set1(post);
  for (; i + kLanes <= n; i += kLanes) store_floats(p + i, mul(round_lanes<T>(mul(load_floats(p + i), before)), after));
#endif
  for (; i < n; ++i) p[i] = round_to<T>(p[i] * pre) * post;
}

// Inlined into the kernels' loops: a call there would make them keep their accumulators in memory.
#define RAYPAGE_INLINE inline __attribute__((always_inline))

// Blocks lie anywhere in a cache of many megabytes: without prefetching, the kernel spent most of
// its time waiting for each key and value row to arrive from memory. Locality 3 brings the lines
// into L1, 2 into L2 (for rows wanted later than the next block).
template <int kLocality = 3, typename T>
RAYPAGE_INLINE void prefetch(const T* data, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t offset = 0; offset < elems * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, kLocality);
  }
}

// How far ahead pass 1 prefetches keys, in blocks. A row comes from DRAM (the cache of every layer
// does not fit in L3) in far longer than one block's scores take, so several blocks must be in flight
// at once to keep the core's outstanding misses busy.
constexpr int64_t kKeysAhead = 4;
// How far ahead pass 1 prefetches values into L2, in blocks: pass 2 then finds them there.
constexpr int64_t kValuesAhead = 2;

// One work item: a sequence, one of its KV heads, how many tokens it holds, the first one it sees
// (0 without a window) and the first token of that one's block, where its reads begin.
struct WorkItem {
  int64_t s, h, len, first, start;
};

// The call's layout (paged_layout.h), with the optional log-sum-exp output and the prefetching.
template <typename T>
struct Layout : raypage::PagedLayout<T> {
  using raypage::PagedLayout<T>::block;
  using raypage::PagedLayout<T>::block_size;
  using raypage::PagedLayout<T>::block_elems;
  using raypage::PagedLayout<T>::k_data;
  using raypage::PagedLayout<T>::v_data;
  float* lse_data = nullptr;  // with lse_seq_stride: the optional log-sum-exp output
  int64_t lse_seq_stride = 0;
  float soft_cap = 0.f;  // 0: scores uncapped

  Layout(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table)
      : raypage::PagedLayout<T>("paged_decode_attention", out, query, kv_cache, block_table) {}

  void store_lse(int64_t s, int64_t head, float peak, float total) const {
    if (lse_data) lse_data[s * lse_seq_stride + head] = peak + std::log(total);
  }
  // The first row of token t0's block (keys or values of KV head h).
  RAYPAGE_INLINE const T* rows(const T* cache, int64_t s, int64_t h, int64_t t0) const { return block(cache, s, h, t0); }
  // The block `ahead` blocks after token t0's is prefetched while this one is used.
  template <int kLocality = 3>
  RAYPAGE_INLINE void prefetch_next(const T* cache, int64_t s, int64_t h, int64_t t0, int64_t len,
                                    int64_t ahead = 1) const {
    if (t0 + ahead * block_size < len) prefetch<kLocality>(rows(cache, s, h, t0 + ahead * block_size), block_elems);
  }
  // The blocks an item's pass 1 begins with: kKeysAhead of keys, kValuesAhead of values (to L2).
  RAYPAGE_INLINE void prefetch_start(const WorkItem& item) const {
    for (int64_t ahead = 0; ahead < kKeysAhead; ++ahead) {
      prefetch_next(k_data, item.s, item.h, item.start, item.len, ahead);
    }
    for (int64_t ahead = 0; ahead < kValuesAhead; ++ahead) {
      prefetch_next<2>(v_data, item.s, item.h, item.start, item.len, ahead);
    }
  }
  // Scaled scores p[0:n] soft-capped, if the layer caps them.
  void cap_scores(float* p, int64_t n) const {
    if (soft_cap > 0.f) soft_cap_scores(p, n, soft_cap);
  }
};

// Per-thread scratch, kept across calls: a layer's call would otherwise allocate it again each time.
template <typename E>
E* scratch(int64_t n) {
  static thread_local std::vector<E> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Checks every sequence's length, then runs attend(item, next, max_len) for each (sequence, KV head)
// pair on the intra-op threads, each seeing its last `window` tokens (0: all of them). Each thread claims its next item before it starts the current one
// and passes it along (`next`, nullptr at the end), so that the next item's first blocks are fetched
// while this one finishes; claims stay dynamic, so a thread holds back at most one item.
template <typename Attend>
void for_each_item(const at::Tensor& seq_lens, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                   int64_t window, Attend attend) {
  const int64_t num_seqs = seq_lens.size(0), lens_stride = seq_lens.stride(0);
  const int64_t* lens_data = seq_lens.const_data_ptr<int64_t>();
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
  const auto work_item = [&](int64_t index) {
    const int64_t s = index / num_kv_heads, len = lens_data[s * lens_stride];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return WorkItem{s, index % num_kv_heads, len, first, first - first % block_size};
  };
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    int64_t index = next_item++;
    if (index >= num_items) return;
    WorkItem item = work_item(index);
    for (;;) {
      const int64_t next_index = next_item++;
      if (next_index >= num_items) return attend(item, nullptr, max_len);
      const WorkItem next = work_item(next_index);
      attend(item, &next, max_len);
      item = next;
    }
  });
}

// Any dtype, head size and group: rows widened to float32, one dot product per (key, query head).
template <typename T>
void attend_widened(const Layout<T>& L, const WorkItem& item, const WorkItem* next, int64_t max_len, float scale) {
  const int64_t s = item.s, h = item.h, len = item.len, first = item.first, visible = len - first;
  const int64_t group = L.group, head_dim = L.head_dim, block_size = L.block_size;
  float* q = scratch<float>(2 * group * head_dim + head_dim + group * max_len);
  float* acc = q + group * head_dim;
  float* row = acc + group * head_dim;
  float* scores = row + head_dim;
  for (int64_t g = 0; g < group; ++g) widen(&q[g * head_dim], L.query_row(s, h * group + g), head_dim);
  // Pass 1: every query head's score against every visible key, block by block where the keys lie.
  for (int64_t t0 = item.start; t0 < len; t0 += block_size) {
    L.prefetch_next(L.k_data, s, h, t0, len);
    const T* keys = L.rows(L.k_data, s, h, t0);
    for (int64_t t = std::max(t0, first); t < std::min(t0 + block_size, len); ++t) {
      widen(row, keys + (t - t0) * head_dim, head_dim);
      for (int64_t g = 0; g < group; ++g) scores[g * max_len + t] = dot(&q[g * head_dim], row, head_dim);
    }
  }
  prefetch(L.rows(L.v_data, s, h, item.start), L.block_elems);
  if (next) L.prefetch_start(*next);
  for (int64_t g = 0; g < group; ++g) {
    float* p = &scores[g * max_len + first];
    round_scaled<T>(p, visible, 1.f, scale);  // a bf16 matmul's output, scaled in float32
    L.cap_scores(p, visible);
    // Softmax in float32; probabilities rounded to the cache dtype.
    const float peak = *std::max_element(p, p + visible);
    const float total = exp_shifted(p, visible, peak);
    L.store_lse(s, h * group + g, peak, total);
    round_scaled<T>(p, visible, 1.f / total, 1.f);
  }
  // Pass 2: the probability-weighted sum of the visible values, read block by block in place.
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t0 = item.start; t0 < len; t0 += block_size) {
    L.prefetch_next(L.v_data, s, h, t0, len);
    const int64_t lo = std::max(t0, first), n = std::min(t0 + block_size, len) - lo;
    const T* values = L.rows(L.v_data, s, h, t0) + (lo - t0) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      accumulate_rows(&acc[g * head_dim], &scores[g * max_len + lo], values, n, head_dim);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* o = L.out_row(s, h * group + g);
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
  }
}

#if defined(__AVX512BF16__)
// Lane j of the result is the sum of a[j]'s 16 lanes: 16 dot products finished together in 45
// shuffles and adds, where a horizontal reduce per dot product takes about 8 each.
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a[2i], a[2i+1], a[2i], a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i], ..., a[4i+3]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const auto fold = [](__m512 x, __m512 y) {  // the 128-bit lanes pairwise: x's two halves, then y's
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, kEven), _mm512_shuffle_f32x4(x, y, kOdd));
  };
  return fold(fold(c[0], c[1]), fold(c[2], c[3]));
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// bf16 with head_dim = 32 * kChunks and a GQA group of kGroup: every product is a `vdpbf16ps`, two
// bf16 multiplies per float32 lane accumulated in float32 (exact products: the same math as a bf16
// matmul, only the order of the sum differs; subnormal bf16 inputs count as zero). Scores come 16 keys at a time, finished together by
// sum_lanes16. Values go two tokens at a time: their rows interleaved so that each lane pairs token
// t's element with token t+1's, against the pair of probabilities broadcast. The interleave permutes
// the head dimension inside each 128-bit lane; the output undoes it once.
template <int kChunks, int kGroup>
void attend_bf16(const Layout<c10::BFloat16>& L, const WorkItem& item, const WorkItem* next, int64_t max_len,
                 float scale) {
  using bf16 = c10::BFloat16;
  const int64_t s = item.s, h = item.h, len = item.len, first = item.first;
  constexpr int64_t head_dim = 32 * kChunks;
  const int64_t block_size = L.block_size, p_stride = max_len + 2;  // room for a zero after an odd length
  float* scores = scratch<float>(kGroup * max_len);
  uint16_t* probs = scratch<uint16_t>(kGroup * p_stride);
  __m512bh q[kGroup][kChunks];
  __m512 peak[kGroup];
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) q[g][c] = load_bf16x32(L.query_row(s, h * kGroup + g) + 32 * c);
    peak[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  // Pass 1: scores, 16 keys of a block at a time from the step holding the first visible key. Rows
  // past `len` in the last block, and before `first` in the first step, are read (they lie inside
  // the block) but their scores are never stored.
  // The first blocks were prefetched during the previous item, except for a thread's first item.
  L.prefetch_start(item);
  for (int64_t t0 = item.start; t0 < len; t0 += block_size) {
    L.prefetch_next(L.k_data, s, h, t0, len, kKeysAhead);
    L.template prefetch_next<2>(L.v_data, s, h, t0, len, kValuesAhead);
    const bf16* keys = L.rows(L.k_data, s, h, t0);
    for (int64_t j0 = std::max<int64_t>(0, first - t0) & ~int64_t{15}; j0 < std::min(block_size, len - t0); j0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - t0 - j0), hidden = std::max<int64_t>(0, first - t0 - j0);
      const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1) & ~((1u << hidden) - 1));
      for (int g = 0; g < kGroup; ++g) {
        __m512 partial[16];
        for (int j = 0; j < 16; ++j) {
          partial[j] = _mm512_setzero_ps();
          for (int c = 0; c < kChunks; ++c) {
            partial[j] = _mm512_dpbf16_ps(partial[j], q[g][c], load_bf16x32(keys + (j0 + j) * head_dim + 32 * c));
          }
        }
        const __m512 scores16 = _mm512_mul_ps(round_lanes<bf16>(sum_lanes16(partial)), scale16);
        _mm512_mask_storeu_ps(scores + g * max_len + t0 + j0, valid, scores16);
        peak[g] = _mm512_mask_max_ps(peak[g], valid, peak[g], scores16);
      }
    }
  }
  prefetch(L.rows(L.v_data, s, h, item.start), L.block_elems);
  // The next item's first blocks, while the softmax and pass 2 work from the caches.
  if (next) L.prefetch_start(*next);
  // Pass 2 reads tokens in pairs from an even one: a token before `first` in its pair weighs 0.
  const int64_t first_pair = first & ~int64_t{1};
  for (int g = 0; g < kGroup; ++g) {
    float* p = scores + g * max_len;
    float top = _mm512_reduce_max_ps(peak[g]);
    if (L.soft_cap > 0.f) {
      L.cap_scores(p + first, len - first);
      top = *std::max_element(p + first, p + len);
    }
    const float total = exp_shifted(p + first, len - first, top);
    L.store_lse(s, h * kGroup + g, top, total);
    const __m512 inverse = _mm512_set1_ps(1.f / total);
    uint16_t* pb = probs + g * p_stride;
    int64_t t = first;
    for (; t + 16 <= len; t += 16) {  // rounded to nearest even, as static_cast<bf16> does
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(p + t), inverse)));
    }
    for (; t < len; ++t) pb[t] = static_cast<bf16>(p[t] * _mm512_cvtss_f32(inverse)).x;
    std::fill(pb + first_pair, pb + first, uint16_t{0});
    pb[len] = 0;
  }
  // Pass 2: values two tokens at a time. A missing second token (an odd length) is a row of zeros,
  // not whatever the block holds past `len`, which could be a NaN; it is read all the same (blocks
  // have an even size), then zeroed in the register: GCC keeps the accumulators in memory across a
  // masked load.
  __m512 acc[kGroup][2 * kChunks];
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < 2 * kChunks; ++i) acc[g][i] = _mm512_setzero_ps();
  }
  for (int64_t t0 = item.start; t0 < len; t0 += block_size) {
    L.prefetch_next(L.v_data, s, h, t0, len);
    const bf16* values = L.rows(L.v_data, s, h, t0);
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t t = std::max<int64_t>(0, first_pair - t0); t < n; t += 2) {
      const __mmask32 second = t + 1 < n ? ~__mmask32{0} : __mmask32{0};
      __m512bh lo[kChunks], hi[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        const __m512i a = _mm512_loadu_si512(values + t * head_dim + 32 * c);
        const __m512i b = _mm512_maskz_mov_epi16(second, _mm512_loadu_si512(values + (t + 1) * head_dim + 32 * c));
        lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < kGroup; ++g) {
        int32_t pair;
        std::memcpy(&pair, probs + g * p_stride + t0 + t, sizeof(pair));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < kChunks; ++c) {
          acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], p, lo[c]);
          acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], p, hi[c]);
        }
      }
    }
  }
  // Lane 4k+m of the low half holds element 8k+m of its 32, of the high half element 8k+4+m.
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < kGroup; ++g) {
    bf16* o = L.out_row(s, h * kGroup + g);
    for (int c = 0; c < kChunks; ++c) {
      const __m512 low = acc[g][2 * c], high = acc[g][2 * c + 1];
      for (int half = 0; half < 2; ++half) {
        const __m512 ordered = _mm512_permutex2var_ps(low, half ? last16 : first16, high);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c + 16 * half),
                            (__m256i)_mm512_cvtneps_pbh(ordered));
      }
    }
  }
}

using Bf16Attend = void (*)(const Layout<c10::BFloat16>&, const WorkItem&, const WorkItem*, int64_t, float);

template <int kChunks>
Bf16Attend bf16_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_bf16<kChunks, 1>;
    case 2: return &attend_bf16<kChunks, 2>;
    case 3: return &attend_bf16<kChunks, 3>;
    case 4: return &attend_bf16<kChunks, 4>;
    case 6: return &attend_bf16<kChunks, 6>;
    case 8: return &attend_bf16<kChunks, 8>;
    default: return nullptr;
  }
}

// The vdpbf16ps kernel for this shape, or nullptr where the widening one serves instead.
Bf16Attend bf16_kernel(int64_t head_dim, int64_t group, int64_t block_size) {
  if (block_size % 16 != 0) return nullptr;
  switch (head_dim) {
    case 32: return bf16_for_group<1>(group);
    case 64: return bf16_for_group<2>(group);
    case 128: return bf16_for_group<4>(group);
    default: return nullptr;
  }
}
#endif

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens, float scale,
                   const std::optional<at::Tensor>& lse, int64_t window, float soft_cap) {
  Layout<T> L(out, query, kv_cache, block_table);
  if (lse.has_value()) {
    L.lse_data = lse->mutable_data_ptr<float>();
    L.lse_seq_stride = lse->stride(0);
  }
  L.soft_cap = soft_cap;
  const auto items = [&](auto attend) {
    for_each_item(seq_lens, kv_cache.size(1), L.block_size, block_table.size(1), window, attend);
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (const Bf16Attend attend = bf16_kernel(L.head_dim, L.group, L.block_size)) {
      return items([&](const WorkItem& item, const WorkItem* next, int64_t max_len) {
        attend(L, item, next, max_len, scale);
      });
    }
  }
#endif
  items([&](const WorkItem& item, const WorkItem* next, int64_t max_len) {
    attend_widened(L, item, next, max_len, scale);
  });
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            const std::optional<at::Tensor>& lse, int64_t window, double soft_cap) {
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
  TORCH_CHECK(!lse.has_value() || (lse->dim() == 2 && lse->scalar_type() == at::kFloat && lse->size(0) == query.size(0) &&
                                    lse->size(1) == query.size(1) && lse->stride(1) == 1),
              "paged_decode_attention: lse must be float32 [num_seqs, num_heads], contiguous along the heads");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "paged_decode_attention: window (", window, ") and soft_cap (",
              soft_cap, ") must not be negative");
  if (query.size(0) == 0) return;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, kv_cache, block_table, seq_lens, fscale, lse, window, cap);
    case at::kBFloat16:
      return decode_kernel<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens, fscale, lse, window, cap);
    case at::kHalf:
      return decode_kernel<c10::Half>(out, query, kv_cache, block_table, seq_lens, fscale, lse, window, cap);
    default:
      TORCH_CHECK(false, "paged_decode_attention: dtype ", query.scalar_type(),
                  " is not supported (float32, bfloat16, float16)");
  }
}

// Whether attend_bf16 was compiled in: this CPU multiplies bf16 pairs natively (AVX-512 BF16).
bool has_bf16_dot_product() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(raypage, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale, Tensor(b!)? lse=None, int window=0, float soft_cap=0.0) -> ()");
  m.def("has_bf16_dot_product() -> bool", &has_bf16_dot_product);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
