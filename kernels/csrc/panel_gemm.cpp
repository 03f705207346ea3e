// bf16 linear layers on AVX-512 BF16 (`vdpbf16ps`), over weights packed once at load into panels.
//
// torch.ops.raypage.pack_panels(weight [N, K]) -> packed: the same values rearranged, as a bf16
//     tensor of shape [N / 16, K / 2, 32] (which says N and K; the layout is below)
// torch.ops.raypage.panel_linear(input [..., K], packed, bias?) -> input @ weight.T + bias, bf16
// torch.ops.raypage.panel_linear_serves() -> whether this build has the kernel (AVX-512 BF16, no
//     AMX: there oneDNN's tile matmuls are several times faster)
//
// Why not oneDNN: on a 2-core AVX-512 BF16 EPYC its brgemm ran SmolLM2's decode projections (64 rows,
// weights streamed from memory) at 250-620 GFLOP/s against 420-800 here, and prefill-sized ones
// (2,048 rows) at 620-780 against 770-850 (docs/performance.md, "Panel GEMM").
//
// Layout. Output columns come in panels of kPanel = 48 (three 16-lane vectors); within a panel, for
// each pair of input columns (k, k+1), the 48 columns' two weights sit side by side: [pair][column][2],
// which is what `vdpbf16ps` multiplies against one broadcast pair of an input row. A panel is
// contiguous (K * 48 values), and panels follow one another, so the weights stream in order. N must
// be a multiple of 16 (the last panel may hold one or two vectors), K a multiple of 2.
//
// Work. A tile is up to 8 rows by one panel: 8 x 3 vector accumulators in registers over all of K,
// rounded to bf16 once at the end (plus the bias, in float32), as oneDNN and torch round. The items
// shared among threads are (row chunk, panel): each thread runs a contiguous range of them, all row
// tiles of a chunk against one panel while the panel is hot, and prefetches the next item's panel
// into L2 while it computes, spread over the current item's tiles, because decode-sized batches
// otherwise wait on memory for each new panel. Row chunks keep a chunk of the input in L2 (about
// 512 KB) while the panels pass.
//
// Numerics: every product of two bf16 values is exact in float32 and the sums are float32, so
// results differ from a float64 product rounded to bf16 only where the float32 summation order
// tips the rounding (tests/unit/test_cpu_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
#define RAYPAGE_PANEL_GEMM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kVec = 16;                  // float32 lanes: output columns per vector
constexpr int64_t kPanelVecs = 3;             // 8 rows x 3 vectors = 24 of the 32 vector registers
constexpr int64_t kPanel = kVec * kPanelVecs;  // output columns per panel
constexpr int64_t kTileRows = 8;
constexpr int64_t kChunkBytes = 288 * 1024;  // input rows per chunk: about this much of L2
constexpr int64_t kLine = 64;

bool panel_linear_serves() {
#if defined(RAYPAGE_PANEL_GEMM)
  return true;
#else
  return false;
#endif
}

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "pack_panels: the weight must be a contiguous 2-D bf16 tensor, got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  TORCH_CHECK(weight.size(0) % kVec == 0 && weight.size(1) % 2 == 0,
              "pack_panels: the weight's output size must be a multiple of 16 and its input size even, got ",
              weight.sizes());
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kVec && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(),
              "panel_linear: packed must be pack_panels' output, a contiguous bf16 tensor [N / 16, K / 2, 32], got ",
              packed.scalar_type(), " of shape ", packed.sizes());
}

at::Tensor pack_panels(const at::Tensor& weight) {
  check_weight(weight);
  const int64_t n_out = weight.size(0), k_in = weight.size(1);
  at::Tensor packed = at::empty({n_out / kVec, k_in / 2, 2 * kVec}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, n_out, kVec, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t panel = n / kPanel, column = n % kPanel;
      const int64_t width = std::min(kPanel, n_out - panel * kPanel);  // this panel's columns
      uint16_t* base = dst + panel * kPanel * k_in;
      for (int64_t k = 0; k < k_in; ++k) base[((k / 2) * width + column) * 2 + k % 2] = src[n * k_in + k];
    }
  });
  return packed;
}

#if defined(RAYPAGE_PANEL_GEMM)

// Lanes of x rounded to bf16, to nearest even (c10::BFloat16's rounding of finite values), narrowed.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// out[Rows, Vecs * 16] = a[Rows, K] x panel, a's rows `lda` apart, out's `ldc` apart. Meanwhile the
// tile brings `prefetch_lines` cache lines from `prefetch` (the next item's panel) into L2, one
// every other pair of input columns. (Two plain arguments: a struct of them, passed on the stack,
// cost 4-13% here.)
template <int Rows, int Vecs>
void tile(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs, const float* bias,
          uint16_t* out, int64_t ldc, const char* prefetch, int64_t prefetch_lines) {
  __m512 acc[Rows][Vecs];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v) acc[r][v] = bias ? _mm512_loadu_ps(bias + v * kVec) : _mm512_setzero_ps();
  int64_t fetched = 0;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh w[Vecs];
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v)
      w[v] = (__m512bh)_mm512_loadu_si512(panel + (pair * Vecs + v) * kVec * 2);
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
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < Vecs; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + v * kVec), to_bf16(acc[r][v]));
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                        const char*, int64_t);

template <int Vecs, int... Rows>
constexpr auto tiles_of(std::integer_sequence<int, Rows...>) {
  return std::array<TileFn, sizeof...(Rows)>{&tile<Rows + 1, Vecs>...};
}

// kTiles[vecs - 1][rows - 1]
const std::array<std::array<TileFn, kTileRows>, kPanelVecs> kTiles = {
    tiles_of<1>(std::make_integer_sequence<int, kTileRows>{}),
    tiles_of<2>(std::make_integer_sequence<int, kTileRows>{}),
    tiles_of<3>(std::make_integer_sequence<int, kTileRows>{}),
};

void run_panels(const uint16_t* a, int64_t rows, int64_t k_in, const uint16_t* packed, int64_t n_out,
                const float* bias, uint16_t* out) {
  const int64_t pairs = k_in / 2;
  const int64_t panels = (n_out + kPanel - 1) / kPanel;
  const int64_t chunk_rows = std::clamp<int64_t>(kChunkBytes / (k_in * 2) / kTileRows * kTileRows, kTileRows, rows);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  auto panel_start = [&](int64_t panel) { return packed + panel * kPanel * k_in; };
  auto panel_width = [&](int64_t panel) { return std::min(kPanel, n_out - panel * kPanel); };
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels;
      const int64_t row_begin = chunk * chunk_rows, row_end = std::min(rows, row_begin + chunk_rows);
      const int64_t width = panel_width(panel), vecs = width / kVec;
      const int64_t tiles = (row_end - row_begin + kTileRows - 1) / kTileRows;
      // The next item's panel, a share of it per tile.
      const int64_t next_panel = (item + 1) % panels;
      const int64_t next_lines = item + 1 < end ? panel_width(next_panel) * k_in * 2 / kLine : 0;
      const int64_t lines_per_tile = (next_lines + tiles - 1) / tiles;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t row = row_begin + t * kTileRows;
        const int64_t tile_rows = std::min(kTileRows, row_end - row);
        const int64_t first_line = std::min(next_lines, t * lines_per_tile);
        kTiles[vecs - 1][tile_rows - 1](a + row * k_in, k_in, panel_start(panel), pairs,
                                        bias ? bias + panel * kPanel : nullptr, out + row * n_out + panel * kPanel,
                                        n_out, reinterpret_cast<const char*>(panel_start(next_panel)) + first_line * kLine,
                                        std::min(lines_per_tile, next_lines - first_line));
      }
    }
  });
}

#endif  // RAYPAGE_PANEL_GEMM

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_packed(packed);
  const int64_t n_out = packed.size(0) * kVec, k_in = packed.size(1) * 2;
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.size(-1) == k_in, "panel_linear: input must be bf16 with ",
              k_in, " features, got ", input.scalar_type(), " of shape ", input.sizes());
  const at::Tensor rows = input.reshape({-1, k_in}).contiguous();
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = n_out;
  at::Tensor out = at::empty(out_shape, input.options());
  if (rows.size(0) == 0) return out;
#if defined(RAYPAGE_PANEL_GEMM)
  at::Tensor bias_float;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n_out, "panel_linear: bias must have ", n_out, " values, got ", bias->numel());
    bias_float = bias->to(at::kFloat).contiguous();
  }
  run_panels(reinterpret_cast<const uint16_t*>(rows.data_ptr()), rows.size(0), k_in,
             reinterpret_cast<const uint16_t*>(packed.data_ptr()), n_out,
             bias.has_value() ? bias_float.data_ptr<float>() : nullptr,
             reinterpret_cast<uint16_t*>(out.data_ptr()));
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX-512 BF16 panel kernel (see panel_linear_serves)");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor input, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("panel_linear_serves() -> bool", &panel_linear_serves);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
