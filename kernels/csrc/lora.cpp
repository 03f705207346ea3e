// The products of a step's LoRA adapters added to one projection's output: all adapter slots in one call.
//
// torch.ops.raypage.add_lora(out [T, O] (modified), x [T, I], lora_a [S, P * r, I], lora_b [S, O, r],
//     slice_sizes [P], token_order [R] int64, slot_starts [S + 1] int64) -> ()
//   out[t] += B_s (A_s x_t) for each row t = token_order[i] of slot s (slot_starts[s] <= i <
//   slot_starts[s + 1]; each row at most once), where output feature o of part j (slice_sizes[j]
//   features each, in order) reads only the shrink's values [j * r, (j + 1) * r). float32, bf16 or
//   float16, all one dtype, in any layout (the kernel reads rows of contiguous features, which may
//   be strided, and contiguous weights, and copies what comes otherwise).
//
// Why one call: the torch loop runs some ten operators per slot (a gather, the shrink, one expand
// per part, an index_add), each a dispatch and a pass over memory, and rounds to the dtype between
// them. Here each slot's rows are read in place through token_order, and both phases run over all
// slots at once, split over the threads.
//
// Phase 1, the shrink: each slot's rows times A_s, as float32 sums kept in `shrunk` (a row per
// entry of token_order, P * r values), never rounded. Phase 2, the expand: for each output column,
// each row's float32 sum over r of its part's shrink values times B_s's row, added to out's value
// and rounded once to out's dtype. Both phases add exact products in float32; only the order of the
// sums differs from an evaluation in float64, so the result is within about a rounding of out's
// dtype of the exact one.
//
// Kernels. With AMX-BF16 (bf16, and shapes that split into whole tiles: see amx_shrinks and
// amx_expands) both phases run on tiles. The shrink takes C^T = A_s X^T, A_s's rows loaded as
// stored and only the slot's (at most 16) rows of x packed into the pairs the tiles multiply. The
// expand takes C = S B_s^T, B_s's rows turned into pairs once per slot and 16 columns; the float32
// shrink values S enter bf16 tiles split exactly in three, S = hi + mid + lo (each 8 significant
// bits of S's 24), so that the product is S's, not a rounding of it. Elsewhere the shrink runs on
// moe_tiles.h's dot-product tiles (vdpbf16ps for bf16 where the CPU has AVX-512 BF16) and the
// expand on float32 multiply-adds over a transposed block of B_s.
//
// Threads. A call is some tens of microseconds of work, so it is split once, statically (no work
// queue): each thread takes a contiguous share of the slots' blocks of up to 16 rows, of about equal
// cost, and runs both phases for them in one parallel region. A thread so reads only shrink rows it
// computed, and writes whole rows of out that no other thread writes: split by columns instead, with
// two threads writing halves of the same rows, each took a third longer per column than one thread
// alone. Only where there are fewer blocks than threads (a few rows of one adapter, or many
// threads) is the expand split by columns.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "moe_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYPAGE_LORA_AMX 1
#include "amx_tiles.h"
#endif

namespace {

using namespace raypage::moe_tiles;

constexpr int64_t kRowBlock = 16;  // rows of a shrink item: one AMX tile's rows
constexpr int kExpandRows = 4;     // rows that share each load of B in the float32 expand
constexpr int kBlockVecs = static_cast<int>(kBlockCols / 16);  // kBlockCols in vectors of 16 floats

// One call's operands. Row i of the call is out's and x's row token_order[i]; shrunk holds a row of
// shrink_width floats for each.
template <typename T>
struct LoRACall {
  T* out;
  int64_t out_stride;
  const T* x;
  int64_t x_stride;
  const T *lora_a, *lora_b;
  int64_t in_features, out_features, rank, shrink_width;
  std::vector<int64_t> part_starts;  // [P + 1]: the first output column of each part, then O
  const int64_t* token_order;
  float* shrunk;

  const T* a_of(int64_t s) const { return lora_a + s * shrink_width * in_features; }
  const T* b_of(int64_t s) const { return lora_b + s * out_features * rank; }
  T* out_row(int64_t i) const { return out + token_order[i] * out_stride; }
  const T* x_row(int64_t i) const { return x + token_order[i] * x_stride; }
};

// Rows [first, first + rows) of the call, all of slot `slot`.
struct RowRange {
  int64_t slot, first, rows;
};

// out[c] = T(out[c] + sums[c]) for c < n: the one rounding of the added products.
template <typename T>
inline void add_row(const float* sums, int64_t n, T* out) {
  int64_t c = 0;
#if defined(RAYPAGE_SIMD)
  for (; c + kLanes <= n; c += kLanes)
    store_rounded(out + c, round_lanes<T>(add(load_floats(out + c), load_floats(sums + c))));
#endif
  for (; c < n; ++c) out[c] = static_cast<T>(static_cast<float>(out[c]) + sums[c]);
}

#if defined(__AVX512BF16__)
// bf16 sums rounded by the CPU's own conversion, one instruction for 16 values: to nearest even, as
// c10::BFloat16 rounds, but for values below 2^-126 (1.2e-38), which it flushes to zero.
template <>
inline void add_row<bf16>(const float* sums, int64_t n, bf16* out) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 sum = _mm512_add_ps(load_floats(out + c), _mm512_loadu_ps(sums + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
  for (; c < n; ++c) out[c] = static_cast<bf16>(static_cast<float>(out[c]) + sums[c]);
}
#endif


// ---- The shrink on dot-product tiles: any dtype and shape.

template <typename T>
void shrink_rows(const LoRACall<T>& call, int64_t slot, int64_t first, int64_t n) {
  alignas(64) float sums[kTileRows * kBlockCols];
  for (int64_t row = first; row < first + n; row += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, first + n - row);
    const T* tile[kTileRows];
    for (int64_t i = 0; i < rows; ++i) tile[i] = call.x_row(row + i);
    for (int64_t column = 0; column < call.shrink_width; column += kBlockCols) {
      const int64_t width = std::min(kBlockCols, call.shrink_width - column);
      project(tile, rows, call.a_of(slot) + column * call.in_features, width, call.in_features, sums);
      for (int64_t i = 0; i < rows; ++i)
        std::copy(sums + i * kBlockCols, sums + i * kBlockCols + width,
                  call.shrunk + (row + i) * call.shrink_width + column);
    }
  }
}

// ---- The expand in float32 multiply-adds: any dtype and shape.

// bt[q * kBlockCols + c] = b[c * rank + q] as float32 for c < width, zeros for width <= c <
// kBlockCols: a block of B's rows (output columns, rank values each) turned so that a vector of
// the expand holds 16 columns of one rank index.
template <typename T>
void transpose_block(const T* b, int64_t width, int64_t rank, float* bt) {
  std::fill(bt, bt + rank * kBlockCols, 0.f);
  int64_t c = 0;
#if defined(__AVX512F__)
  // 16 columns a gather: of 32-bit pairs (rank indices q, q + 1) for 16-bit types, each gather
  // serving two rank indices; an odd rank's last index is left to the scalar loop (its pair would
  // read past B's end).
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; c + 16 <= width; c += 16) {
    const T* base = b + c * rank;
    if constexpr (std::is_same_v<T, float>) {
      const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(rank)));
      for (int64_t q = 0; q < rank; ++q)
        _mm512_storeu_ps(bt + q * kBlockCols + c, _mm512_i32gather_ps(index, base + q, 4));
    } else {
      const __m512i index = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(rank * sizeof(T))));
      int64_t q = 0;
      for (; q + 2 <= rank; q += 2) {
        const __m512i pairs = _mm512_i32gather_epi32(index, base + q, 1);
        Vec even, odd;
        if constexpr (std::is_same_v<T, bf16>) {  // bf16 is the top half of a float32
          even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
          odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
        } else {
          even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
          odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
        }
        _mm512_storeu_ps(bt + q * kBlockCols + c, even);
        _mm512_storeu_ps(bt + (q + 1) * kBlockCols + c, odd);
      }
      for (; q < rank; ++q)
        for (int64_t j = 0; j < 16; ++j) bt[q * kBlockCols + c + j] = static_cast<float>(base[j * rank + q]);
    }
  }
#endif
  for (; c < width; ++c)
    for (int64_t q = 0; q < rank; ++q) bt[q * kBlockCols + c] = static_cast<float>(b[c * rank + q]);
}

// sums[i][c] = sum over q < rank of s[i][q] * bt[q * kBlockCols + c] for Rows rows and the first
// Vecs * 16 columns: the expand of a tile of rows, float32 throughout.
template <int Rows, int Vecs>
void expand_tile(const float* const* s, const float* bt, int64_t rank, float (*sums)[kBlockCols]) {
#if defined(RAYPAGE_SIMD)
  constexpr int kVecs = Vecs * 16 / kLanes;  // Vecs counts 16 floats: one AVX-512 vector, two AVX2 ones
  Vec acc[Rows][kVecs];
  for (int i = 0; i < Rows; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = set1(0.f);
  for (int64_t q = 0; q < rank; ++q) {
    Vec column[kVecs];
    for (int v = 0; v < kVecs; ++v) column[v] = load_floats(bt + q * kBlockCols + v * kLanes);
    for (int i = 0; i < Rows; ++i) {
      const Vec value = set1(s[i][q]);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = fmadd(value, column[v], acc[i][v]);
    }
  }
  for (int i = 0; i < Rows; ++i)
    for (int v = 0; v < kVecs; ++v) store_floats(sums[i] + v * kLanes, acc[i][v]);
#else
  for (int i = 0; i < Rows; ++i)
    for (int64_t c = 0; c < Vecs * 16; ++c) {
      float sum = 0.f;
      for (int64_t q = 0; q < rank; ++q) sum += s[i][q] * bt[q * kBlockCols + c];
      sums[i][c] = sum;
    }
#endif
}

using ExpandFn = void (*)(const float* const*, const float*, int64_t, float (*)[kBlockCols]);

template <int Rows, int... Vecs>
constexpr std::array<ExpandFn, kBlockVecs> expand_row(std::integer_sequence<int, Vecs...>) {
  return {&expand_tile<Rows, Vecs + 1>...};
}

template <int... Rows>
constexpr std::array<std::array<ExpandFn, kBlockVecs>, kExpandRows> expand_table(std::integer_sequence<int, Rows...>) {
  return {expand_row<Rows + 1>(std::make_integer_sequence<int, kBlockVecs>{})...};
}

// The tile for `rows` rows (1 to kExpandRows) and `width` columns (1 to kBlockCols, rounded up to
// whole vectors: bt's columns past the block's width are zeros).
ExpandFn expand_fn(int64_t rows, int64_t width) {
  static constexpr auto table = expand_table(std::make_integer_sequence<int, kExpandRows>{});
  return table[rows - 1][(width + 15) / 16 - 1];
}

// Output columns [column, column + width) of part `part`, for the rows of `ranges`.
template <typename T>
void expand_block(const LoRACall<T>& call, const std::vector<RowRange>& ranges, int64_t part, int64_t column,
                  int64_t width) {
  thread_local std::vector<float> bt;
  bt.resize(call.rank * kBlockCols);
  alignas(64) float sums[kExpandRows][kBlockCols];
  for (const RowRange& range : ranges) {
    transpose_block(call.b_of(range.slot) + column * call.rank, width, call.rank, bt.data());
    const int64_t end = range.first + range.rows;
    for (int64_t first = range.first; first < end; first += kExpandRows) {
      const int64_t rows = std::min<int64_t>(kExpandRows, end - first);
      const float* s[kExpandRows];
      for (int64_t i = 0; i < rows; ++i) s[i] = call.shrunk + (first + i) * call.shrink_width + part * call.rank;
      expand_fn(rows, width)(s, bt.data(), call.rank, sums);
      for (int64_t i = 0; i < rows; ++i) add_row(sums[i], width, call.out_row(first + i) + column);
    }
  }
}

// ---- Both phases on AMX tiles (bf16).

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

// A block of rows costs its rows plus about this many more: B's columns turned for its slot.
constexpr int64_t kBlockOverheadRows = 8;

// Blocks [begin, end) of `blocks` (in slot order) as ranges of rows, one a slot.
std::vector<RowRange> ranges_of(const std::vector<RowRange>& blocks, int64_t begin, int64_t end) {
  std::vector<RowRange> ranges;
  for (int64_t i = begin; i < end; ++i) {
    if (!ranges.empty() && ranges.back().slot == blocks[i].slot)
      ranges.back().rows += blocks[i].rows;
    else
      ranges.push_back(blocks[i]);
  }
  return ranges;
}

template <typename T>
void run_lora(const LoRACall<T>& call, const std::vector<RowRange>& slots) {
  bool shrink_on_tiles = false, expand_on_tiles = false;
#if defined(RAYPAGE_LORA_AMX)
  if constexpr (std::is_same_v<T, bf16>) {
    shrink_on_tiles = amx_shrinks(call.in_features, call.shrink_width);
    expand_on_tiles = amx_expands(call.rank, call.part_starts);
  }
#endif
  auto shrink = [&](const RowRange& block) {
#if defined(RAYPAGE_LORA_AMX)
    if constexpr (std::is_same_v<T, bf16>) {
      if (shrink_on_tiles && block.rows >= kShrinkMinRows) {
        configure_tiles();
        shrink_rows_amx(call, block.slot, block.first, block.rows);
        _tile_release();  // a thread holding tile state saves and restores 8 KB more on every switch
        return;
      }
    }
#endif
    shrink_rows(call, block.slot, block.first, block.rows);
  };
  // Output column tiles [first_tile, end_tile) for the rows of `ranges`: tiles of 16 columns on AMX,
  // of kBlockCols otherwise.
  auto expand = [&](const std::vector<RowRange>& ranges, int64_t first_tile, int64_t end_tile) {
#if defined(RAYPAGE_LORA_AMX)
    if constexpr (std::is_same_v<T, bf16>) {
      if (expand_on_tiles) {
        configure_tiles();
        expand_tiles_amx(call, ranges, first_tile, end_tile);
        _tile_release();
        return;
      }
    }
#endif
    for (int64_t part = 0; part + 1 < static_cast<int64_t>(call.part_starts.size()); ++part) {
      const int64_t begin = std::max(first_tile * kBlockCols, call.part_starts[part]);
      const int64_t end = std::min(end_tile * kBlockCols, call.part_starts[part + 1]);
      for (int64_t c = begin; c < end; c += kBlockCols)
        expand_block(call, ranges, part, c, std::min(kBlockCols, end - c));
    }
  };
  const int64_t tiles = expand_on_tiles ? call.out_features / 16 : (call.out_features + kBlockCols - 1) / kBlockCols;
  std::vector<RowRange> blocks;  // each slot's rows in blocks of up to 16
  for (const RowRange& slot : slots)
    for (int64_t first = slot.first; first < slot.first + slot.rows; first += kRowBlock)
      blocks.push_back({slot.slot, first, std::min(kRowBlock, slot.first + slot.rows - first)});
  const int64_t threads = at::get_num_threads(), count = static_cast<int64_t>(blocks.size());
  if (count >= threads) {
    // Each thread its share of the blocks (contiguous, of about equal cost), both phases: it adds to
    // whole rows of out, which no other thread writes, from shrink rows it computed itself.
    std::vector<int64_t> cost_before{0};
    for (const RowRange& block : blocks) cost_before.push_back(cost_before.back() + block.rows + kBlockOverheadRows);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        // The blocks whose cost midpoints fall in this thread's share of the total.
        auto first_at = [&](int64_t share) {
          const int64_t bound = share * cost_before.back() / threads;
          int64_t i = 0;
          while (i < count && cost_before[i] + cost_before[i + 1] < 2 * bound) ++i;
          return i;
        };
        const int64_t first = first_at(t), last = first_at(t + 1);
        if (first == last) continue;
        for (int64_t i = first; i < last; ++i) shrink(blocks[i]);
        expand(ranges_of(blocks, first, last), 0, tiles);
      }
    });
    return;
  }
  // Fewer blocks than threads (a few rows of one adapter, or many threads): a block a thread for the
  // shrink, the expand split by columns.
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) shrink(blocks[i]);
  });
  const int64_t shares = std::min(threads, tiles);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) expand(slots, t * tiles / shares, (t + 1) * tiles / shares);
  });
}

void add_lora(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& lora_a_in, const at::Tensor& lora_b_in,
              at::IntArrayRef slice_sizes, const at::Tensor& token_order_in, const at::Tensor& slot_starts_in) {
  const auto dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "add_lora: out must be float32, bf16 or float16, got ", dtype);
  TORCH_CHECK(out.dim() == 2, "add_lora: out must be [tokens, out_features], got shape ", out.sizes());
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == out.size(0) && x_in.scalar_type() == dtype, "add_lora: x must be [",
              out.size(0), ", in_features] of out's dtype, got ", x_in.scalar_type(), " of shape ", x_in.sizes());
  // Layouts are taken as they come (a copy where the kernel needs another), so that the caller checks none.
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor lora_a = lora_a_in.contiguous(), lora_b = lora_b_in.contiguous();
  const at::Tensor token_order = token_order_in.contiguous(), slot_starts = slot_starts_in.contiguous();
  const int64_t in_features = x.size(1), out_features = out.size(1), parts = static_cast<int64_t>(slice_sizes.size());
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(1) == out_features && lora_b.scalar_type() == dtype,
              "add_lora: lora_b must be [slots, ", out_features, ", rank] of out's dtype, got ", lora_b.scalar_type(),
              " of shape ", lora_b.sizes());
  const int64_t slots = lora_b.size(0), rank = lora_b.size(2);
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(0) == slots && lora_a.size(1) == parts * rank &&
                  lora_a.size(2) == in_features && lora_a.scalar_type() == dtype,
              "add_lora: lora_a must be [", slots, ", ", parts * rank, ", ", in_features, "] of out's dtype, got ",
              lora_a.scalar_type(), " of shape ", lora_a.sizes());
  std::vector<int64_t> part_starts{0};
  for (const int64_t size : slice_sizes) {
    TORCH_CHECK(size >= 0, "add_lora: slice sizes must not be negative");
    part_starts.push_back(part_starts.back() + size);
  }
  TORCH_CHECK(parts > 0 && part_starts.back() == out_features, "add_lora: slice_sizes ", slice_sizes,
              " must sum to ", out_features);
  TORCH_CHECK(slot_starts.dim() == 1 && slot_starts.numel() == slots + 1 && slot_starts.scalar_type() == at::kLong,
              "add_lora: slot_starts must be int64 [", slots + 1, "]");
  TORCH_CHECK(token_order.dim() == 1 && token_order.scalar_type() == at::kLong, "add_lora: token_order must be int64");
  const int64_t* starts = slot_starts.const_data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[slots] == token_order.numel(),
              "add_lora: slot_starts must run from 0 to token_order's length");
  std::vector<RowRange> active;  // the slots with rows
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(starts[s] <= starts[s + 1], "add_lora: slot_starts must not decrease");
    if (starts[s + 1] > starts[s]) active.push_back({s, starts[s], starts[s + 1] - starts[s]});
  }
  const int64_t* order = token_order.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < token_order.numel(); ++i)
    TORCH_CHECK(order[i] >= 0 && order[i] < out.size(0), "add_lora: token_order holds row ", order[i], " of ",
                out.size(0));
  if (token_order.numel() == 0 || rank == 0) return;
  // The shrink's float32 rows, kept by the calling thread from call to call (a decode step makes
  // some hundred calls of the same few sizes).
  thread_local std::vector<float> shrunk;
  shrunk.resize(token_order.numel() * parts * rank);
  at::Tensor target = out.stride(1) == 1 ? out : out.contiguous();  // the rows the kernel adds to
  auto run = [&](auto tag) {
    using T = decltype(tag);
    run_lora<T>(LoRACall<T>{target.mutable_data_ptr<T>(), target.stride(0), x.const_data_ptr<T>(), x.stride(0),
                            lora_a.const_data_ptr<T>(), lora_b.const_data_ptr<T>(), in_features, out_features, rank,
                            parts * rank, part_starts, order, shrunk.data()},
                active);
  };
  if (dtype == at::kFloat) run(float{});
  if (dtype == at::kBFloat16) run(bf16{});
  if (dtype == at::kHalf) run(c10::Half{});
  if (!target.is_same(out)) out.copy_(target);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def(
      "add_lora(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, int[] slice_sizes, Tensor token_order, "
      "Tensor slot_starts) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("add_lora", &add_lora); }
