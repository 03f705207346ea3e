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
// amx_expands in lora_amx.h) both phases run on tiles. The shrink takes C^T = A_s X^T, A_s's rows loaded as
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

#include "lora_amx.h"
#include "lora_call.h"

namespace {

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
