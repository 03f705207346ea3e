// add_lora's two phases on AMX-BF16 tiles: see kernels/csrc/lora.cpp, "Kernels".
#pragma once

#include <algorithm>
#include <vector>

#include "lora_call.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYPAGE_LORA_AMX 1
#include "amx_tiles.h"
#endif

namespace {


#if defined(RAYPAGE_LORA_AMX)
constexpr int64_t kDepth = 32;  // bf16 values along a tile row (64 bytes)
constexpr int64_t kShrinkMinRows = 4;  // fewer rows: the dot tiles cost less than packing 16 rows

using raypage::amx_permitted;

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// r[j] lane i = r[i] lane j before, for 16 vectors of 16 32-bit values: pairs of rows interleaved by
// 32 and then 64 bits, which leaves each 128-bit lane of u[4b + c] holding rows 4b .. 4b + 3 of
// column 4L + c (L the lane); two rounds of 128-bit lane shuffles gather each column's four lanes.
//
// The vectors stay in registers only where every index is a constant, so the loops around a
// transpose run to 16 with the count tested inside, and are unrolled: with a variable count GCC keeps
// the array in memory and turns its stores into calls to memcpy.
__attribute__((always_inline)) inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 4; ++b) {
    u[4 * b] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i low01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i low23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i high23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    r[c] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(low01, low23, 0xdd);
    r[8 + c] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(high01, high23, 0xdd);
  }
}

// Every tile 16 rows of 64 bytes. The shrink: C^T in 0-3 (16 x 16 floats), x's packed rows in 4,
// A's rows in 5-6. The expand: C in 0-3, the split shrink rows in 4, B's pairs in 5-6.
inline void configure_tiles() {
  raypage::TileShapes shapes;
  for (int t = 0; t < 8; ++t) {
    shapes.rows[t] = 16;
    shapes.bytes[t] = 64;
  }
  raypage::configure_tiles(shapes);
}

bool amx_shrinks(int64_t in_features, int64_t shrink_width) {
  return in_features % kDepth == 0 && shrink_width % 16 == 0 && amx_permitted();
}

// Even ranks (a pair of rank values must not straddle two thirds of the split shrink values), and
// parts of whole 16-column tiles.
bool amx_expands(int64_t rank, const std::vector<int64_t>& part_starts) {
  if (rank % 2 != 0) return false;
  for (const int64_t start : part_starts)
    if (start % 16 != 0) return false;
  return amx_permitted();
}

// shrunk rows [first, first + n) (n <= 16) of slot `slot`: C^T = A_s X^T, 64 rows of A_s at a time.
void shrink_rows_amx(const LoRACall<bf16>& call, int64_t slot, int64_t first, int64_t n) {
  const int64_t in = call.in_features, width = call.shrink_width, steps = in / kDepth;
  // x's rows as the B operand: per step of 32 values, tile row q holds each row's values 2q, 2q + 1
  // (a 32-bit pair), i.e. the 16 x 16 matrix of the rows' pairs transposed; rows past n are zeros.
  thread_local std::vector<uint32_t> packed;
  packed.resize(steps * 256);
  for (int64_t s = 0; s < steps; ++s) {
    __m512i v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      v[i] = i < n ? _mm512_loadu_si512(call.x_row(first + i) + s * kDepth) : _mm512_setzero_si512();
    transpose16x16(v);
#pragma GCC unroll 16
    for (int q = 0; q < 16; ++q) _mm512_storeu_si512(packed.data() + s * 256 + q * 16, v[q]);
  }
  const bf16* a = call.a_of(slot);
  const int64_t stride = in * static_cast<int64_t>(sizeof(bf16));
  alignas(64) float c[4][256];  // per C^T tile: [shrink column][row]
  for (int64_t group = 0; group < width; group += 64) {
    const int64_t tiles = std::min<int64_t>(4, (width - group) / 16);
    const bf16* ag = a + group * in;
    asm volatile("" ::: "memory");  // the tile loads read the rows just packed
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, packed.data() + s * 256, 64);
      _tile_loadd(5, ag + s * kDepth, stride);
      _tile_dpbf16ps(0, 5, 4);
      if (tiles > 1) {
        _tile_loadd(6, ag + 16 * in + s * kDepth, stride);
        _tile_dpbf16ps(1, 6, 4);
      }
      if (tiles > 2) {
        _tile_loadd(5, ag + 32 * in + s * kDepth, stride);
        _tile_dpbf16ps(2, 5, 4);
      }
      if (tiles > 3) {
        _tile_loadd(6, ag + 48 * in + s * kDepth, stride);
        _tile_dpbf16ps(3, 6, 4);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    asm volatile("" ::: "memory");
    for (int64_t t = 0; t < tiles; ++t) {
      __m512i v[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) v[j] = _mm512_load_si512(c[t] + j * 16);
      transpose16x16(v);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        if (i < n) _mm512_storeu_si512(call.shrunk + (first + i) * width + group + t * 16, v[i]);
    }
  }
}

// The expand multiplies along split_depth = 3 * rank values rounded up to whole 32-value steps: each
// row's split shrink values hi, mid and lo side by side, then zeros. A step's 16 pairs of values
// face 16 rows of B's pairs: pair k of the row faces B's pair k mod (rank / 2) (each third of the
// row starts B's pairs over; the zeros face anything finite). So B's pairs are laid out once and
// then repeated, pair_rows(rank) rows in all, and step s reads 16 of them from row
// 16 s mod (rank / 2): rank 16's two steps both read rows 0-15 (its pairs twice), rank 32's three
// steps rows 0-15 (its pairs once).
int64_t split_depth(int64_t rank) { return (3 * rank + kDepth - 1) / kDepth * kDepth; }

int64_t pair_row_of_step(int64_t rank, int64_t step) { return (16 * step) % (rank / 2); }

int64_t pair_rows(int64_t rank) {
  int64_t rows = 16;
  for (int64_t step = 0; step < split_depth(rank) / kDepth; ++step)
    rows = std::max(rows, pair_row_of_step(rank, step) + 16);
  return rows;
}

// B's rows as the B operand of the expand, for `count` (at most 4) tiles of 16 columns (b: the first
// tile's first row, rank values each). Tile t's rows are pair + t * pair_rows * 16 on: row p holds
// each column's rank values 2p and 2p + 1 (a 32-bit pair), i.e. the matrix of pairs transposed,
// and row p + rank / 2 the same as row p (split_depth's repetition).
void pack_pairs(const bf16* b, int64_t rank, int64_t count, uint32_t* pair) {
  const int64_t pairs = rank / 2, rows = pair_rows(rank);
  auto store = [&](int64_t t, int64_t p, __m512i row) {
    for (int64_t q = p; q < rows; q += pairs) _mm512_storeu_si512(pair + (t * rows + q) * 16, row);
  };
  if (pairs <= 8) {  // two tiles a transpose: a row's lanes 0-7 from tile t, 8-15 from tile t + 1
    const __mmask8 m = static_cast<__mmask8>((1u << pairs) - 1);
    for (int64_t t = 0; t < count; t += 2) {
      __m512i v[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m256i first = _mm256_maskz_loadu_epi32(m, b + (16 * t + j) * rank);
        const __m256i second = t + 1 < count ? _mm256_maskz_loadu_epi32(m, b + (16 * (t + 1) + j) * rank)
                                             : _mm256_setzero_si256();
        v[j] = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      }
      transpose16x16(v);
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        if (p >= pairs) break;
        store(t, p, v[p]);
        if (t + 1 < count) store(t + 1, p, v[8 + p]);
      }
    }
    return;
  }
  for (int64_t t = 0; t < count; ++t)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 m = first_lanes(pairs - p0);
      __m512i v[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) v[j] = _mm512_maskz_loadu_epi32(m, b + (16 * t + j) * rank + 2 * p0);
      transpose16x16(v);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p)
        if (p0 + p < pairs) store(t, p0 + p, v[p]);
    }
}

// The shrink values of a range's rows for part `part`, per block of 16 rows a bf16 tile
// [16][split_depth] (rows past the range's are zeros): hi, mid and lo side by side, with hi + mid +
// lo = S exactly: hi is S with its low 16 bits cleared, mid the same of S - hi (exact in float32),
// and lo = S - hi - mid, which has at most 8 significant bits left, so is a bf16 value itself.
void split_shrunk(const LoRACall<bf16>& call, const RowRange& range, int64_t part, std::vector<bf16>& split) {
  const int64_t rank = call.rank, n = range.rows, depth = split_depth(rank);
  split.assign((n + 15) / 16 * 16 * depth, bf16{});
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = 0; i < n; ++i) {
    const float* s = call.shrunk + (range.first + i) * call.shrink_width + part * rank;
    bf16* row = split.data() + i * depth;
    for (int64_t q = 0; q < rank; q += 16) {
      const __mmask16 m = first_lanes(rank - q);
      const __m512 value = _mm512_maskz_loadu_ps(m, s + q);
      const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(value), high_half));
      const __m512 rest = _mm512_sub_ps(value, high);
      const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), high_half));
      const __m512 thirds[3] = {high, mid, _mm512_sub_ps(rest, mid)};
      for (int third = 0; third < 3; ++third) {
        const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(thirds[third]), 16));
        _mm256_mask_storeu_epi16(row + third * rank + q, m, top);
      }
    }
  }
}

// The expand runs as a pipeline, so that the tile unit and the vector code work at the same time.
// Tile instructions run in order on their own unit, behind the vector code that issued them, and
// memory orders the two: a tile load of pairs waits for their stores, a store to pairs still being
// loaded waits for the load, and a row of C read back waits for the tile store. So each buffer they
// share has two copies, used in turn: B's pairs are packed a chunk of kPackedTiles column tiles
// ahead into one copy while the tiles multiply the other's, the split rows of consecutive slots
// alternate the same way, and a group's C is added to out only after the next group's tile
// instructions are issued.
constexpr int64_t kPackedTiles = 8;

// The expand of output columns [16 * first_tile, 16 * end_tile) for the rows of `ranges`: C = S B_s^T
// per 16 rows and up to four tiles of 16 columns.
void expand_tiles_amx(const LoRACall<bf16>& call, const std::vector<RowRange>& ranges, int64_t first_tile,
                      int64_t end_tile) {
  const int64_t rank = call.rank, depth = split_depth(rank), tile_words = pair_rows(rank) * 16;
  const int64_t stride = depth * static_cast<int64_t>(sizeof(bf16));
  thread_local std::vector<bf16> splits[2];
  thread_local std::vector<uint32_t> pairs[2];
  for (auto& buffer : pairs) buffer.resize(kPackedTiles * tile_words);
  alignas(64) float c[2][16][64];  // per copy C's four tiles side by side: a row's 64 columns in order
  // The group whose C waits in c[pending_copy] to be added to out.
  struct Pending {
    int64_t copy = -1, first_row = 0, rows = 0, column = 0, width = 0;
  } pending;
  auto add_pending = [&] {
    for (int64_t i = 0; i < pending.rows; ++i)
      add_row(c[pending.copy][i], pending.width, call.out_row(pending.first_row + i) + pending.column);
  };
  int64_t split_copy = 0, pair_copy = 0;
  for (int64_t part = 0; part + 1 < static_cast<int64_t>(call.part_starts.size()); ++part) {
    const int64_t begin = std::max(first_tile, call.part_starts[part] / 16);
    const int64_t end = std::min(end_tile, call.part_starts[part + 1] / 16);
    for (const RowRange& range : ranges) {
      if (begin >= end) break;
      split_copy ^= 1;
      split_shrunk(call, range, part, splits[split_copy]);
      const bf16* split = splits[split_copy].data();
      const int64_t n = range.rows, first = range.first, slot = range.slot;
      for (int64_t chunk = begin; chunk < end; chunk += kPackedTiles) {
        const int64_t chunk_end = std::min(end, chunk + kPackedTiles);
        pair_copy ^= 1;
        uint32_t* pair = pairs[pair_copy].data();
        for (int64_t tile = chunk; tile < chunk_end; tile += 4)
          pack_pairs(call.b_of(slot) + tile * 16 * rank, rank, std::min<int64_t>(4, chunk_end - tile),
                     pair + (tile - chunk) * tile_words);
        asm volatile("" ::: "memory");  // the tile loads read the pairs and the split rows just stored
        for (int64_t block = 0; block * 16 < n; ++block) {
          for (int64_t tile = chunk; tile < chunk_end; tile += 4) {
            const int64_t count = std::min<int64_t>(4, chunk_end - tile), copy = pending.copy == 0 ? 1 : 0;
            const uint32_t* group = pair + (tile - chunk) * tile_words;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < depth; k += kDepth) {
              const uint32_t* step = group + pair_row_of_step(rank, k / kDepth) * 16;
              _tile_loadd(4, split + block * 16 * depth + k, stride);
              _tile_loadd(5, step, 64);
              _tile_dpbf16ps(0, 4, 5);
              if (count > 1) {
                _tile_loadd(6, step + tile_words, 64);
                _tile_dpbf16ps(1, 4, 6);
              }
              if (count > 2) {
                _tile_loadd(5, step + 2 * tile_words, 64);
                _tile_dpbf16ps(2, 4, 5);
              }
              if (count > 3) {
                _tile_loadd(6, step + 3 * tile_words, 64);
                _tile_dpbf16ps(3, 4, 6);
              }
            }
            _tile_stored(0, &c[copy][0][0], 256);
            _tile_stored(1, &c[copy][0][16], 256);
            _tile_stored(2, &c[copy][0][32], 256);
            _tile_stored(3, &c[copy][0][48], 256);
            asm volatile("" ::: "memory");  // C is read back as floats
            add_pending();
            pending = {copy, first + block * 16, std::min<int64_t>(16, n - block * 16), tile * 16, count * 16};
          }
        }
      }
    }
  }
  add_pending();
}
#endif

}  // namespace
