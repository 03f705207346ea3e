// The products moe.cpp is made of: a group of rows (one expert's tokens) times a block of
// kBlockCols weight rows, as float32 sums over the shared dimension handed to an epilogue.
//
// project_rows picks the tiles. With AMX-BF16 (bf16 groups of kAmxMinRows rows or more, the shared
// dimension a multiple of 32 and the block's width of 16): C^T = W x^T on tiles, the weights loaded
// as they are stored and only the group's few rows packed into the pairs the tiles multiply, once
// per group and thread. Otherwise dot-product tiles of kTileRows x kTileCols along the shared
// dimension, both operands read as stored: that many accumulators of kLanes floats (vdpbf16ps, 32
// bf16 values a step, where the CPU has AVX-512 BF16), each reduced to one float at the end. Both
// sum exact products of the inputs in float32; only the order of the sums differs.

#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYPAGE_MOE_AMX 1
#include "amx_tiles.h"
#endif

namespace raypage::moe_tiles {

using namespace raypage::simd;
using bf16 = c10::BFloat16;

constexpr int kTileRows = 4;  // 4 x 4 accumulators and 8 operand vectors: 24 of AVX-512's 32 registers
constexpr int kTileCols = 4;
constexpr int64_t kBlockCols = 64;  // output columns of a work item: a decode step still has many items

using Sums = float[kTileRows][kTileCols];

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// sums[r][c] = rows[r] . weight[c] over k values in float32, for a Rows x Cols tile; weight's rows
// are k apart.
template <typename T, int Rows, int Cols>
void dot_tile(const T* const* rows, const T* weight, int64_t k, Sums& sums) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    __m512 acc[Rows][Cols];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
    for (; i < k; i += 32) {
      // The last step loads zeros past k: their products add nothing.
      const __mmask32 mask = k - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k - i)) - 1;
      __m512bh w[Cols];
      for (int c = 0; c < Cols; ++c) w[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, weight + c * k + i);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + i);
        for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, w[c]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) sums[r][c] = reduce_add(acc[r][c]);
    return;
  }
#endif
#if defined(RAYPAGE_SIMD)
  Vec acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = set1(0.f);
  for (; i + kLanes <= k; i += kLanes) {
    Vec w[Cols];
    for (int c = 0; c < Cols; ++c) w[c] = load_floats(weight + c * k + i);
    for (int r = 0; r < Rows; ++r) {
      const Vec x = load_floats(rows[r] + i);
      for (int c = 0; c < Cols; ++c) acc[r][c] = fmadd(x, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) sums[r][c] = reduce_add(acc[r][c]);
#else
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) sums[r][c] = 0.f;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c)
        sums[r][c] += static_cast<float>(rows[r][i]) * static_cast<float>(weight[c * k + i]);
}

template <typename T>
using DotFn = void (*)(const T* const*, const T*, int64_t, Sums&);

template <typename T, int Rows, int... Cols>
constexpr std::array<DotFn<T>, kTileCols> dot_row(std::integer_sequence<int, Cols...>) {
  return {&dot_tile<T, Rows, Cols + 1>...};
}

template <typename T, int... Rows>
constexpr std::array<std::array<DotFn<T>, kTileCols>, kTileRows> dot_table(std::integer_sequence<int, Rows...>) {
  return {dot_row<T, Rows + 1>(std::make_integer_sequence<int, kTileCols>{})...};
}

// The tile of `rows` x `cols`, both at least 1: tiles at a group's or a block's edge are smaller.
template <typename T>
DotFn<T> dot_fn(int64_t rows, int64_t cols) {
  static constexpr auto table = dot_table<T>(std::make_integer_sequence<int, kTileRows>{});
  return table[rows - 1][cols - 1];
}

// scratch[r * kBlockCols + j] = rows[r] . weight[j] for r < n_rows, j < width; weight's rows k apart.
template <typename T>
void project(const T* const* rows, int64_t n_rows, const T* weight, int64_t width, int64_t k, float* scratch) {
  Sums sums;
  for (int64_t c = 0; c < width; c += kTileCols) {
    const int64_t cols = std::min<int64_t>(kTileCols, width - c);
    dot_fn<T>(n_rows, cols)(rows, weight + c * k, k, sums);
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t j = 0; j < cols; ++j) scratch[r * kBlockCols + c + j] = sums[r][j];
  }
}

// Which rows a projection reads: one expert's group in one phase of one call (phases are numbered
// process-wide, so a key is never reused).
struct GroupKey {
  uint64_t phase = 0;
  int64_t expert = -1;
  bool operator==(const GroupKey& other) const { return phase == other.phase && expert == other.expert; }
};

#if defined(RAYPAGE_MOE_AMX)
constexpr int64_t kAmxRows = 16;    // rows of every tile
constexpr int64_t kAmxDepth = 32;   // bf16 values along a tile row (64 bytes)
constexpr int64_t kTileWords = 256;  // a packed tile of rows: 16 pairs x 16 rows, a pair a word
constexpr int64_t kColTiles = kBlockCols / kAmxRows;
// Groups of fewer rows take the dot-product tiles: a tile of 16 rows would be mostly padding.
constexpr int64_t kAmxMinRows = 8;

using raypage::amx_permitted;

// All eight tiles as 16 rows of 64 bytes: C in 0-3 (16 x 16 floats), the rows in 4, weights in 5-6.
inline void configure_tiles() {
  raypage::TileShapes shapes;
  for (int t = 0; t < 8; ++t) {
    shapes.rows[t] = kAmxRows;
    shapes.bytes[t] = 64;
  }
  raypage::configure_tiles(shapes);
}

// A group's rows (k values each, k a multiple of 32) as the B operand of W x^T: per tile of 16 rows
// and step of 32 along k, a tile whose row q holds each row's values 2q and 2q + 1 of the step;
// rows past the group's last are zeros.
template <typename RowPtr>
void pack_rows(int64_t n, RowPtr row_ptr, int64_t k, std::vector<uint32_t>& packed) {
  const int64_t steps = k / kAmxDepth;
  packed.assign(ceil_div(n, kAmxRows) * steps * kTileWords, 0u);
  for (int64_t r = 0; r < n; ++r) {
    const bf16* row = row_ptr(r);
    uint32_t* out = packed.data() + (r / kAmxRows) * steps * kTileWords + r % kAmxRows;
    for (int64_t pair = 0; pair < k / 2; ++pair) {
      uint32_t both;
      std::memcpy(&both, row + 2 * pair, sizeof both);
      out[(pair / 16) * kTileWords + (pair % 16) * kAmxRows] = both;
    }
  }
}

// sums[r * kBlockCols + c] = row r . w[c] for one packed tile of 16 rows and a block's first
// col_tiles * 16 weight rows (k apart): C^T = W x^T on the tiles, the weights loaded as they are
// stored (only the few rows are packed), then transposed back.
inline void amx_block(const bf16* w, int64_t k, int64_t col_tiles, const uint32_t* rows, float* sums) {
  alignas(64) float columns[kColTiles][kAmxRows * kAmxRows];  // per C tile: [column][row]
  const int64_t stride = k * sizeof(bf16);
  asm volatile("" ::: "memory");  // the tile loads read the rows just packed
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < k / kAmxDepth; ++s) {
    const bf16* ws = w + s * kAmxDepth;
    _tile_loadd(4, rows + s * kTileWords, 64);
    _tile_loadd(5, ws, stride);
    _tile_dpbf16ps(0, 5, 4);
    if (col_tiles > 1) {
      _tile_loadd(6, ws + 16 * k, stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (col_tiles > 2) {
      _tile_loadd(5, ws + 32 * k, stride);
      _tile_dpbf16ps(2, 5, 4);
    }
    if (col_tiles > 3) {
      _tile_loadd(6, ws + 48 * k, stride);
      _tile_dpbf16ps(3, 6, 4);
    }
  }
  _tile_stored(0, columns[0], 64);
  _tile_stored(1, columns[1], 64);
  _tile_stored(2, columns[2], 64);
  _tile_stored(3, columns[3], 64);
  asm volatile("" ::: "memory");
  for (int64_t j = 0; j < col_tiles; ++j)
    for (int64_t c = 0; c < kAmxRows; ++c)
      for (int64_t r = 0; r < kAmxRows; ++r) sums[r * kBlockCols + j * kAmxRows + c] = columns[j][c * kAmxRows + r];
}

// project_rows on AMX tiles. A thread's consecutive items are mostly blocks of one expert (items_of
// lists them together), so its rows are packed once for all of them: `group` names the rows.
template <size_t P, typename RowPtr, typename Emit>
void project_rows_amx(int64_t n, RowPtr row_ptr, const std::array<const bf16*, P>& weights, int64_t width,
                      int64_t k, Emit emit, const GroupKey& group) {
  thread_local std::vector<uint32_t> packed;
  thread_local GroupKey packed_group{};
  if (!(packed_group == group)) {
    pack_rows(n, row_ptr, k, packed);
    packed_group = group;
  }
  configure_tiles();
  const int64_t col_tiles = width / kAmxRows, tile_words = k / kAmxDepth * kTileWords;
  alignas(64) float sums[P][kAmxRows * kBlockCols];
  for (int64_t t = 0; t < ceil_div(n, kAmxRows); ++t) {
    for (size_t p = 0; p < P; ++p) amx_block(weights[p], k, col_tiles, packed.data() + t * tile_words, sums[p]);
    for (int64_t r = 0; r < std::min(kAmxRows, n - t * kAmxRows); ++r) {
      std::array<const float*, P> row;
      for (size_t p = 0; p < P; ++p) row[p] = sums[p] + r * kBlockCols;
      emit(t * kAmxRows + r, row);
    }
  }
  _tile_release();  // a thread holding tile state saves and restores 8 KB more on every switch
}
#endif

// emit(r, {sums of each weight block}) for each of a group's n rows (row_ptr(r): its k values):
// the sums over k of the row times each of the `width` rows of every block in `weights` (float32,
// kBlockCols apart).
template <typename T, size_t P, typename RowPtr, typename Emit>
void project_rows(int64_t n, RowPtr row_ptr, const std::array<const T*, P>& weights, int64_t width, int64_t k,
                  Emit emit, const GroupKey& group) {
#if defined(RAYPAGE_MOE_AMX)
  if constexpr (std::is_same_v<T, bf16>) {
    // Tile loads read whole 16-column, 32-value tiles of the weights: only shapes that split into them.
    if (n >= kAmxMinRows && k % kAmxDepth == 0 && width % kAmxRows == 0 && amx_permitted())
      return project_rows_amx(n, row_ptr, weights, width, k, emit, group);
  }
#endif
  alignas(64) float sums[P][kTileRows * kBlockCols];
  for (int64_t row = 0; row < n; row += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, n - row);
    const T* tile[kTileRows];
    for (int64_t r = 0; r < rows; ++r) tile[r] = row_ptr(row + r);
    for (size_t p = 0; p < P; ++p) project(tile, rows, weights[p], width, k, sums[p]);
    for (int64_t r = 0; r < rows; ++r) {
      std::array<const float*, P> sums_of_row;
      for (size_t p = 0; p < P; ++p) sums_of_row[p] = sums[p] + r * kBlockCols;
      emit(row + r, sums_of_row);
    }
  }
}

}  // namespace raypage::moe_tiles
