// bf16 linear layers on AVX-512 BF16 (`vdpbf16ps`), over weights packed once at load into panels.
//
// torch.ops.raypage.pack_panels(weight [shards * N, K], shards) -> packed [shards, N / 16, K / 2, 32]:
//     each shard (a row block: gate and up of a fused MLP projection) rearranged on its own; the
//     shape says shards, N and K, the layout is below
// torch.ops.raypage.panel_linear(input [..., K], packed, bias?) -> input @ weight.T + bias, bf16
// torch.ops.raypage.panel_silu_and_mul(input [..., K], packed of 2 shards) -> silu(input @ gate.T) *
//     (input @ up.T), bf16 [..., N]: the SiLU-and-multiply of the MLP as the product's epilogue
// torch.ops.raypage.panel_linear_serves() -> whether this build has the kernel (AVX-512 BF16, no
//     AMX: there oneDNN's tile matmuls are several times faster)
//
// Why not oneDNN: on a 2-core AVX-512 BF16 EPYC its brgemm ran SmolLM2's decode projections (64 rows,
// weights streamed from memory) slower than this kernel, and prefill-sized ones no faster
// (`python -m benchmarks.bench_linear`; docs/performance.md has the figures).
//
// Layout. A shard's output columns come in panels of kPanel = 48 (three 16-lane vectors); within a
// panel, for each pair of input columns (k, k+1), the columns' two weights sit side by side:
// [pair][column][2], which is what `vdpbf16ps` multiplies against one broadcast pair of an input
// row. A panel is contiguous (K * 48 values, less for a shard's last one), panels follow one another,
// so the weights stream in order. N must be a multiple of 16, K a multiple of 2.
//
// Work. A tile is up to 8 rows by one panel: 8 x 3 vector accumulators in registers over all of K,
// rounded to bf16 once at the end (plus the bias, in float32), as oneDNN and torch round. The items
// shared among threads are (row chunk, panel): each thread runs a contiguous range of them, all row
// tiles of a chunk against one panel while the panel is hot, and prefetches the next item's panel
// into L2 while it computes, spread over the current item's tiles: decode-sized batches otherwise
// wait on memory for each new panel. Row chunks keep a chunk of the input in L2 (about 288 KB)
// while the panels pass. The fused SiLU-and-multiply item takes a gate panel and the up panel of
// the same columns: each row tile of the gate goes through SiLU into a scratch tile, which the up
// tile's epilogue multiplies, so neither projection's output is ever written out.
//
// Numerics: every product of two bf16 values is exact in float32 and the sums are float32, so
// results differ from a float64 product rounded to bf16 only where the float32 summation order
// tips the rounding (tests/kernels/test_linear.py). The fused epilogue rounds where torch's
// silu_and_mul does: each projection to bf16, SiLU to bf16, the product to bf16 (fused_ops.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
#define RAYPAGE_PANEL_GEMM 1
#endif

namespace {

constexpr int64_t kVec = 16;                   // float32 lanes: output columns per vector
constexpr int64_t kPanelVecs = 3;              // 8 rows x 3 vectors = 24 of the 32 vector registers
constexpr int64_t kPanel = kVec * kPanelVecs;  // output columns per panel
constexpr int64_t kTileRows = 8;
constexpr int64_t kChunkBytes = 288 * 1024;  // input rows per chunk: about this much of L2
constexpr int64_t kLine = 64;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool panel_linear_serves() {
#if defined(RAYPAGE_PANEL_GEMM)
  return true;
#else
  return false;
#endif
}

// A packed weight's sizes: shards of `n` output columns over `k` inputs.
struct PackedShape {
  int64_t shards, n, k;
};

PackedShape check_packed(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(3) == 2 * kVec && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(),
              op, ": packed must be pack_panels' output, a contiguous bf16 [shards, N / 16, K / 2, 32], got ",
              packed.scalar_type(), " of shape ", packed.sizes());
  return {packed.size(0), packed.size(1) * kVec, packed.size(2) * 2};
}

at::Tensor pack_panels(const at::Tensor& weight, int64_t shards) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "pack_panels: the weight must be a contiguous 2-D bf16 tensor, got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  TORCH_CHECK(shards >= 1 && weight.size(0) % (shards * kVec) == 0 && weight.size(1) % 2 == 0,
              "pack_panels: the weight's output size must split into ", shards,
              " shards of a multiple of 16 each, and its input size be even, got ", weight.sizes());
  const int64_t n = weight.size(0) / shards, k = weight.size(1);
  at::Tensor packed = at::empty({shards, n / kVec, k / 2, 2 * kVec}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, shards * n, kVec, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t shard = row / n, column = row % n, panel = column / kPanel;
      const int64_t width = std::min(kPanel, n - panel * kPanel);  // this panel's columns
      uint16_t* base = dst + shard * n * k + panel * kPanel * k;
      for (int64_t i = 0; i < k; ++i) base[((i / 2) * width + column % kPanel) * 2 + i % 2] = src[row * k + i];
    }
  });
  return packed;
}

#if defined(RAYPAGE_PANEL_GEMM)

using namespace raypage::simd;
using bf16 = c10::BFloat16;

// What a tile does with its sums: store them (kStore); keep round(silu(round(sum))) in a float
// scratch tile of kPanel columns (kGate); store round(scratch * round(sum)) (kGated).
enum class Epilogue { kStore, kGate, kGated };

// out[Rows, Vecs * 16] = a[Rows, K] x panel (+ bias), a's rows `lda` apart, out's `ldc` apart.
// Meanwhile the tile brings up to `prefetch_lines` cache lines from `prefetch` into L2, one every
// other pair of input columns: a share of the next panel when an item has four tiles or more (a
// panel has three lines a pair), the start of it with fewer (the hardware's prefetcher follows the
// rest). A finer spread, or a struct for the two arguments, made the loop slower.
template <int Rows, int Vecs, Epilogue kEpilogue>
void tile(const bf16* a, int64_t lda, const uint16_t* panel, int64_t pairs, const float* bias, bf16* out,
          int64_t ldc, float* gate, const char* prefetch, int64_t prefetch_lines) {
  __m512 acc[Rows][Vecs];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v) acc[r][v] = bias ? _mm512_loadu_ps(bias + v * kVec) : _mm512_setzero_ps();
  int64_t fetched = 0;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh w[Vecs];
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + (pair * Vecs + v) * kVec * 2);
    if ((pair & 1) == 0 && fetched < prefetch_lines) {
      _mm_prefetch(prefetch + fetched * kLine, _MM_HINT_T1);
      ++fetched;
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * lda + 2 * pair));
#pragma GCC unroll 3
      for (int v = 0; v < Vecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, w[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v) {
      const __m512 sum = round_lanes<bf16>(acc[r][v]);
      float* scratch = gate + r * kPanel + v * kVec;
      if constexpr (kEpilogue == Epilogue::kStore) store_rounded(out + r * ldc + v * kVec, sum);
      if constexpr (kEpilogue == Epilogue::kGate) store_floats(scratch, round_lanes<bf16>(silu_lanes(sum)));
      if constexpr (kEpilogue == Epilogue::kGated) {
        store_rounded(out + r * ldc + v * kVec, round_lanes<bf16>(mul(load_floats(scratch), sum)));
      }
    }
  }
}

using TileFn = void (*)(const bf16*, int64_t, const uint16_t*, int64_t, const float*, bf16*, int64_t, float*,
                        const char*, int64_t);

template <Epilogue kEpilogue, int Vecs, int... Rows>
constexpr auto tiles_of(std::integer_sequence<int, Rows...>) {
  return std::array<TileFn, sizeof...(Rows)>{&tile<Rows + 1, Vecs, kEpilogue>...};
}

// tile_table<E>()[vecs - 1][rows - 1]
template <Epilogue kEpilogue>
const std::array<std::array<TileFn, kTileRows>, kPanelVecs>& tile_table() {
  static const std::array<std::array<TileFn, kTileRows>, kPanelVecs> table = {
      tiles_of<kEpilogue, 1>(std::make_integer_sequence<int, kTileRows>{}),
      tiles_of<kEpilogue, 2>(std::make_integer_sequence<int, kTileRows>{}),
      tiles_of<kEpilogue, 3>(std::make_integer_sequence<int, kTileRows>{}),
  };
  return table;
}

// One shard's panels of a packed weight.
struct Panels {
  const uint16_t* data;
  int64_t n, k;
  int64_t count() const { return ceil_div(n, kPanel); }
  int64_t width(int64_t panel) const { return std::min(kPanel, n - panel * kPanel); }
  const uint16_t* start(int64_t panel) const { return data + panel * kPanel * k; }
  int64_t lines(int64_t panel) const { return width(panel) * k * 2 / kLine; }
};

// One panel's part of an item, a row tile at a time; tile t of `tiles` prefetches its share of the
// next item's panel in the same role (`next`, nullptr at the end of the thread's range).
template <Epilogue kEpilogue>
struct PanelPass {
  const Panels& panels;
  const float* bias;  // of these panels' shard, or nullptr

  void tile(const bf16* a, int64_t k, int64_t row, int64_t rows, int64_t panel, int64_t t, int64_t tiles,
            const int64_t* next, bf16* out, int64_t ldc, float* gate) const {
    const int64_t next_lines = next ? panels.lines(*next) : 0;
    const int64_t lines_per_tile = ceil_div(next_lines, tiles);
    const int64_t first_line = std::min(next_lines, t * lines_per_tile);
    const char* prefetch = next ? reinterpret_cast<const char*>(panels.start(*next)) + first_line * kLine : nullptr;
    tile_table<kEpilogue>()[panels.width(panel) / kVec - 1][rows - 1](
        a + row * k, k, panels.start(panel), k / 2, bias ? bias + panel * kPanel : nullptr,
        out ? out + row * ldc + panel * kPanel : nullptr, ldc, gate, prefetch,
        std::min(lines_per_tile, next_lines - first_line));
  }
};

// The row tiles of rows [begin, end): body(t, tiles, row, rows).
template <typename Body>
void for_each_tile(int64_t begin, int64_t end, Body body) {
  const int64_t tiles = ceil_div(end - begin, kTileRows);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t row = begin + t * kTileRows;
    body(t, tiles, row, std::min(kTileRows, end - row));
  }
}

// Rows per chunk, and the chunks of `rows`: as few chunks as fit the L2 budget, of about equal size,
// because the threads split the items in order and one short chunk would leave a thread idle (128
// rows of the down projection as 96 + 32 ran at two thirds of the rate of 64 + 64).
std::pair<int64_t, int64_t> row_chunks(int64_t rows, int64_t k) {
  const int64_t most_rows = std::max<int64_t>(kChunkBytes / (k * 2) / kTileRows * kTileRows, kTileRows);
  const int64_t chunks = ceil_div(rows, most_rows);  // rows > 0: the ops return empty inputs early
  const int64_t chunk_rows = ceil_div(ceil_div(rows, chunks), kTileRows) * kTileRows;
  return {chunk_rows, ceil_div(rows, chunk_rows)};
}

// Runs body(row_begin, row_end, panel, next_panel or nullptr) for every (row chunk, panel) item,
// contiguous ranges of them per thread.
template <typename Body>
void for_each_item(int64_t rows, int64_t k, int64_t panels, Body body) {
  const auto [chunk_rows, chunks] = row_chunks(rows, k);
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels, next = (item + 1) % panels;
      const int64_t row_begin = chunk * chunk_rows;
      body(row_begin, std::min(rows, row_begin + chunk_rows), panel, item + 1 < end ? &next : nullptr);
    }
  });
}

void run_linear(const bf16* a, int64_t rows, const uint16_t* packed, PackedShape shape, const float* bias,
                bf16* out) {
  const int64_t ldc = shape.shards * shape.n;
  for (int64_t shard = 0; shard < shape.shards; ++shard) {  // shards one after another: each spans the threads
    const Panels panels{packed + shard * shape.n * shape.k, shape.n, shape.k};
    const PanelPass<Epilogue::kStore> pass{panels, bias ? bias + shard * shape.n : nullptr};
    for_each_item(rows, shape.k, panels.count(), [&](int64_t begin, int64_t end, int64_t panel, const int64_t* next) {
      for_each_tile(begin, end, [&](int64_t t, int64_t tiles, int64_t row, int64_t tile_rows) {
        pass.tile(a, shape.k, row, tile_rows, panel, t, tiles, next, out + shard * shape.n, ldc, nullptr);
      });
    });
  }
}

// Each item is a gate panel and the up panel of the same columns; each row tile runs through the
// gate into a scratch tile, then through the up panel, whose epilogue multiplies the two.
void run_silu_and_mul(const bf16* a, int64_t rows, const uint16_t* packed, PackedShape shape, bf16* out) {
  const Panels gate_panels{packed, shape.n, shape.k}, up_panels{packed + shape.n * shape.k, shape.n, shape.k};
  const PanelPass<Epilogue::kGate> gate_pass{gate_panels, nullptr};
  const PanelPass<Epilogue::kGated> up_pass{up_panels, nullptr};
  for_each_item(rows, shape.k, gate_panels.count(), [&](int64_t begin, int64_t end, int64_t panel,
                                                         const int64_t* next) {
    alignas(64) float gate[kTileRows * kPanel];
    for_each_tile(begin, end, [&](int64_t t, int64_t tiles, int64_t row, int64_t tile_rows) {
      gate_pass.tile(a, shape.k, row, tile_rows, panel, t, tiles, next, nullptr, shape.n, gate);
      up_pass.tile(a, shape.k, row, tile_rows, panel, t, tiles, next, out, shape.n, gate);
    });
  });
}

#endif  // RAYPAGE_PANEL_GEMM

// input as contiguous rows of k features, and the output tensor [..., n_out] to fill.
std::pair<at::Tensor, at::Tensor> rows_and_output(const at::Tensor& input, int64_t k, int64_t n_out,
                                                  const char* op) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() >= 1 && input.size(-1) == k, op,
              ": input must be bf16 with ", k, " features, got ", input.scalar_type(), " of shape ", input.sizes());
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = n_out;
  return {input.reshape({-1, k}).contiguous(), at::empty(out_shape, input.options())};
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const PackedShape shape = check_packed(packed, "panel_linear");
  const int64_t n_out = shape.shards * shape.n;
  auto [rows, out] = rows_and_output(input, shape.k, n_out, "panel_linear");
  if (rows.size(0) == 0) return out;
#if defined(RAYPAGE_PANEL_GEMM)
  at::Tensor bias_float;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n_out, "panel_linear: bias must have ", n_out, " values, got ", bias->numel());
    bias_float = bias->to(at::kFloat).contiguous();
  }
  run_linear(rows.const_data_ptr<bf16>(), rows.size(0), reinterpret_cast<const uint16_t*>(packed.data_ptr()), shape,
             bias.has_value() ? bias_float.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<bf16>());
  return out;
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX-512 BF16 panel kernel (see panel_linear_serves)");
#endif
}

at::Tensor panel_silu_and_mul(const at::Tensor& input, const at::Tensor& packed) {
  const PackedShape shape = check_packed(packed, "panel_silu_and_mul");
  TORCH_CHECK(shape.shards == 2, "panel_silu_and_mul: packed must hold two shards (gate, up), got ", shape.shards);
  auto [rows, out] = rows_and_output(input, shape.k, shape.n, "panel_silu_and_mul");
  if (rows.size(0) == 0) return out;
#if defined(RAYPAGE_PANEL_GEMM)
  run_silu_and_mul(rows.const_data_ptr<bf16>(), rows.size(0), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                   shape, out.mutable_data_ptr<bf16>());
  return out;
#else
  TORCH_CHECK(false, "panel_silu_and_mul: this build has no AVX-512 BF16 panel kernel (see panel_linear_serves)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("pack_panels(Tensor weight, int shards=1) -> Tensor");
  m.def("panel_linear(Tensor input, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("panel_silu_and_mul(Tensor input, Tensor packed) -> Tensor");
  m.def("panel_linear_serves() -> bool", &panel_linear_serves);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_silu_and_mul", &panel_silu_and_mul);
}
