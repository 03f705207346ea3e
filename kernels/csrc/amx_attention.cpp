// Paged attention over a bf16 KV cache on AMX-BF16 tiles, decode and prefill rows alike.
//
// torch.ops.raypage.amx_paged_attention(out, query, kv_cache, block_table, seq_lens, query_start_loc, scale):
//   out, query       [num_tokens, num_heads, head_dim] bf16; sequence i's rows are
//                    query_start_loc[i]:query_start_loc[i+1] (int32, num_seqs + 1 offsets)
//   kv_cache         [2, num_kv_heads, num_blocks, block_size, head_dim] bf16, contiguous, holding
//                    every token's key and value, the new ones included
//   block_table      [num_seqs, >= blocks needed] int64, any strides
//   seq_lens         [num_seqs] int64: each sequence's cached context and its new tokens
// Token j of a sequence's new ones attends causally to its first seq_len - query_len + j + 1 tokens.
// torch.ops.raypage.amx_attention_serves(head_dim, block_size): whether this kernel was compiled in
// (AMX-BF16 and AVX-512 BF16), Linux lends the process tile data, and the shape is one it serves.
//
// A work item is a sequence, one KV head and up to kItemRows of its query rows: (token, query head
// of the group) pairs, token-major, each seeing the keys up to its token. A decode is one item of
// `group` rows, a prefill chunk items of kItemRows. Per tile of 16 rows, S (scores) goes into one
// float32 row per query row, an exact two-pass softmax runs along each row, and O = P V takes 32
// keys per step. A tile stops at its last row's keys; each row masks those past its own length.
// Items of many rows pack their keys once for all of them (S = Q K^T needs K^T in bf16 pairs:
// 16x16 dword transposes); items of at most 16 rows (decodes) take each key tile straight from its
// block (S^T = K Q^T, Q^T packed instead, each row's scores gathered out of the stored tile). Both
// pack the values with each two keys' rows interleaved, as P V's tiles take them. Blocks are read
// in place; items are handed out dynamically, costliest first.
//
// Numerics are paged_attention.cpp's: products of bf16 pairs summed in float32 (the tiles' dot
// products; only the order of the sum differs), scores rounded to bf16 and scaled in float32, the
// softmax in float32 (simd.h's exp_lanes), probabilities rounded to bf16 (to nearest even), PV
// summed in float32 and rounded once.
//
// No software prefetching: of the next blocks, of the next item's first blocks, or of all its
// blocks spread over this item's softmax, none changed the time on the machine this was tuned on (a
// 2-core KVM Xeon, where the cache's blocks come at the fill buffers' pace, prefetched or not), and
// the last slowed the softmax by what it saved. Hand-written tile code rather than
// at::native::cpublas::brgemm: a brgemm call of one tile's scores (16 x 16 x 64) or one P V step took
// several times what the tile instructions take (docs/performance.md has the figures); loading a tile
// configuration happens once per thread and call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RAYPAGE_AMX 1
#include "amx_tiles.h"
#endif

namespace {
#if defined(RAYPAGE_AMX)
using bf16 = c10::BFloat16;
using raypage::simd::exp_lanes;  // with AVX-512, on __m512
using raypage::simd::round_lanes;

constexpr int64_t kRows = 16;        // rows of every tile: query rows, keys of S^T, key pairs of V
constexpr int64_t kDepth = 32;       // bf16 values along a tile row (64 bytes): dims of Q and K, keys of P
constexpr int64_t kTileElems = 512;  // bf16 values in one packed tile (1 KB)
constexpr int64_t kItemRows = 128;   // 8 row tiles share one packing of an item's keys and values

using raypage::amx_permitted;

// GCC's tile loads (asm statements) and tile configuration load (a builtin) do not tell it they read
// memory: without this it may move the stores that fill their source (packed keys and values, Q
// rows, probabilities, the configuration) past the load, or drop them.
inline void tiles_see_stores() { asm volatile("" ::: "memory"); }

// All eight tiles as 16 rows of 64 bytes: partial tiles are padded (rows of zeros or leftovers,
// keys masked) rather than reconfigured, so one configuration per thread and call serves every
// item (loading one also zeroes the tiles). Tile state is per thread.
void configure_tiles() {
  raypage::TileShapes shapes;
  for (int t = 0; t < 8; ++t) {
    shapes.rows[t] = kRows;
    shapes.bytes[t] = 2 * kDepth;
  }
  raypage::configure_tiles(shapes);
}

// Where one call's rows lie.
struct Batch {
  int64_t block_size, num_blocks, block_elems, head_elems;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride, bt_seq_stride, bt_block_stride;
  const bf16 *q_data, *k_data, *v_data;
  const int64_t* bt_data;
  bf16* o_data;

  Batch(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table)
      : block_size(kv_cache.size(3)),
        num_blocks(kv_cache.size(2)),
        block_elems(block_size * kv_cache.size(4)),
        head_elems(num_blocks * block_elems),
        q_token_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        o_token_stride(out.stride(0)),
        o_head_stride(out.stride(1)),
        bt_seq_stride(block_table.stride(0)),
        bt_block_stride(block_table.stride(1)),
        q_data(query.const_data_ptr<bf16>()),
        k_data(kv_cache.const_data_ptr<bf16>()),
        v_data(k_data + kv_cache.size(1) * head_elems),
        bt_data(block_table.const_data_ptr<int64_t>()),
        o_data(out.mutable_data_ptr<bf16>()) {}

  // The row of token t (keys or values of KV head h) in its block, checked against the cache's size.
  inline __attribute__((always_inline)) const bf16* row(const bf16* cache, int64_t s, int64_t h, int64_t t) const {
    const int64_t id = bt_data[s * bt_seq_stride + (t / block_size) * bt_block_stride];
    TORCH_CHECK(id >= 0 && id < num_blocks, "amx_paged_attention: block id ", id, " out of range [0, ", num_blocks,
                ")");
    return cache + h * head_elems + id * block_elems + (t % block_size) * (block_elems / block_size);
  }
};

// Rows row0 .. row0 + rows of sequence s for KV head h: row r (from row0) is query head
// h * group + (row0 + r) % group of the token (row0 + r) / group, after `context` cached tokens.
struct Item {
  int64_t s, h, row0, rows, group, first_token, context, cost;
  int64_t token(int64_t r) const { return first_token + (row0 + r) / group; }  // its query row
  int64_t head(int64_t r) const { return h * group + (row0 + r) % group; }
  int64_t len(int64_t r) const { return context + (row0 + r) / group + 1; }  // the keys it sees
  int64_t keys() const { return len(rows - 1); }
};

// One thread's scratch, kept across calls and grown as needed. Rows of scores and probabilities
// are `stride` long: the longest item's keys, rounded up to whole P tiles.
struct Workspace {
  bf16 *q, *keys, *values, *probs;  // Q rows; K^T tiles (Q^T for a decode); V tiles; P rows
  float *scores, *out;              // S rows; O for 16 rows (a decode's S^T tiles before that)
  int64_t stride;
};

Workspace workspace(int64_t head_dim, int64_t max_len) {
  const int64_t stride = (max_len + kDepth - 1) / kDepth * kDepth;
  const int64_t sizes[] = {kItemRows * head_dim * 2, stride * head_dim * 2, stride * head_dim * 2,
                           kRows * stride * 2,       kRows * stride * 4,  kRows * head_dim * 4};
  static thread_local std::vector<char> buffer;
  int64_t total = 64;
  for (const int64_t size : sizes) total += (size + 63) / 64 * 64;
  if (static_cast<int64_t>(buffer.size()) < total) buffer.resize(total);
  char* parts[6];
  parts[0] = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) / 64 * 64);
  for (int i = 1; i < 6; ++i) parts[i] = parts[i - 1] + (sizes[i - 1] + 63) / 64 * 64;
  return {reinterpret_cast<bf16*>(parts[0]),  reinterpret_cast<bf16*>(parts[1]),  reinterpret_cast<bf16*>(parts[2]),
          reinterpret_cast<bf16*>(parts[3]),  reinterpret_cast<float*>(parts[4]), reinterpret_cast<float*>(parts[5]),
          stride};
}

// 16 keys' rows of 32 dims (16 pairs as dwords) transposed: out row k holds pair k of every key.
inline void transpose_pairs(const bf16* rows, int64_t row_stride, bf16* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * row_stride);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i and i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per lane: one column of rows i .. i + 3
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
      r[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  }
  // r[4g + c] holds, in lane l, column 4l + c of rows 4g .. 4g + 3: gather each column's four lanes.
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], kEven), b = _mm512_shuffle_i32x4(r[c], r[4 + c], kOdd);
    const __m512i x = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], kEven);
    const __m512i y = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], kOdd);
    _mm512_storeu_si512(out + c * 32, _mm512_shuffle_i32x4(a, x, kEven));
    _mm512_storeu_si512(out + (8 + c) * 32, _mm512_shuffle_i32x4(a, x, kOdd));
    _mm512_storeu_si512(out + (4 + c) * 32, _mm512_shuffle_i32x4(b, y, kEven));
    _mm512_storeu_si512(out + (12 + c) * 32, _mm512_shuffle_i32x4(b, y, kOdd));
  }
}

// The V tile rows of keys first .. first + count (rows `rows` on, one block's): per 32 keys,
// 2 * kChunks tiles of 16 rows, row p interleaving keys 2p and 2p + 1 of 16 dims. The interleave
// (unpacklo / unpackhi, per 128-bit lane) permutes the dims within each 32; write_rows undoes it.
// An odd count ends in a key of zeros: a slot past a sequence's length may hold a NaN, and 0 * NaN
// is not 0. Past the last key, zero_values_past fills the last P tile's rows.
template <int kChunks>
inline void pack_values(const bf16* rows, int64_t count, int64_t first, const Workspace& w) {
  constexpr int64_t D = 32 * kChunks;
  for (int64_t t = 0; t < count; t += 2) {
    const int64_t key = first + t;
    bf16* out = w.values + (key / kDepth) * 2 * kChunks * kTileElems + (key % kDepth) / 2 * kDepth;
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(rows + t * D + c * kDepth);
      const __m512i b = t + 1 < count ? _mm512_loadu_si512(rows + (t + 1) * D + c * kDepth) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (2 * c) * kTileElems, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(out + (2 * c + 1) * kTileElems, _mm512_unpackhi_epi16(a, b));
    }
  }
}

template <int kChunks>
inline void zero_values_past(int64_t len, const Workspace& w) {
  for (int64_t key = (len + 1) / 2 * 2; key % kDepth != 0; key += 2) {
    bf16* out = w.values + (key / kDepth) * 2 * kChunks * kTileElems + (key % kDepth) / 2 * kDepth;
    for (int g = 0; g < 2 * kChunks; ++g) _mm512_storeu_si512(out + g * kTileElems, _mm512_setzero_si512());
  }
}

// Tile C = the scores of 16 rows against 16 keys, over kChunks pairs of tiles: Q's in 4 .. 3 +
// kChunks (rows of A for S = Q K^T, packed columns B for S^T = K Q^T), the keys' loaded into 2 and 3
// from `keys`, `chunk` elements apart; DP multiplies them in the layout's order.
#define RAYPAGE_Q_K(C, Q, K) _tile_dpbf16ps(C, Q, K)
#define RAYPAGE_K_Q(C, Q, K) _tile_dpbf16ps(C, K, Q)
#define RAYPAGE_SCORE_TILE(C, DP, keys, stride, chunk) \
  do {                                                 \
    _tile_zero(C);                                     \
    _tile_loadd(2, (keys), (stride));                  \
    DP(C, 4, 2);                                       \
    if constexpr (kChunks > 1) {                       \
      _tile_loadd(3, (keys) + (chunk), (stride));      \
      DP(C, 5, 3);                                     \
    }                                                  \
    if constexpr (kChunks > 2) {                       \
      _tile_loadd(2, (keys) + 2 * (chunk), (stride));  \
      DP(C, 6, 2);                                     \
    }                                                  \
    if constexpr (kChunks > 3) {                       \
      _tile_loadd(3, (keys) + 3 * (chunk), (stride));  \
      DP(C, 7, 3);                                     \
    }                                                  \
  } while (0)

// Packs keys 0 .. len into K^T tiles (per 16 keys, kChunks tiles of 32 dims), and the values.
// Keys past len only make scores that no row reads.
template <int kChunks>
void pack(const Batch& b, const Item& item, int64_t len, const Workspace& w) {
  constexpr int64_t D = 32 * kChunks;
  for (int64_t t0 = 0; t0 < len; t0 += b.block_size) {
    const bf16* keys = b.row(b.k_data, item.s, item.h, t0);
    const int64_t n = std::min(b.block_size, len - t0);
    for (int64_t j = 0; j < n; j += kRows) {
      for (int c = 0; c < kChunks; ++c) {
        transpose_pairs(keys + j * D + c * kDepth, D, w.keys + ((t0 + j) / kRows * kChunks + c) * kTileElems);
      }
    }
    pack_values<kChunks>(b.row(b.v_data, item.s, item.h, t0), n, t0, w);
  }
  zero_values_past<kChunks>(len, w);
}

// The scores of 16 rows (their Q tiles loaded) against packed key tiles 0 .. key_tiles.
template <int kChunks>
void scores_tiles(int64_t key_tiles, const Workspace& w) {
  for (int64_t j = 0; j < key_tiles; ++j) {
    RAYPAGE_SCORE_TILE(0, RAYPAGE_Q_K, w.keys + j * kChunks * kTileElems, 64, kTileElems);
    _tile_stored(0, w.scores + j * kRows, w.stride * 4);
  }
}

// The scores of an item of at most 16 rows, each key tile read from its block as A of S^T = K Q^T,
// and the values packed. V is packed one key tile ahead of the products (its loads then overlap
// them) and each tile's scores are gathered one tile after their store: a load of data a tile
// store has just written waits for the store to reach the cache.
template <int kChunks>
void stream_scores(const Batch& b, const Item& item, int64_t len, const Workspace& w) {
  constexpr int64_t D = 32 * kChunks;
  uint32_t* columns = reinterpret_cast<uint32_t*>(w.keys);  // Q^T: pair k of row n at [k / 16][k % 16][n]
  std::memset(static_cast<void*>(columns), 0, kChunks * kTileElems * 2);
  for (int64_t n = 0; n < item.rows; ++n) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(w.q + n * D);
    for (int64_t k = 0; k < D / 2; ++k) columns[(k / 16) * 256 + (k % 16) * 16 + n] = pairs[k];
  }
  tiles_see_stores();
  _tile_loadd(4, columns, 64);
  if constexpr (kChunks > 1) _tile_loadd(5, columns + 256, 64);
  if constexpr (kChunks > 2) _tile_loadd(6, columns + 512, 64);
  if constexpr (kChunks > 3) _tile_loadd(7, columns + 768, 64);
  const auto pack_tile = [&](int64_t j) {
    pack_values<kChunks>(b.row(b.v_data, item.s, item.h, j * kRows), std::min(kRows, len - j * kRows), j * kRows, w);
  };
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const auto gather_rows = [&](int64_t j) {
    for (int64_t r = 0; r < item.rows; ++r) {
      _mm512_storeu_ps(w.scores + r * w.stride + j * kRows, _mm512_i32gather_ps(column, w.out + (j & 1) * 256 + r, 4));
    }
  };
  const int64_t key_tiles = (len + kRows - 1) / kRows;
  pack_tile(0);
  for (int64_t j = 0; j < key_tiles; ++j) {
    if (j + 1 < key_tiles) pack_tile(j + 1);
    RAYPAGE_SCORE_TILE(0, RAYPAGE_K_Q, b.row(b.k_data, item.s, item.h, j * kRows), D * 2, kDepth);
    _tile_stored(0, w.out + (j & 1) * 256, 64);
    if (j > 0) gather_rows(j - 1);
  }
  gather_rows(key_tiles - 1);
  zero_values_past<kChunks>(len, w);
}

// One row's scores 0 .. len to probabilities in bf16, zeros from len to `padded`. Full vectors of 16
// first, then the tail masked: a mask on every vector cost a fifth more.
inline void softmax_row(float* scores, bf16* probs, int64_t len, int64_t padded, float scale) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  const int64_t full = len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1);
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < full; t += 16) {  // a bf16 matmul's output, scaled in float32
    const __m512 x = _mm512_mul_ps(round_lanes<bf16>(_mm512_loadu_ps(scores + t)), scale16);
    _mm512_storeu_ps(scores + t, x);
    peak = _mm512_max_ps(peak, x);
  }
  if (tail) {
    const __m512 x = _mm512_mul_ps(round_lanes<bf16>(_mm512_maskz_loadu_ps(tail, scores + full)), scale16);
    _mm512_storeu_ps(scores + full, x);
    peak = _mm512_mask_max_ps(peak, tail, peak, x);
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(scores + t), shift));
    _mm512_storeu_ps(scores + t, e);
    total = _mm512_add_ps(total, e);
  }
  int64_t end = full;
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(scores + full), shift)));
    _mm512_storeu_ps(scores + full, e);
    total = _mm512_add_ps(total, e);
    end += 16;
  }
  for (; end < padded; end += 16) _mm512_storeu_ps(scores + end, _mm512_setzero_ps());
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < padded; t += 32) {
    const __m512 low = _mm512_mul_ps(_mm512_loadu_ps(scores + t), inverse);
    const __m512 high = _mm512_mul_ps(_mm512_loadu_ps(scores + t + 16), inverse);
    _mm512_storeu_si512(probs + t, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

// O = P V for 16 rows (P's first `chunks` tiles of 32 keys), 64 dims at a time: accumulators
// 0-3 (two for the last 32 dims of head_dim 32 * odd), P in tile 4, V's tiles through 5 and 6.
template <int kChunks>
void probs_times_values(int64_t chunks, const Workspace& w) {
  constexpr int64_t kValueTiles = 2 * kChunks, kOutStride = 32 * kChunks * 4;
  for (int64_t d0 = 0; d0 < kValueTiles; d0 += 4) {
    const bool four = d0 + 4 <= kValueTiles;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      const bf16* values = w.values + (c * kValueTiles + d0) * kTileElems;
      _tile_loadd(4, w.probs + c * kDepth, w.stride * 2);
      _tile_loadd(5, values, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, values + kTileElems, 64);
      _tile_dpbf16ps(1, 4, 6);
      if (four) {
        _tile_loadd(5, values + 2 * kTileElems, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, values + 3 * kTileElems, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, w.out + d0 * 16, kOutStride);
    _tile_stored(1, w.out + (d0 + 1) * 16, kOutStride);
    if (four) {
      _tile_stored(2, w.out + (d0 + 2) * 16, kOutStride);
      _tile_stored(3, w.out + (d0 + 3) * 16, kOutStride);
    }
  }
}

// Rows of O (float32, dims permuted by the V interleave) to the output, in dim order and bf16.
template <int kChunks>
void write_rows(const Batch& b, const Item& item, int64_t r0, int64_t rows, const Workspace& w) {
  // Lane 4k + m of a tile from unpacklo holds dim 8k + m of its 32, from unpackhi dim 8k + 4 + m.
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t n = 0; n < rows; ++n) {
    bf16* o = b.o_data + item.token(r0 + n) * b.o_token_stride + item.head(r0 + n) * b.o_head_stride;
    for (int c = 0; c < kChunks; ++c) {
      const float* acc = w.out + n * 32 * kChunks + c * 32;
      const __m512 low = _mm512_loadu_ps(acc), high = _mm512_loadu_ps(acc + 16);
      for (int half = 0; half < 2; ++half) {
        const __m512 ordered = _mm512_permutex2var_ps(low, half ? last16 : first16, high);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 32 + 16 * half), (__m256i)_mm512_cvtneps_pbh(ordered));
      }
    }
  }
}

template <int kChunks>
void attend(const Batch& b, const Item& item, const Workspace& w, float scale) {
  constexpr int64_t D = 32 * kChunks;
  // A tile's rows past the item's last hold whatever earlier items left: the products of a row
  // depend on that row alone, and those rows' results are never written.
  for (int64_t r = 0; r < item.rows; ++r) {
    std::memcpy(w.q + r * D, b.q_data + item.token(r) * b.q_token_stride + item.head(r) * b.q_head_stride, D * 2);
  }
  tiles_see_stores();
  const bool streamed = item.rows <= kRows;
  if (streamed) {
    stream_scores<kChunks>(b, item, item.keys(), w);
  } else {
    pack<kChunks>(b, item, item.keys(), w);
  }
  for (int64_t r0 = 0; r0 < item.rows; r0 += kRows) {
    const int64_t rows = std::min(kRows, item.rows - r0), last = item.len(r0 + rows - 1);
    if (!streamed) {
      const bf16* q = w.q + r0 * D;
      _tile_loadd(4, q, D * 2);
      if constexpr (kChunks > 1) _tile_loadd(5, q + kDepth, D * 2);
      if constexpr (kChunks > 2) _tile_loadd(6, q + 2 * kDepth, D * 2);
      if constexpr (kChunks > 3) _tile_loadd(7, q + 3 * kDepth, D * 2);
      scores_tiles<kChunks>((last + kRows - 1) / kRows, w);
    }
    const int64_t padded = (last + kDepth - 1) / kDepth * kDepth;
    for (int64_t n = 0; n < rows; ++n) {
      softmax_row(w.scores + n * w.stride, w.probs + n * w.stride, item.len(r0 + n), padded, scale);
    }
    tiles_see_stores();
    probs_times_values<kChunks>(padded / kDepth, w);
    write_rows<kChunks>(b, item, r0, rows, w);
  }
}

using Attend = void (*)(const Batch&, const Item&, const Workspace&, float);

Attend kernel_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return &attend<1>;
    case 64: return &attend<2>;
    case 96: return &attend<3>;
    case 128: return &attend<4>;
    default: return nullptr;
  }
}

// Every (sequence, KV head, kItemRows rows) item, costliest first: a thread that took a long
// prefill last would leave the other idle.
std::vector<Item> work_items(const at::Tensor& seq_lens, const int32_t* starts, int64_t num_kv_heads, int64_t group,
                             int64_t block_size, int64_t table_width) {
  std::vector<Item> items;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t len = seq_lens.const_data_ptr<int64_t>()[s * seq_lens.stride(0)];
    const int64_t first = starts[s], query_len = starts[s + 1] - first;
    TORCH_CHECK(query_len >= 0 && query_len <= len, "amx_paged_attention: sequence ", s, " has ", query_len,
                " query rows but seq_lens ", len);
    TORCH_CHECK((len + block_size - 1) / block_size <= table_width, "amx_paged_attention: seq_lens[", s, "] = ", len,
                " needs more blocks than block_table's ", table_width, " columns");
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t row0 = 0; row0 < query_len * group; row0 += kItemRows) {
        Item item{s, h, row0, std::min(kItemRows, query_len * group - row0), group, first, len - query_len, 0};
        item.cost = (item.keys() + kRows - 1) / kRows * ((item.rows + kRows - 1) / kRows + 1);  // with packing
        items.push_back(item);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}
#endif

bool amx_attention_serves(int64_t head_dim, int64_t block_size) {
#if defined(RAYPAGE_AMX)
  return amx_permitted() && kernel_for(head_dim) != nullptr && block_size % kRows == 0;
#else
  (void)head_dim, (void)block_size;
  return false;
#endif
}

void amx_paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "amx_paged_attention: query and out must both be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "amx_paged_attention: kv_cache must be a contiguous [2, kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  kv_cache.scalar_type() == at::kBFloat16,
              "amx_paged_attention: query, out and kv_cache must be bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "amx_paged_attention: query and out must be contiguous along head_dim");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "amx_paged_attention: head_dim ", query.size(2),
              " of query differs from the cache's ", kv_cache.size(4));
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "amx_paged_attention: ", query.size(1),
              " query heads are not a multiple of the cache's ", kv_cache.size(1), " KV heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kLong,
              "amx_paged_attention: seq_lens must be int64 [num_seqs]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kLong && block_table.size(0) == num_seqs,
              "amx_paged_attention: block_table must be int64 [num_seqs, blocks]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == num_seqs + 1,
              "amx_paged_attention: query_start_loc must be contiguous int32 [num_seqs + 1]");
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "amx_paged_attention: query_start_loc must run from 0 to the ", query.size(0), " query rows");
  TORCH_CHECK(amx_attention_serves(query.size(2), kv_cache.size(3)), "amx_paged_attention: head_dim ", query.size(2),
              " with blocks of ", kv_cache.size(3), " is not served here (see amx_attention_serves)");
#if defined(RAYPAGE_AMX)
  const Batch b(out, query, kv_cache, block_table);
  const std::vector<Item> items = work_items(seq_lens, starts, kv_cache.size(1), query.size(1) / kv_cache.size(1),
                                             b.block_size, block_table.size(1));
  int64_t max_len = 0;
  for (const Item& item : items) max_len = std::max(max_len, item.keys());
  const Attend attend = kernel_for(query.size(2));
  const int64_t num_items = static_cast<int64_t>(items.size()), head_dim = query.size(2);
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    configure_tiles();
    const Workspace w = workspace(head_dim, max_len);
    for (int64_t i = next_item++; i < num_items; i = next_item++) attend(b, items[i], w, static_cast<float>(scale));
    _tile_release();  // a thread holding tile state saves and restores 8 KB more on every switch
  });
#else
  (void)scale;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def(
      "amx_paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale) -> ()");
  m.def("amx_attention_serves(int head_dim, int block_size) -> bool", &amx_attention_serves);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("amx_paged_attention", &amx_paged_attention); }
