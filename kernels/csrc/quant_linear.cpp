// A linear layer computed straight from GGUF's quantized blocks, never widening the weight in memory.
//
// torch.ops.raypage.quant_pack(raw uint8, ggml_type, out_features, in_features) -> (quants, scales)
//   Repacks a weight's GGUF blocks (each row whole blocks, as stored in the file) into the layout
//   below, once at load.
// torch.ops.raypage.quant_gemv(x [M, in], quants, scales, ggml_type, out_features, bias=None) -> [M, out]
//   The decode path, and prefill's where the CPU has no AMX: x (float32 or bf16) quantized to int8
//   once per call, int8 dot products (AMX int8 tiles for 16 rows or more where the CPU has them,
//   else AVX-512 VNNI or AVX2), the weight streamed once for a span of rows; float32 sums plus the
//   bias, rounded once to x's dtype.
// torch.ops.raypage.quant_gemv_uses_tiles() -> bool: whether quant_gemv runs on AMX tiles here.
// torch.ops.raypage.quant_dequantize(quants, scales, ggml_type, first_row, out [in, rows] float32 or bf16)
//   Rows of the weight's values, transposed, as gguf.quants.dequantize gives them (rounded to bf16
//   for a bf16 out); the prefill path multiplies panels of these.
// torch.ops.raypage.quant_embedding(quants, scales, ggml_type, ids int64 [N], out [N, in] float32 or bf16)
//   Rows ids of the weight, as quant_dequantize gives them: an embedding's lookups.
//
// Formats (ggml type ids). Blocks of 32 weights: Q4_0 (2): d * (q - 8), q in 0..15; Q4_1 (3):
// d * q + m; Q8_0 (8): d * q, q int8; d and m float16. K-quants, blocks of 256 in 8 sub-blocks of 32:
// Q4_K (12) and Q5_K (13): (d * sc) * q - dmin * m, q of 4 or 5 bits, d and dmin float16 per 256,
// sc and m 6-bit per 32; Q6_K (14): (d * sc) * (q - 32), q of 6 bits, sc int8 per 16.
//
// Packed layout. Output rows go in groups of kGroupRows = 16 (the last group padded with zero rows),
// one vector of int32 lanes per group: lane r is output row r. The quants of a (group, block of 32)
// are the rows' quant bytes cut into 4-byte words, word j of every row together: bytes [j][r][4], so
// one 64-byte load holds 4 consecutive quant bytes of all 16 rows, exactly what one `vpdpbusd`
// multiplies by 4 activation bytes broadcast to every lane. Q8_0 keeps a byte a quant (8 words a
// block), the others a nibble (4 words: word j's low nibbles are quants 4j..4j+3, its high nibbles
// quants 16+4j..16+4j+3, GGUF's own order for blocks of 32), and Q5_K and Q6_K the quants' high bits
// in 1 or 2 words more (read_block says where). The K-quants' 8-bit scales of a block follow its
// words, 16 bytes each: Q6_K's two int8 sub-scales (one per 16 quants), Q4_K's and Q5_K's sc and m.
// The float16 scales, 16 each per (group, file block: 32 weights, or 256 for K-quants), are their
// own tensor: d; d, m (Q4_1); d, dmin (Q4_K, Q5_K). Kept as float16, the bytes the file has,
// because a decode step is bound by the bytes it reads (16 of them convert in one instruction).
// So the packed weight has the file's bytes, but for the 6-bit sc and m kept a byte each.
//   quants: uint8 [groups, blocks of 32, words * 64 (+ 32 for K-quants)]
//   scales: float16 [groups, file blocks, 1 or 2, 16]
//
// Arithmetic of the decode path: each row of x is quantized per block of 32 to int8 q_x with a
// float32 scale d_x = max|x| / 127, taken over the block for Q4_0, Q4_1 and Q8_0 (llama.cpp's Q8_0
// activations, scale kept in float32) and over the weight's block of 256 for the K-quants (its Q8_K),
// and the sums of its q_x. A block then adds d_w * d_x * sum(q_w * q_x) (+ min_w * d_x * sum(q_x)
// where the format has a min), the integer dot exact in int32, the formats' constant offsets
// subtracted in integers too (and, on AVX-512 VNNI, the K-quants' 8-bit sub-scales and mins applied
// in integers); so activations that are exactly int8 blocks give the float reference up to the
// order of float32 operations.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"

namespace {

using namespace raypage::simd;

constexpr int64_t kBlock = 32;      // weights per block, in every format here
constexpr int64_t kGroupRows = 16;  // output rows per group: one vector of 16 int32 lanes
constexpr int64_t kWordBytes = 4;   // quant bytes per row that one dot-product lane takes at a time
constexpr int64_t kWordRowBytes = kGroupRows * kWordBytes;
constexpr int kRowsPerPass = 4;  // activation rows that share one load of the weights' registers

enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Layout {
  int64_t raw_block_weights;  // weights of one block in the GGUF file: 32, or 256 for K-quants
  int64_t raw_block_bytes;    // bytes of one such block
  int64_t words;              // 4-byte quant words per row and packed block of 32
  int64_t half_scales;        // float16 scales (of 16 rows each) per file block
  int64_t int_scales;         // 8-bit scales (of 16 rows each) after the quant words of a packed block

  int64_t blocks_per_scale() const { return raw_block_weights / kBlock; }
  int64_t group_block_bytes() const { return words * kWordRowBytes + int_scales * kGroupRows; }
};

Layout layout_of(int64_t format) {
  switch (format) {
    case kQ4_0: return {32, 18, 4, 1, 0};
    case kQ4_1: return {32, 20, 4, 2, 0};
    case kQ8_0: return {32, 34, 8, 1, 0};
    case kQ4_K: return {256, 144, 4, 2, 2};
    case kQ5_K: return {256, 176, 5, 2, 2};
    case kQ6_K: return {256, 210, 6, 1, 2};
    default:
      TORCH_CHECK(false, "quant_linear: unsupported ggml type ", format,
                  " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
}

// Q8_0 keeps a byte a quant (8 words a block), the others a nibble (4 words), and Q5_K and Q6_K
// their quants' fifth, or fifth and sixth, bits in 1 or 2 words more.
template <int64_t F>
constexpr bool kBytePerQuant = F == kQ8_0;
template <int64_t F>
constexpr int kHighBits = F == kQ5_K ? 1 : F == kQ6_K ? 2 : 0;
template <int64_t F>
constexpr int64_t kLowWords = kBytePerQuant<F> ? 8 : 4;  // the words of each quant's low byte or nibble
template <int64_t F>
constexpr int64_t kWords = kLowWords<F> + kHighBits<F>;  // layout_of(F).words
template <int64_t F>
constexpr int kNibbles = kBytePerQuant<F> ? 1 : 2;
// Q4_K and Q5_K: weights (d * sc) * q - dmin * m, sc and m 6-bit integers per block of 32.
template <int64_t F>
constexpr bool kScaledMin = F == kQ4_K || F == kQ5_K;
// Formats whose weights add a min per block (Q4_1's m, the K-quants' -dmin * m) to d * q.
template <int64_t F>
constexpr bool kHasMin = F == kQ4_1 || kScaledMin<F>;
// What is subtracted from the unsigned quants the packed layout keeps (Q8_0's are signed).
template <int64_t F>
constexpr int32_t kQuantOffset = F == kQ4_0 ? 8 : F == kQ6_K ? 32 : 0;
// layout_of(F)'s numbers, for the kernels.
template <int64_t F>
constexpr int64_t kHalfScales = F == kQ4_1 || kScaledMin<F> ? 2 : 1;
template <int64_t F>
constexpr int64_t kIntScales = F == kQ6_K || kScaledMin<F> ? 2 : 0;
template <int64_t F>
constexpr int64_t kBlocksPerScale = F == kQ6_K || kScaledMin<F> ? 8 : 1;
template <int64_t F>
constexpr int64_t kGroupBlockBytes = kWords<F> * kWordRowBytes + kIntScales<F> * kGroupRows;

// The kernels see up to 4 scales a block of 32, "slots": d; then Q4_1's m; Q6_K's two sub-scales
// (int8, one per 16 quants); the K-quants' sc, dmin, m. A slot is either a float16 of the scales
// tensor (`index` of its file block's) or an 8-bit integer after the block's quant words.
struct Slot {
  bool integer;
  int index;
};

template <int64_t F>
constexpr Slot slot_of(int slot) {
  if (slot == 0) return {false, 0};
  if constexpr (F == kQ4_1) return {false, 1};
  if constexpr (F == kQ6_K) return {true, slot - 1};
  return slot == 1 ? Slot{true, 0} : slot == 2 ? Slot{false, 1} : Slot{true, 1};
}

// Calls body(std::integral_constant<int64_t, format>{}): the kernels are compiled once a format.
template <typename Body>
void dispatch_format(int64_t format, Body body) {
  switch (format) {
    case kQ4_0: return body(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return body(std::integral_constant<int64_t, kQ4_1>{});
    case kQ8_0: return body(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return body(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return body(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return body(std::integral_constant<int64_t, kQ6_K>{});
    default: layout_of(format);  // raises, naming the type
  }
}

// That quants and scales are quant_pack's output for `format`.
void check_packed(const at::Tensor& quants, const at::Tensor& scales, int64_t format, const char* op) {
  const Layout layout = layout_of(format);
  TORCH_CHECK(quants.dim() == 3 && quants.scalar_type() == at::kByte && quants.is_contiguous() &&
                  quants.size(2) == layout.group_block_bytes() && quants.size(1) % layout.blocks_per_scale() == 0,
              op, ": quants are not a packed ggml type ", format, " weight: ", quants.scalar_type(), " ",
              quants.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({quants.size(0), quants.size(1) / layout.blocks_per_scale(),
                                                     layout.half_scales, kGroupRows}),
              op, ": scales do not match the quants: ", scales.sizes());
}

// ---------------------------------------------------------------------------------------------------
// Repacking

// Block b (of 32 weights) of a row as the packed layout keeps it: its quant bytes in word order and
// its float16 scales.
struct PackedBlock {
  uint8_t quants[kBlock];
  uint16_t halves[2];  // float16 bits: d; d, m; or d, dmin
  uint8_t ints[2];     // Q6_K's int8 sub-scales, or the K-quants' sc and m
};

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K or Q5_K block, from its 12 packed bytes.
std::pair<int, int> k_scale_min(const uint8_t* packed, int64_t j) {
  if (j < 4) return {packed[j] & 63, packed[j + 4] & 63};
  return {(packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)};
}

// The quants of sub-block j of a K-quant block of 256, unsigned, and its scales: Q6_K's d and two
// sub-scales, or the d, dmin and 6-bit sc, m of Q4_K and Q5_K.
void read_k_block(int64_t format, const uint8_t* block, int64_t j, uint8_t* q, PackedBlock& packed) {
  if (format == kQ6_K) {
    // ql[128] (low 4 bits), qh[64] (high 2), 16 int8 sub-scales (one per 16 weights), d. Weight
    // k = 32j + e, h = k / 128, i = k % 128: ql[64h + i % 64] >> 4 (i / 64) and qh[32h + i % 32] >> 2 (i / 32).
    const uint8_t *ql = block, *qh = block + 128;
    for (int64_t e = 0; e < kBlock; ++e) {
      const int64_t k = j * kBlock + e, h = k / 128, i = k % 128;
      q[e] = ((ql[64 * h + i % 64] >> (4 * (i / 64))) & 0x0F) | ((qh[32 * h + i % 32] >> (2 * (i / 32))) & 3) << 4;
    }
    std::memcpy(packed.halves, block + 208, 2);
    for (int half = 0; half < 2; ++half) packed.ints[half] = block[192 + 2 * j + half];
    return;
  }
  // Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, qs[128]: weight e of sub-block j in the low
  // (j even) or high nibble of qs[32 (j / 2) + e]. Q5_K: qh[32] before qs, bit j of qh[e] its fifth bit.
  const uint8_t* qs = block + (format == kQ5_K ? 48 : 16);
  for (int64_t e = 0; e < kBlock; ++e) {
    q[e] = (qs[kBlock * (j / 2) + e] >> (4 * (j % 2))) & 0x0F;
    if (format == kQ5_K) q[e] |= ((block[16 + e] >> j) & 1) << 4;
  }
  const auto [scale, min] = k_scale_min(block + 4, j);
  std::memcpy(packed.halves, block, 4);
  packed.ints[0] = static_cast<uint8_t>(scale);
  packed.ints[1] = static_cast<uint8_t>(min);
}

PackedBlock read_block(int64_t format, const Layout& layout, const uint8_t* row, int64_t b) {
  PackedBlock packed{};
  if (layout.raw_block_weights == kBlock) {  // d (and m) first, then the quants as they are
    const uint8_t* block = row + b * layout.raw_block_bytes;
    std::memcpy(packed.halves, block, 2 * layout.half_scales);
    std::memcpy(packed.quants, block + 2 * layout.half_scales, layout.words * kWordBytes);
    return packed;
  }
  uint8_t q[kBlock];
  read_k_block(format, row + (b / 8) * layout.raw_block_bytes, b % 8, q, packed);
  // Nibbles as GGUF's 32-blocks have them: byte e holds quants e and 16 + e, so word j's byte e
  // holds quants 4j + e + 16 * nibble. Then for Q5_K and Q6_K the high bits: quant 4j + e + 16 * n
  // has number u = j + 4n (0..7), and its bits are bits hb * (u % (8 / hb)) on of byte e of high
  // word u / (8 / hb), hb the high bits a quant.
  for (int64_t e = 0; e < 16; ++e) packed.quants[e] = (q[e] & 0x0F) | (q[16 + e] & 0x0F) << 4;
  const int64_t high_bits = layout.words - 4, per_word = high_bits ? 8 / high_bits : 0;
  for (int64_t u = 0; u < 8 && high_bits; ++u) {
    for (int64_t e = 0; e < kWordBytes; ++e) {
      const int64_t quant = 4 * (u % 4) + e + 16 * (u / 4);
      packed.quants[16 + kWordBytes * (u / per_word) + e] |= (q[quant] >> 4) << (high_bits * (u % per_word));
    }
  }
  return packed;
}

std::tuple<at::Tensor, at::Tensor> quant_pack(const at::Tensor& raw, int64_t format, int64_t out_features,
                                              int64_t in_features) {
  const Layout layout = layout_of(format);
  TORCH_CHECK(in_features > 0 && in_features % layout.raw_block_weights == 0 && out_features > 0,
              "quant_pack: in_features must be a positive multiple of ", layout.raw_block_weights, ", got [",
              out_features, ", ", in_features, "]");
  const int64_t blocks = in_features / kBlock, groups = (out_features + kGroupRows - 1) / kGroupRows;
  const int64_t row_bytes = in_features / layout.raw_block_weights * layout.raw_block_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == out_features * row_bytes,
              "quant_pack: raw must be ", out_features * row_bytes, " contiguous uint8 bytes for [", out_features, ", ",
              in_features, "], got ", raw.numel(), " of ", raw.scalar_type());
  const int64_t group_block_bytes = layout.group_block_bytes(), file_blocks = blocks / layout.blocks_per_scale();
  // Zeros: the padding rows of the last group have zero scales and quants, and produce 0.
  at::Tensor quants = at::zeros({groups, blocks, group_block_bytes}, raw.options());
  at::Tensor scales =
      at::zeros({groups, file_blocks, layout.half_scales, kGroupRows}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  uint8_t* dst = quants.mutable_data_ptr<uint8_t>();
  uint16_t* dst_scales = reinterpret_cast<uint16_t*>(scales.mutable_data_ptr<at::Half>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min(kGroupRows, out_features - g * kGroupRows);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
          const PackedBlock block = read_block(format, layout, src + (g * kGroupRows + r) * row_bytes, b);
          const int64_t file_block = g * file_blocks + b / layout.blocks_per_scale();
          for (int64_t i = 0; i < layout.half_scales; ++i)  // the same for each block of a file block
            dst_scales[(file_block * layout.half_scales + i) * kGroupRows + r] = block.halves[i];
          uint8_t* packed = dst + (g * blocks + b) * group_block_bytes;
          for (int64_t j = 0; j < layout.words; ++j)
            std::memcpy(packed + j * kWordRowBytes + r * kWordBytes, block.quants + j * kWordBytes, kWordBytes);
          for (int64_t i = 0; i < layout.int_scales; ++i)
            packed[layout.words * kWordRowBytes + i * kGroupRows + r] = block.ints[i];
        }
      }
    }
  });
  return {quants, scales};
}

// ---------------------------------------------------------------------------------------------------
// Dequantizing: the prefill path's panels, transposed ([in, rows]: a group's rows are 16 adjacent
// columns, so every vector of 16 lanes of the packed layout is one contiguous store)

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Scale slot `slot` of row r: `halves` the block's float16 scales, `ints` its 8-bit ones.
template <int64_t F>
inline float slot_value(const uint16_t* halves, const uint8_t* ints, int slot, int64_t r) {
  const Slot s = slot_of<F>(slot);
  if (!s.integer) return half_to_float(halves[s.index * kGroupRows + r]);
  const uint8_t bits = ints[s.index * kGroupRows + r];
  return static_cast<float>(F == kQ6_K ? static_cast<int8_t>(bits) : bits);
}

template <typename T>
inline void store_lanes(const float* values, int64_t count, T* out) {
  for (int64_t r = 0; r < count; ++r) out[r] = static_cast<T>(values[r]);
}

// Where quant 4j + e + 16 * nibble keeps its high bits (Q5_K, Q6_K): word kLowWords + the first,
// from the bit the second on, in byte e (see read_block).
template <int64_t F>
constexpr std::pair<int64_t, int> high_bits_at(int64_t j, int nibble) {
  constexpr int per_word = 8 / kHighBits<F>;
  const int u = static_cast<int>(j) + 4 * nibble;
  return {kLowWords<F> + u / per_word, kHighBits<F> * (u % per_word)};
}

inline uint32_t load_word(const uint8_t* block, int64_t j, int64_t r) {
  uint32_t word;
  std::memcpy(&word, block + j * kWordRowBytes + r * kWordBytes, kWordBytes);
  return word;
}

// Quant 4j + e + 16 * nibble of row r of a packed block, its offset subtracted.
template <int64_t F>
inline int32_t quant_of(const uint8_t* block, int64_t r, int64_t j, int e, int nibble) {
  if constexpr (F == kQ8_0) return static_cast<int8_t>(load_word(block, j, r) >> (8 * e));
  uint32_t q = (load_word(block, j, r) >> (8 * e + 4 * nibble)) & 0x0F;
  if constexpr (kHighBits<F> > 0) {
    const auto [word, bit] = high_bits_at<F>(j, nibble);
    q |= ((load_word(block, word, r) >> (8 * e + bit)) & ((1u << kHighBits<F>) - 1)) << 4;
  }
  return static_cast<int32_t>(q) - kQuantOffset<F>;
}

#if defined(__AVX512F__)

// quant_of for all 16 rows of a group, `words` its block's words.
template <int64_t F>
inline __m512i quants_of(const __m512i* words, int64_t j, int e, int nibble) {
  if constexpr (F == kQ8_0)  // byte e to the top, then back down with its sign
    return _mm512_srai_epi32(_mm512_sllv_epi32(words[j], _mm512_set1_epi32(24 - 8 * e)), 24);
  const __m512i bits = _mm512_srlv_epi32(words[j], _mm512_set1_epi32(8 * e + 4 * nibble));
  __m512i q = _mm512_and_si512(bits, _mm512_set1_epi32(0x0F));
  if constexpr (kHighBits<F> > 0) {
    const auto [word, bit] = high_bits_at<F>(j, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srlv_epi32(words[word], _mm512_set1_epi32(8 * e + bit)),
                                          _mm512_set1_epi32((1 << kHighBits<F>) - 1));
    q = _mm512_or_si512(q, _mm512_slli_epi32(high, 4));
  }
  return kQuantOffset<F> ? _mm512_sub_epi32(q, _mm512_set1_epi32(kQuantOffset<F>)) : q;
}

// The 8-bit scales `index` (0 or 1) of a block's `ints`, all 16 rows as int32 lanes: Q6_K's signed
// sub-scales, or the other K-quants' unsigned sc (0) and m (1).
template <int64_t F>
inline __m512i int_lanes(const uint8_t* ints, int index) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ints + index * kGroupRows));
  return F == kQ6_K ? _mm512_cvtepi8_epi32(bits) : _mm512_cvtepu8_epi32(bits);
}

// slot_value for all 16 rows.
template <int64_t F>
inline __m512 slot_lanes(const uint16_t* halves, const uint8_t* ints, int slot) {
  const Slot s = slot_of<F>(slot);
  if (!s.integer)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + s.index * kGroupRows)));
  return _mm512_cvtepi32_ps(int_lanes<F>(ints, s.index));
}

// One (group, block) into rows [0, 32) of `out` (row stride `stride`), its `count` leading columns:
// lane r is row r's weight, d * q + m as gguf.quants.dequantize computes it (a product, then a sum:
// the build contracts no multiply-adds; d times Q6_K's sub-scale or the K-quants' sc first, and
// dmin * m subtracted). Word j of a row holds quants 4j..4j+3 (a byte each: byte e is quant 4j+e)
// or, in nibbles, quants 4j..4j+3 and 16+4j..16+4j+3 (byte e's low nibble, then its high one).
template <int64_t F, typename T>
void dequantize_group_block(const uint8_t* block, const uint16_t* halves, int64_t count, T* out, int64_t stride) {
  const uint8_t* ints = block + kWords<F> * kWordRowBytes;
  const __m512 d = slot_lanes<F>(halves, ints, 0);
  const __m512 block_scale = kScaledMin<F> ? _mm512_mul_ps(d, slot_lanes<F>(halves, ints, 1)) : d;
  const __m512 m = F == kQ4_1 ? slot_lanes<F>(halves, ints, 1)
                   : kScaledMin<F> ? _mm512_mul_ps(slot_lanes<F>(halves, ints, 2), slot_lanes<F>(halves, ints, 3))
                                   : _mm512_setzero_ps();
  // Q6_K: quants 0..15 (the low nibbles) have the first sub-scale, 16..31 the second.
  const __m512 sub_scaled[2] = {F == kQ6_K ? _mm512_mul_ps(d, slot_lanes<F>(halves, ints, 1)) : block_scale,
                                F == kQ6_K ? _mm512_mul_ps(d, slot_lanes<F>(halves, ints, 2)) : block_scale};
  __m512i words[kWords<F>];
  for (int64_t j = 0; j < kWords<F>; ++j) words[j] = _mm512_loadu_si512(block + j * kWordRowBytes);
  for (int64_t j = 0; j < kLowWords<F>; ++j) {
    for (int e = 0; e < kWordBytes; ++e) {
      for (int nibble = 0; nibble < kNibbles<F>; ++nibble) {
        __m512 values = _mm512_mul_ps(sub_scaled[nibble], _mm512_cvtepi32_ps(quants_of<F>(words, j, e, nibble)));
        if constexpr (F == kQ4_1) values = _mm512_add_ps(values, m);
        if constexpr (kScaledMin<F>) values = _mm512_sub_ps(values, m);
        T* row = out + (kWordBytes * j + e + 16 * nibble) * stride;
        if (count == kGroupRows) {
          store_rounded(row, round_lanes<T>(values));
        } else {
          float lanes[kGroupRows];
          _mm512_storeu_ps(lanes, values);
          store_lanes(lanes, count, row);
        }
      }
    }
  }
}

#else

// As the AVX-512 dequantize_group_block, in plain loops.
template <int64_t F, typename T>
void dequantize_group_block(const uint8_t* block, const uint16_t* halves, int64_t count, T* out, int64_t stride) {
  const uint8_t* ints = block + kWords<F> * kWordRowBytes;
  for (int64_t j = 0; j < kLowWords<F>; ++j) {
    for (int e = 0; e < kWordBytes; ++e) {
      for (int nibble = 0; nibble < kNibbles<F>; ++nibble) {
        float values[kGroupRows];
        for (int64_t r = 0; r < kGroupRows; ++r) {
          const float d = slot_value<F>(halves, ints, 0, r);
          const float scale = F == kQ6_K      ? d * slot_value<F>(halves, ints, 1 + nibble, r)
                              : kScaledMin<F> ? d * slot_value<F>(halves, ints, 1, r)
                                              : d;
          values[r] = scale * static_cast<float>(quant_of<F>(block, r, j, e, nibble));
          if constexpr (F == kQ4_1) values[r] += slot_value<F>(halves, ints, 1, r);
          if constexpr (kScaledMin<F>)
            values[r] -= slot_value<F>(halves, ints, 2, r) * slot_value<F>(halves, ints, 3, r);
        }
        store_lanes(values, count, out + (kWordBytes * j + e + 16 * nibble) * stride);
      }
    }
  }
}

#endif

// Rows [first_row, first_row + out.size(1)) of the weight, transposed into out [in_features, rows]
// (float32 or bf16, rows contiguous); first_row a multiple of 16.
void quant_dequantize(const at::Tensor& quants, const at::Tensor& scales, int64_t format, int64_t first_row,
                      at::Tensor out) {
  check_packed(quants, scales, format, "quant_dequantize");
  const int64_t blocks = quants.size(1), padded_rows = quants.size(0) * kGroupRows;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == blocks * kBlock && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "quant_dequantize: out must be float32 or bf16 [", blocks * kBlock, ", rows] with rows contiguous, got ",
              out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
  const int64_t rows = out.size(1), stride = out.stride(0);
  TORCH_CHECK(first_row >= 0 && first_row % kGroupRows == 0 && first_row + rows <= padded_rows,
              "quant_dequantize: rows [", first_row, ", ", first_row + rows, ") must start at a multiple of ",
              kGroupRows, " inside the weight");
  const uint8_t* q = quants.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  const int64_t first_group = first_row / kGroupRows;
  auto run = [&](auto format_tag, auto* o) {
    constexpr int64_t F = decltype(format_tag)::value;
    // A block's 32 rows of out at a time, left to right: whole cache lines, written once.
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t g = 0; g * kGroupRows < rows; ++g) {
          const int64_t at = (first_group + g) * blocks + b;
          const int64_t file_block = (first_group + g) * (blocks / kBlocksPerScale<F>) + b / kBlocksPerScale<F>;
          dequantize_group_block<F>(q + at * kGroupBlockBytes<F>, s + file_block * kHalfScales<F> * kGroupRows,
                                    std::min(kGroupRows, rows - g * kGroupRows),
                                    o + b * kBlock * stride + g * kGroupRows, stride);
        }
      }
    });
  };
  dispatch_format(format, [&](auto format_tag) {
    if (out.scalar_type() == at::kFloat)
      run(format_tag, out.mutable_data_ptr<float>());
    else
      run(format_tag, out.mutable_data_ptr<c10::BFloat16>());
  });
}

// Rows ids[n] of the weight into out [N, in_features] (float32 or bf16): an embedding's lookups,
// from the table the tied LM head multiplies by. Each (group, block) is dequantized whole into a
// scratch block and the id's lane kept; a lookup is a few rows a step, so the other 15 cost little.
void quant_embedding(const at::Tensor& quants, const at::Tensor& scales, int64_t format, const at::Tensor& ids,
                     at::Tensor out) {
  check_packed(quants, scales, format, "quant_embedding");
  const int64_t blocks = quants.size(1), padded_rows = quants.size(0) * kGroupRows, n = ids.numel();
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "quant_embedding: ids must be contiguous int64");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == blocks * kBlock && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "quant_embedding: out must be contiguous float32 or bf16 [", n, ", ", blocks * kBlock, "], got ",
              out.scalar_type(), " ", out.sizes());
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < padded_rows, "quant_embedding: id ", id[i], " outside the table's ",
                padded_rows, " rows");
  const uint8_t* q = quants.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  auto run = [&](auto format_tag, auto* o) {
    constexpr int64_t F = decltype(format_tag)::value;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float scratch[kBlock * kGroupRows];
      float row[kBlock];
      for (int64_t i = begin; i < end; ++i) {
        const int64_t group = id[i] / kGroupRows, lane = id[i] % kGroupRows;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t file_block = group * (blocks / kBlocksPerScale<F>) + b / kBlocksPerScale<F>;
          dequantize_group_block<F>(q + (group * blocks + b) * kGroupBlockBytes<F>,
                                    s + file_block * kHalfScales<F> * kGroupRows, kGroupRows, scratch, kGroupRows);
          for (int64_t k = 0; k < kBlock; ++k) row[k] = scratch[k * kGroupRows + lane];
          store_lanes(row, kBlock, o + i * blocks * kBlock + b * kBlock);
        }
      }
    });
  };
  dispatch_format(format, [&](auto format_tag) {
    if (out.scalar_type() == at::kFloat)
      run(format_tag, out.mutable_data_ptr<float>());
    else
      run(format_tag, out.mutable_data_ptr<c10::BFloat16>());
  });
}

// ---------------------------------------------------------------------------------------------------
// Activations quantized per block of 32: int8 quants, a float32 scale and the sums of the quants

struct QuantizedActivations {
  // Allocated without zeroing: quantize_activations writes every value, the padding rows' zeros too.
  std::unique_ptr<int8_t[]> quants;         // [M, in]
  std::unique_ptr<float[]> scales;          // [M, blocks]
  std::unique_ptr<int32_t[]> sums;          // [M, blocks]
  std::unique_ptr<int32_t[]> low_sums;      // [M, blocks]: the sums of each block's first 16 quants
  std::unique_ptr<float[]> scaled_sums;     // [M, blocks]: scale times sum, what a format's min is multiplied by
  int64_t in_features, blocks;

  const int8_t* block_quants(int64_t m, int64_t b) const { return quants.get() + m * in_features + b * kBlock; }
  float scale(int64_t m, int64_t b) const { return scales[m * blocks + b]; }
  int32_t sum(int64_t m, int64_t b) const { return sums[m * blocks + b]; }
  int32_t low_sum(int64_t m, int64_t b) const { return low_sums[m * blocks + b]; }
  float scaled_sum(int64_t m, int64_t b) const { return scaled_sums[m * blocks + b]; }
};

// Rows are kept to a multiple of 16, the padding zeros (quants, scales and sums alike): the AMX path
// multiplies 16 rows at a time and drops the padding's outputs.
constexpr int64_t kPaddedRows = 16;

// n values of a plain type, not zeroed (new T[n] default-initializes them).
template <typename V>
std::unique_ptr<V[]> uninitialized(int64_t n) {
  return std::unique_ptr<V[]>(new V[n]);
}

// The largest |value| of a block of 32, NaN where one is NaN (so that, as for an infinity, the
// block's scale makes its outputs NaN, as a float product's would be).
template <typename T>
float block_peak(const T* src) {
  int64_t e = 0;
  float peak = 0.f;
#if defined(RAYPAGE_SIMD)
  Vec peaks = set1(0.f);
  bool nan = false;
  for (; e < kBlock; e += kLanes) {
    const Vec v = load_floats(src + e);
    nan = nan || mask_bits(is_nan(v)) != 0;
    peaks = max(peaks, max(v, sub(set1(0.f), v)));
  }
  peak = nan ? std::numeric_limits<float>::quiet_NaN() : reduce_max(peaks);
#endif
  for (; e < kBlock; ++e) {
    const float magnitude = std::fabs(static_cast<float>(src[e]));
    peak = std::isnan(magnitude) || magnitude > peak ? magnitude : peak;
  }
  return peak;
}

// Block i of the activations: its quants q = round(x / d) (to nearest even, by x * (1 / d)), given
// d, and their sums; quants 0 where d is 0, infinite or NaN.
template <typename T>
void quantize_block(const T* src, int64_t i, float d, QuantizedActivations& a) {
  const float inverse = d > 0.f && std::isfinite(d) ? 1.f / d : 0.f;
  int8_t* q = a.quants.get() + i * kBlock;
  int32_t low_sum = 0, sum = 0;
  if (inverse == 0.f) {
    std::memset(q, 0, kBlock);
  } else {
    int64_t e = 0;
#if defined(RAYPAGE_SIMD)
    // |x| * inverse is at most 127 within a few ulps, so the clamp only guards the rounding; the sums
    // of integral float32s below 2^24 are exact.
    for (; e < kBlock; e += kLanes) {
      const Vec rounded = min(max(round_nearest(mul(load_floats(src + e), set1(inverse))), set1(-127.f)), set1(127.f));
      store_int8(q + e, rounded);
      const auto part = static_cast<int32_t>(reduce_add(rounded));
      sum += part;
      if (e < 16) low_sum += part;
    }
#endif
    for (; e < kBlock; ++e) {
      q[e] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(src[e]) * inverse), -127.f, 127.f));
      sum += q[e];
      if (e < 16) low_sum += q[e];
    }
  }
  a.scales[i] = d;
  a.sums[i] = sum;
  a.low_sums[i] = low_sum;
  a.scaled_sums[i] = d * static_cast<float>(sum);
}

// x [rows, in_features] quantized per block of 32, one scale d = max|x| / 127 per `scale_blocks`
// blocks (1, or a K-quant's 8: llama.cpp's Q8_K activations, whose scale the 8 sub-blocks of a weight
// block share, so that their integer dots add up before any float; each block still keeps its own
// scale entry, all 8 equal).
template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t rows, int64_t in_features, int64_t scale_blocks) {
  const int64_t blocks = in_features / kBlock;
  const int64_t padded = (rows + kPaddedRows - 1) / kPaddedRows * kPaddedRows;
  QuantizedActivations a{uninitialized<int8_t>(padded * in_features),
                         uninitialized<float>(padded * blocks),
                         uninitialized<int32_t>(padded * blocks),
                         uninitialized<int32_t>(padded * blocks),
                         uninitialized<float>(padded * blocks),
                         in_features,
                         blocks};
  at::parallel_for(0, rows * blocks / scale_blocks, 256 / scale_blocks, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t first = s * scale_blocks;
      float peak = 0.f;  // NaN if any value is
      for (int64_t i = first; i < first + scale_blocks; ++i) {
        const float block = block_peak(x + i * kBlock);
        peak = std::isnan(block) || block > peak ? block : peak;
      }
      for (int64_t i = first; i < first + scale_blocks; ++i) quantize_block(x + i * kBlock, i, peak / 127.f, a);
    }
  });
  const int64_t pad = (padded - rows) * blocks;
  std::memset(a.quants.get() + rows * in_features, 0, pad * kBlock);
  std::fill_n(a.scales.get() + rows * blocks, pad, 0.f);
  std::fill_n(a.sums.get() + rows * blocks, pad, 0);
  std::fill_n(a.low_sums.get() + rows * blocks, pad, 0);
  std::fill_n(a.scaled_sums.get() + rows * blocks, pad, 0.f);
  return a;
}

// ---------------------------------------------------------------------------------------------------
// The decode path, one group of 16 output rows against activation rows [m0, m0 + MC)
//
// A block adds d_w * d_x * (integer dot) to each lane; the dot is taken as two halves of 16 quants
// (two shorter dependency chains, and Q6_K's two sub-scales). Offsets that are constant multiples
// of the quants' sum (Q4_0's 8, Q6_K's 32, Q8_0's 128 where it is flipped) come off in integers;
// on AVX2 and in plain loops, Q6_K's halves, times their integer sub-scales in float32, stay exact
// (|half dot| <= 16 * 32 * 127, times |sub-scale| <= 128, both sums < 2^24).

// Two int16 values as one int32 (first in the low half): an operand of `vpmaddwd` / `vpdpwssd`.
inline int32_t int16_pair(int32_t first, int32_t second) {
  return static_cast<int32_t>(static_cast<uint16_t>(first) |
                              static_cast<uint32_t>(static_cast<uint16_t>(second)) << 16);
}

#if defined(__AVX512VNNI__)

// `vpdpbusd` multiplies unsigned weight bytes by signed activation bytes, 4 a lane. Q4, Q5_K and
// Q6_K quants are unsigned already; Q8_0's signed ones are flipped to q + 128 (xor 0x80). w[u] holds
// quants 4 (u % 4) .. 4 (u % 4) + 3 + 16 (u / 4) of every row, a byte each.
template <int64_t F>
inline void load_weights(const uint8_t* block, __m512i (&w)[8]) {
  if constexpr (kBytePerQuant<F>) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(block + j * kWordRowBytes), flip);
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(block + j * kWordRowBytes);
      w[j] = _mm512_and_si512(packed, nibble);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
    if constexpr (kHighBits<F> > 0) {
      // Each quant's high bits to bits 4.. of its byte: 16-bit shifts, whose spill into the
      // neighbouring byte the mask drops.
      const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << kHighBits<F>) - 1) << 4));
      for (int u = 0; u < 8; ++u) {
        const auto [word, bit] = high_bits_at<F>(u % 4, u / 4);
        const __m512i high = _mm512_loadu_si512(block + word * kWordRowBytes);
        const __m512i moved = bit <= 4 ? _mm512_sll_epi16(high, _mm_cvtsi32_si128(4 - bit))
                                       : _mm512_srl_epi16(high, _mm_cvtsi32_si128(bit - 4));
        w[u] = _mm512_or_si512(w[u], _mm512_and_si512(moved, mask));
      }
    }
  }
}

// What the sum of the activation quants is multiplied by and subtracted from the integer dot.
template <int64_t F>
constexpr int32_t kIntegerOffset = F == kQ8_0 ? 128 : kQuantOffset<F>;

// Lane r: row r's 4 weight words (16 quants) times the activation's 16 quants, less `offset`.
inline __m512i half_dot(const __m512i* w, const int8_t* x, int32_t offset) {
  __m512i dot = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    int32_t word;
    std::memcpy(&word, x + j * kWordBytes, kWordBytes);
    dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(word));
  }
  return _mm512_sub_epi32(dot, _mm512_set1_epi32(offset));
}

// Lane r: row r's 32 quants (load_weights' vectors) times the activation's 32, an integer dot in two
// chains of 4.
inline __m512i block_dot(const __m512i* w, const int8_t* x) {
  __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    int32_t low_word, high_word;
    std::memcpy(&low_word, x + j * kWordBytes, kWordBytes);
    std::memcpy(&high_word, x + 16 + j * kWordBytes, kWordBytes);
    low = _mm512_dpbusd_epi32(low, w[j], _mm512_set1_epi32(low_word));
    high = _mm512_dpbusd_epi32(high, w[j + 4], _mm512_set1_epi32(high_word));
  }
  return _mm512_add_epi32(low, high);
}

// The K-quants, whose activations share one scale d_x per block of 256 (quantize_activations): the
// integer dots of its 8 sub-blocks of 32 (Q6_K: 16 halves of 16) times their integer sub-scales sum
// exactly in int32 lanes (|sum| < 2^31: Q5_K's 8 x 32 x 31 x 127 x 63, Q6_K's 16 x 16 x 32 x 127 x
// 128), and so do Q4_K's and Q5_K's mins times the sub-blocks' activation sums; floats come in once a
// super-block: d_w * d_x times the first, less dmin_w * d_x times the second. Against a float
// multiply-add a row and sub-block: 64-row products 8-12% faster on Q4_K, 14-19% on Q6_K (Zen 4, two
// threads, benchmarks.bench_quant_linear).
template <int64_t F, int MC>
void gemv_super_blocks(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                       float (*sums)[kGroupRows]) {
  constexpr int64_t kSubBlocks = kBlocksPerScale<F>;
  __m512 acc[MC];
  for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
  // The 8-bit scales after block b's quant words (see int_lanes).
  const auto ints_of = [quants](int64_t b) { return quants + b * kGroupBlockBytes<F> + kWords<F> * kWordRowBytes; };
  for (int64_t first = 0; first < a.blocks; first += kSubBlocks) {
    __m512i dots[MC], mins[MC];
    for (int i = 0; i < MC; ++i) dots[i] = mins[i] = _mm512_setzero_si512();
    for (int64_t b = first; b < first + kSubBlocks; ++b) {
      __m512i w[8];
      load_weights<F>(quants + b * kGroupBlockBytes<F>, w);
      const __m512i sub_scales = int_lanes<F>(ints_of(b), 0);  // sc, or Q6_K's first half's
      for (int i = 0; i < MC; ++i) {
        const int8_t* x = a.block_quants(m0 + i, b);
        if constexpr (F == kQ6_K) {
          const int32_t sum = a.sum(m0 + i, b), low_sum = a.low_sum(m0 + i, b);
          const __m512i low = half_dot(w, x, kIntegerOffset<F> * low_sum);
          const __m512i high = half_dot(w + 4, x + 16, kIntegerOffset<F> * (sum - low_sum));
          dots[i] = _mm512_add_epi32(dots[i], _mm512_add_epi32(_mm512_mullo_epi32(low, sub_scales),
                                                               _mm512_mullo_epi32(high, int_lanes<F>(ints_of(b), 1))));
        } else {
          dots[i] = _mm512_add_epi32(dots[i], _mm512_mullo_epi32(block_dot(w, x), sub_scales));
        }
      }
    }
    if constexpr (kScaledMin<F>) {
      // Sum over sub-blocks j of m_j times the activations' sum of sub-block j, two sub-blocks a
      // `vpdpwssd` (16-bit pairs: m <= 63, |sum| <= 32 x 127).
      __m512i m_pairs[kSubBlocks / 2];
      for (int64_t k = 0; k < kSubBlocks / 2; ++k)
        m_pairs[k] = _mm512_or_si512(int_lanes<F>(ints_of(first + 2 * k), 1),
                                     _mm512_slli_epi32(int_lanes<F>(ints_of(first + 2 * k + 1), 1), 16));
      for (int i = 0; i < MC; ++i)
        for (int64_t k = 0; k < kSubBlocks / 2; ++k) {
          const int64_t b = first + 2 * k;
          const __m512i pair = _mm512_set1_epi32(int16_pair(a.sum(m0 + i, b), a.sum(m0 + i, b + 1)));
          mins[i] = _mm512_dpwssd_epi32(mins[i], m_pairs[k], pair);
        }
    }
    const uint16_t* halves = scales + first / kSubBlocks * kHalfScales<F> * kGroupRows;
    const __m512 d = slot_lanes<F>(halves, nullptr, 0);
    const __m512 dmin = kScaledMin<F> ? slot_lanes<F>(halves, nullptr, 2) : d;
    for (int i = 0; i < MC; ++i) {
      const __m512 dx = _mm512_set1_ps(a.scale(m0 + i, first));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]), _mm512_mul_ps(d, dx), acc[i]);
      if constexpr (kScaledMin<F>)
        acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[i]), _mm512_mul_ps(dmin, dx), acc[i]);
    }
  }
  for (int i = 0; i < MC; ++i) _mm512_storeu_ps(sums[i], acc[i]);
}

// Blocks of 32 with their own scales (Q4_0, Q4_1, Q8_0) add d_w * d_x times each block's integer dot,
// and Q4_1 its m times d_x times the block's activation sum; the K-quants go by super-blocks.
template <int64_t F, int MC>
void gemv_group(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                float (*sums)[kGroupRows]) {
  if constexpr (kBlocksPerScale<F> > 1) {
    gemv_super_blocks<F, MC>(quants, scales, a, m0, sums);
  } else {
    __m512 acc[MC];
    for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      __m512i w[8];
      const uint8_t* block = quants + b * kGroupBlockBytes<F>;
      load_weights<F>(block, w);
      const uint16_t* halves = scales + b * kHalfScales<F> * kGroupRows;
      const __m512 d = slot_lanes<F>(halves, nullptr, 0);
      for (int i = 0; i < MC; ++i) {
        const __m512i offset = _mm512_set1_epi32(kIntegerOffset<F> * a.sum(m0 + i, b));
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(block_dot(w, a.block_quants(m0 + i, b)), offset));
        acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.scale(m0 + i, b))), acc[i]);
        if constexpr (kHasMin<F>)
          acc[i] = _mm512_fmadd_ps(slot_lanes<F>(halves, nullptr, 1), _mm512_set1_ps(a.scaled_sum(m0 + i, b)), acc[i]);
      }
    }
    for (int i = 0; i < MC; ++i) _mm512_storeu_ps(sums[i], acc[i]);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define RAYPAGE_QUANT_AMX 1

// AMX's int8 tiles: one `tdpbsud` multiplies 16 activation rows by a group's 16 output rows over a
// block's 32 quants, the work of 16 x 8 `vpdpbusd`. The weights' 8 vectors of load_weights are the
// B tile as they are (vector u: quants 4u..4u+3 of every row, row u of the tile), the activation
// quants the A tile (16 rows of 32 bytes, a row of x apart), so only the float epilogue is per row.
// Each block's tile dot waits for the last one's to be stored and read back (tiles are not renamed),
// so below 16 rows, where the tile is padding, the vector path is faster (benchmarks.bench_quant_linear).
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxMinRows = 16;

// Tiles: 0 and 1 the int32 dots of a block's quants (all 32, or Q6_K's two halves of 16), 2 the
// activation quants (32 a row), 3 and 4 their halves, 5 the weights (8 rows of 64 bytes), 6 and 7
// their halves (4 rows each).
inline void configure_quant_tiles() {
  raypage::configure_tiles({{16, 16, 16, 16, 16, 8, 4, 4}, {64, 64, 32, 16, 16, 64, 64, 64}});
}

template <int64_t F>
void amx_group(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
               float (*sums)[kGroupRows]) {
  __m512 acc[kAmxRows];
  for (int i = 0; i < kAmxRows; ++i) acc[i] = _mm512_setzero_ps();
  alignas(64) uint8_t weights[8 * 64];
  alignas(64) int32_t dots[2][kAmxRows * kGroupRows];
  const int64_t stride = a.in_features;
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i w[8];
    const uint8_t* block = quants + b * kGroupBlockBytes<F>;
    load_weights<F>(block, w);
    for (int u = 0; u < 8; ++u) _mm512_store_si512(weights + u * 64, w[u]);
    const int8_t* x = a.block_quants(m0, b);
    asm volatile("" ::: "memory");  // GCC's tile loads do not say they read the stores above
    if constexpr (F == kQ6_K) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(3, x, stride);
      _tile_loadd(4, x + 16, stride);
      _tile_loadd(6, weights, 64);
      _tile_loadd(7, weights + 4 * 64, 64);
      _tile_dpbsud(0, 3, 6);
      _tile_dpbsud(1, 4, 7);
      _tile_stored(1, dots[1], 64);
    } else {
      _tile_zero(0);
      _tile_loadd(2, x, stride);
      _tile_loadd(5, weights, 64);
      _tile_dpbsud(0, 2, 5);
    }
    _tile_stored(0, dots[0], 64);
    asm volatile("" ::: "memory");  // nor do its stores say they write `dots`
    const uint16_t* halves = scales + b / kBlocksPerScale<F> * kHalfScales<F> * kGroupRows;
    const uint8_t* ints = block + kWords<F> * kWordRowBytes;
    const __m512 d = slot_lanes<F>(halves, ints, 0);
    const __m512 second = F != kQ4_0 && F != kQ8_0 ? slot_lanes<F>(halves, ints, 1) : d;
    const __m512 third = F == kQ6_K || kScaledMin<F> ? slot_lanes<F>(halves, ints, 2) : d;
    const __m512 scale = kScaledMin<F> ? _mm512_mul_ps(d, second) : d;
    const __m512 min =
        kScaledMin<F> ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(third, slot_lanes<F>(halves, ints, 3)))
                      : second;
    for (int i = 0; i < kAmxRows; ++i) {
      const int32_t sum = a.sum(m0 + i, b);
      const __m512i first = _mm512_load_si512(dots[0] + i * kGroupRows);
      __m512 dot;
      if constexpr (F == kQ6_K) {
        const int32_t low_sum = a.low_sum(m0 + i, b);
        const __m512i high = _mm512_load_si512(dots[1] + i * kGroupRows);
        const __m512 low_dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(first, _mm512_set1_epi32(kIntegerOffset<F> * low_sum)));
        const __m512 high_dot =
            _mm512_cvtepi32_ps(_mm512_sub_epi32(high, _mm512_set1_epi32(kIntegerOffset<F> * (sum - low_sum))));
        dot = _mm512_add_ps(_mm512_mul_ps(low_dot, second), _mm512_mul_ps(high_dot, third));
      } else {
        // One integer dot for the whole block, as gemv_group's block_dot.
        dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(first, _mm512_set1_epi32(kIntegerOffset<F> * sum)));
      }
      const float dx = a.scale(m0 + i, b);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc[i]);
      if constexpr (kHasMin<F>) acc[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(a.scaled_sum(m0 + i, b)), acc[i]);
    }
  }
  for (int i = 0; i < kAmxRows; ++i) _mm512_storeu_ps(sums[i], acc[i]);
}

#endif

#elif defined(__AVX2__)

// `vpmaddubsw` multiplies unsigned by signed bytes into saturating int16 pairs: fine for Q4's 0..15
// up to Q6_K's 0..63, not for Q8_0 flipped to 0..255, so Q8_0 takes the sign trick instead: |q_w|
// times q_x with q_w's sign, at most 2 * 128 * 127 a pair. 8 int32 lanes a vector: a group is two
// halves of 8 rows.
template <int64_t F>
inline void load_weights(const uint8_t* block, int half, __m256i (&w)[8]) {
  const uint8_t* p = block + half * 32;
  if constexpr (kBytePerQuant<F>) {
    for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * kWordRowBytes));
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * kWordRowBytes));
      w[j] = _mm256_and_si256(packed, nibble);
      w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    }
    if constexpr (kHighBits<F> > 0) {  // as the AVX-512 load_weights
      const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kHighBits<F>) - 1) << 4));
      for (int u = 0; u < 8; ++u) {
        const auto [word, bit] = high_bits_at<F>(u % 4, u / 4);
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + word * kWordRowBytes));
        const __m256i moved = bit <= 4 ? _mm256_sll_epi16(high, _mm_cvtsi32_si128(4 - bit))
                                       : _mm256_srl_epi16(high, _mm_cvtsi32_si128(bit - 4));
        w[u] = _mm256_or_si256(w[u], _mm256_and_si256(moved, mask));
      }
    }
  }
}

// What the sum of the activation quants is multiplied by and subtracted from the integer dot.
template <int64_t F>
constexpr int32_t kIntegerOffset = kQuantOffset<F>;

// Weight vectors whose int16 pairs add up without saturating before `vpmaddwd` widens them: a pair
// is at most 2 * max|q_w| * 127 (Q4's 3,810, so 8 vectors make 30,480; Q5_K's 7,874 four; Q6_K's
// 16,002 two; Q8_0's 32,512 one). llama.cpp's AVX2 dot products add their pairs the same way.
template <int64_t F>
constexpr int kPairRun = F == kQ8_0 ? 1 : F == kQ6_K ? 2 : F == kQ5_K ? 4 : 8;

// Lane r: row r's weight vector w times the activation's 4 quants at x, as int16 pairs.
template <int64_t F>
inline __m256i word_pairs(const __m256i& w, const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, kWordBytes);
  const __m256i xs = _mm256_set1_epi32(word);
  return F == kQ8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xs, w))
                    : _mm256_maddubs_epi16(w, xs);
}

// Lane r: row r's 32 quants (load_weights' vectors; vector u meets the activation quants 4u..4u+3)
// times the activation's 32, an integer dot whose pairs of quants 0..15 are multiplied by `low`'s
// int16 lanes and of 16..31 by `high`'s: ones, or a K-quant's sub-scales (`vpmaddwd` widens and
// scales at once).
template <int64_t F>
inline __m256i block_dot(const __m256i* w, const int8_t* x, const __m256i& low, const __m256i& high) {
  __m256i dot = _mm256_setzero_si256();
  for (int u = 0; u < 8; u += kPairRun<F>) {
    __m256i pairs = word_pairs<F>(w[u], x + kWordBytes * u);
    for (int k = 1; k < kPairRun<F>; ++k)
      pairs = _mm256_add_epi16(pairs, word_pairs<F>(w[u + k], x + kWordBytes * (u + k)));
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, u < 4 ? low : high));
  }
  return dot;
}

// Lanes of int32 whose int16 halves are `first`'s and `second`'s low 16 bits.
inline __m256i int16_pairs(const __m256i& first, const __m256i& second) {
  return _mm256_blend_epi16(first, _mm256_slli_epi32(second, 16), 0xAA);
}

// The 8-bit scales `index` (0 or 1) of a half's `ints`, 8 rows as int32 lanes (as the AVX-512 int_lanes).
template <int64_t F>
inline __m256i int_lanes(const uint8_t* ints, int index) {
  const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ints + index * kGroupRows));
  return F == kQ6_K ? _mm256_cvtepi8_epi32(bits) : _mm256_cvtepu8_epi32(bits);
}

// slot_value for 8 rows.
template <int64_t F>
inline __m256 slot_lanes(const uint16_t* halves, const uint8_t* ints, int slot) {
  const Slot s = slot_of<F>(slot);
  if (!s.integer)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + s.index * kGroupRows)));
  return _mm256_cvtepi32_ps(int_lanes<F>(ints, s.index));
}

// The K-quants as on AVX-512 VNNI (gemv_super_blocks there): a super-block's integer dots times
// their sub-scales add up in int32 lanes, the sub-scales applied by `vpmaddwd`; Q4_K's and Q5_K's
// mins times the sub-blocks' activation sums, and Q6_K's offset of 32 times its halves' sums and
// sub-scales, too; floats once a super-block. Against a `vpmaddwd` by ones a weight vector and a float
// multiply-add a row and block of 32: 64-row products of the 1B shapes Q4_K 1.25-1.6x as fast, Q6_K
// 1.2-1.7x (Zen 3, two threads, benchmarks.bench_quant_linear). Rows [first_half * 8, (first_half +
// H) * 8) of the group (gemv_group).
template <int64_t F, int MC, int H>
void gemv_super_blocks(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                       int first_half, float (*sums)[kGroupRows]) {
  constexpr int64_t kSubBlocks = kBlocksPerScale<F>;
  // The 8-bit scales after block b's quant words, a half's rows.
  const auto ints_of = [quants](int64_t b, int half) {
    return quants + b * kGroupBlockBytes<F> + kWords<F> * kWordRowBytes + half * 8;
  };
  __m256 acc[H][MC];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MC; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t first = 0; first < a.blocks; first += kSubBlocks) {
    __m256i dots[H][MC], offsets[H][MC];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < MC; ++i) dots[h][i] = offsets[h][i] = _mm256_setzero_si256();
    for (int64_t b = first; b < first + kSubBlocks; ++b) {
      for (int h = 0; h < H; ++h) {
        const int half = first_half + h;
        __m256i w[8];
        load_weights<F>(quants + b * kGroupBlockBytes<F>, half, w);
        const __m256i low = int_lanes<F>(ints_of(b, half), 0);  // sc, or Q6_K's first half's
        const __m256i high = F == kQ6_K ? int_lanes<F>(ints_of(b, half), 1) : low;
        const __m256i low_pairs = int16_pairs(low, low), high_pairs = int16_pairs(high, high);
        for (int i = 0; i < MC; ++i) {
          dots[h][i] =
              _mm256_add_epi32(dots[h][i], block_dot<F>(w, a.block_quants(m0 + i, b), low_pairs, high_pairs));
          if constexpr (F == kQ6_K) {  // sub-scale times half sum, both halves (|sum| <= 16 x 127)
            const int32_t low_sum = a.low_sum(m0 + i, b), high_sum = a.sum(m0 + i, b) - low_sum;
            offsets[h][i] = _mm256_add_epi32(
                offsets[h][i],
                _mm256_madd_epi16(int16_pairs(low, high), _mm256_set1_epi32(int16_pair(low_sum, high_sum))));
          }
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int half = first_half + h;
      if constexpr (kScaledMin<F>) {  // m_j times sub-block j's sum, two sub-blocks a `vpmaddwd`
        __m256i m_pairs[kSubBlocks / 2];
        for (int64_t k = 0; k < kSubBlocks / 2; ++k)
          m_pairs[k] = int16_pairs(int_lanes<F>(ints_of(first + 2 * k, half), 1),
                                   int_lanes<F>(ints_of(first + 2 * k + 1, half), 1));
        for (int i = 0; i < MC; ++i)
          for (int64_t k = 0; k < kSubBlocks / 2; ++k) {
            const int64_t b = first + 2 * k;
            const __m256i pair = _mm256_set1_epi32(int16_pair(a.sum(m0 + i, b), a.sum(m0 + i, b + 1)));
            offsets[h][i] = _mm256_add_epi32(offsets[h][i], _mm256_madd_epi16(m_pairs[k], pair));
          }
      }
      const uint16_t* halves = scales + first / kSubBlocks * kHalfScales<F> * kGroupRows + half * 8;
      const __m256 d = slot_lanes<F>(halves, nullptr, 0);
      const __m256 dmin = kScaledMin<F> ? slot_lanes<F>(halves, nullptr, 2) : d;
      for (int i = 0; i < MC; ++i) {
        const __m256 dx = _mm256_set1_ps(a.scale(m0 + i, first));
        if constexpr (kScaledMin<F>) {
          acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h][i]), _mm256_mul_ps(d, dx), acc[h][i]);
          acc[h][i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offsets[h][i]), _mm256_mul_ps(dmin, dx), acc[h][i]);
        } else {  // Q6_K: less 32 times the sub-scaled sums
          const __m256i dot = _mm256_sub_epi32(dots[h][i], _mm256_slli_epi32(offsets[h][i], 5));
          acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), acc[h][i]);
        }
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MC; ++i) _mm256_storeu_ps(sums[i] + (first_half + h) * 8, acc[h][i]);
}

// Blocks of 32 with their own scales (Q4_0, Q4_1, Q8_0) add d_w * d_x times each block's integer dot,
// and Q4_1 its m times d_x times the block's activation sum; the same rows as gemv_super_blocks.
template <int64_t F, int MC, int H>
void gemv_blocks(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                 int first_half, float (*sums)[kGroupRows]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[H][MC];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MC; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    for (int h = 0; h < H; ++h) {
      const int half = first_half + h;
      __m256i w[8];
      load_weights<F>(quants + b * kGroupBlockBytes<F>, half, w);
      const uint16_t* halves = scales + b * kHalfScales<F> * kGroupRows + half * 8;
      const __m256 d = slot_lanes<F>(halves, nullptr, 0);
      const __m256 min = kHasMin<F> ? slot_lanes<F>(halves, nullptr, 1) : d;  // Q4_1's m
      for (int i = 0; i < MC; ++i) {
        const __m256i offset = _mm256_set1_epi32(kIntegerOffset<F> * a.sum(m0 + i, b));
        const __m256i dot = _mm256_sub_epi32(block_dot<F>(w, a.block_quants(m0 + i, b), ones, ones), offset);
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.scale(m0 + i, b)));
        acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[h][i]);
        if constexpr (kHasMin<F>)
          acc[h][i] = _mm256_fmadd_ps(min, _mm256_set1_ps(a.scaled_sum(m0 + i, b)), acc[h][i]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < MC; ++i) _mm256_storeu_ps(sums[i] + (first_half + h) * 8, acc[h][i]);
}

// The group's two halves of 8 rows in one pass over its blocks for a single activation row: each
// 64-byte line of weights is used whole as memory streams it in (one half a pass read the lines
// from memory in the first pass at half the arithmetic, 1-row products 10-15% slower, Zen 3); with
// more rows a half at a time, whose accumulators, weights and sums fit the 16 registers (both halves
// of 4 rows spilled them: 64-row products a third slower).
template <int64_t F, int MC>
void gemv_group(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                float (*sums)[kGroupRows]) {
  constexpr int H = MC == 1 ? 2 : 1;
  for (int half = 0; half < 2; half += H) {
    if constexpr (kBlocksPerScale<F> > 1)
      gemv_super_blocks<F, MC, H>(quants, scales, a, m0, half, sums);
    else
      gemv_blocks<F, MC, H>(quants, scales, a, m0, half, sums);
  }
}

#else

// Quant i (0..31) of row r of a packed block, its offset subtracted (a min is added apart).
template <int64_t F>
inline int32_t quant_at(const uint8_t* block, int64_t r, int64_t i) {
  const int64_t k = kBytePerQuant<F> ? i : i % 16;
  return quant_of<F>(block, r, k / kWordBytes, static_cast<int>(k % kWordBytes), kBytePerQuant<F> ? 0 : i / 16);
}

// Plain loops over quant_at, for CPUs with neither: the same integer dots and the same float steps.
template <int64_t F, int MC>
void gemv_group(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t m0,
                float (*sums)[kGroupRows]) {
  for (int i = 0; i < MC; ++i) std::fill(sums[i], sums[i] + kGroupRows, 0.f);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = quants + b * kGroupBlockBytes<F>;
    const uint16_t* halves = scales + b / kBlocksPerScale<F> * kHalfScales<F> * kGroupRows;
    const uint8_t* ints = block + kWords<F> * kWordRowBytes;
    for (int i = 0; i < MC; ++i) {
      const int8_t* x = a.block_quants(m0 + i, b);
      const float dx = a.scale(m0 + i, b);
      for (int64_t r = 0; r < kGroupRows; ++r) {
        int32_t dots[2] = {0, 0};  // quants 0..15 and 16..31
        for (int64_t e = 0; e < kBlock; ++e) dots[e / 16] += quant_at<F>(block, r, e) * x[e];
        const float low = static_cast<float>(dots[0]), high = static_cast<float>(dots[1]);
        const float dot =
            F == kQ6_K ? low * slot_value<F>(halves, ints, 1, r) + high * slot_value<F>(halves, ints, 2, r)
                       : low + high;
        const float d = slot_value<F>(halves, ints, 0, r);
        const float scale = kScaledMin<F> ? d * slot_value<F>(halves, ints, 1, r) : d;
        sums[i][r] += dot * (scale * dx);
        if constexpr (kHasMin<F>) {
          const float min = F == kQ4_1 ? slot_value<F>(halves, ints, 1, r)
                                       : -(slot_value<F>(halves, ints, 2, r) * slot_value<F>(halves, ints, 3, r));
          sums[i][r] += min * a.scaled_sum(m0 + i, b);
        }
      }
    }
  }
}

#endif

// gemv_group for `count` (1 to MC) activation rows: its instance for exactly that many, whose
// accumulators stay in registers.
template <int64_t F, int MC = kRowsPerPass>
void gemv_rows(int64_t count, const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a,
               int64_t m0, float (*sums)[kGroupRows]) {
  if constexpr (MC > 1) {
    if (count < MC) return gemv_rows<F, MC - 1>(count, quants, scales, a, m0, sums);
  }
  gemv_group<F, MC>(quants, scales, a, m0, sums);
}

// Whether this call takes the AMX path: enough rows, a CPU with AMX-INT8, and the tiles lent.
bool use_tiles(int64_t rows) {
#if defined(RAYPAGE_QUANT_AMX)
  return rows >= kAmxMinRows && raypage::amx_permitted();
#else
  (void)rows;
  return false;
#endif
}

// Passes over a group from which the next group's weights are prefetched: with 8 passes (32 rows) or
// more the kernel is bound by its arithmetic, and a group's first pass would otherwise wait on memory
// (a 64-row 2048 -> 8192 product 6-7% faster with it, 8192 -> 2048 1-3%, Q4_K and Q8_0 on a Zen 4
// EPYC, weights out of the caches); with fewer, the passes are bound by memory already, and the extra
// requests slowed them (by a quarter at one row).
constexpr int64_t kPrefetchMinPasses = 8;

// Bytes [begin, end) of `data` fetched towards the L2 (prefetcht1 on x86).
inline void prefetch_to_l2(const uint8_t* data, int64_t begin, int64_t end) {
  for (int64_t offset = begin; offset < end; offset += 64) __builtin_prefetch(data + offset, 0, 2);
}

// Activation rows [row_begin, row_end) against one group, a pass over the group's weights per
// kRowsPerPass rows, or per 16 on the AMX path (`tiles`); the weights stay in L1/L2 after the first
// pass, and each pass prefetches its share of the next group's weights (`next`, or null for none).
// Each output is the float32 sum plus the bias (float32, or null), rounded once to T.
template <int64_t F, typename T>
void gemv_all_rows(const uint8_t* quants, const uint16_t* scales, const QuantizedActivations& a, int64_t row_begin,
                   int64_t row_end, bool tiles, int64_t first_out, int64_t valid_out, const float* bias,
                   int64_t out_features, T* out, const uint8_t* next) {
  float sums[kPaddedRows][kGroupRows];
  const int64_t pass_rows = tiles ? kPaddedRows : kRowsPerPass;
  const int64_t passes = (row_end - row_begin + pass_rows - 1) / pass_rows;
  const int64_t group_bytes = a.blocks * kGroupBlockBytes<F>;
  const int64_t slice = passes >= kPrefetchMinPasses && next ? (group_bytes + passes - 1) / passes : 0;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t m0 = row_begin + pass * pass_rows, count = std::min<int64_t>(pass_rows, row_end - m0);
    prefetch_to_l2(next, pass * slice, std::min(group_bytes, (pass + 1) * slice));
#if defined(RAYPAGE_QUANT_AMX)
    if (tiles)
      amx_group<F>(quants, scales, a, m0, sums);
    else
#endif
      gemv_rows<F>(count, quants, scales, a, m0, sums);
    for (int64_t i = 0; i < count; ++i) {
      T* row = out + (m0 + i) * out_features + first_out;
      for (int64_t r = 0; r < valid_out; ++r)
        row[r] = static_cast<T>(bias ? sums[i][r] + bias[first_out + r] : sums[i][r]);
    }
  }
}

// Activation rows a thread takes against all its groups before the next rows: as many as keep their
// quants within kSpanBytes, a multiple of the AMX path's 16 (a prefill chunk's, or even 256 rows of
// 8192 features, 2 MiB of quants, would leave the L2 for each group). 512 KiB, half a Zen 4's L2:
// 64 rows of 8192 features in one span, where 256 KiB took two and so streamed each group's weights
// from memory twice (a 64-row 8192 -> 2048 product 8-13% slower, Q4_K and Q8_0).
constexpr int64_t kSpanBytes = 512 << 10;

int64_t row_span(int64_t in_features) {
  return std::max<int64_t>(kPaddedRows, kSpanBytes / in_features / kPaddedRows * kPaddedRows);
}

// Whether the int8 kernel multiplies by AMX tiles here: only then does it cede prefill chunks to
// bf16 panels (torch's matmul on AMX-BF16), which beat it above GEMV_MAX_ROWS rows; on VNNI or AVX2
// alone it is the faster path at any number of rows.
bool quant_gemv_uses_tiles() { return use_tiles(kPaddedRows); }

at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, int64_t format,
                      int64_t out_features, const std::optional<at::Tensor>& bias) {
  check_packed(quants, scales, format, "quant_gemv");
  TORCH_CHECK(quants.size(0) == (out_features + kGroupRows - 1) / kGroupRows, "quant_gemv: ", quants.size(0),
              " groups of ", kGroupRows, " rows do not hold ", out_features, " rows");
  const int64_t in_features = quants.size(1) * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "quant_gemv: x must be [rows, ", in_features, "], got ",
              x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_gemv: x must be float32 or bf16, got ", dtype);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features), "quant_gemv: bias must be [",
              out_features, "]");
  const at::Tensor x_rows = x.contiguous(), bias32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t rows = x.size(0), groups = quants.size(0), blocks = quants.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const uint8_t* q = quants.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::Half>());
  const float* b = bias ? bias32.const_data_ptr<float>() : nullptr;
  const int64_t group_bytes = blocks * quants.size(2), group_scales = scales.size(1) * scales.size(2) * kGroupRows;
  auto run = [&](auto format_tag, const auto* xs, auto* o) {
    constexpr int64_t F = decltype(format_tag)::value;
    const QuantizedActivations a = quantize_activations(xs, rows, in_features, kBlocksPerScale<F>);
    const bool tiles = use_tiles(rows);
    const int64_t span = row_span(in_features);
    // Grain 1: parallel_for splits the groups into one equal range per thread. Each thread takes
    // its groups a span of rows at a time, the span's activation quants staying in its L2 while the
    // groups' weights stream past.
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
#if defined(RAYPAGE_QUANT_AMX)
      if (tiles) configure_quant_tiles();
#endif
      for (int64_t row_begin = 0; row_begin < rows; row_begin += span)
        for (int64_t g = begin; g < end; ++g)
          gemv_all_rows<F>(q + g * group_bytes, s + g * group_scales, a, row_begin,
                           std::min(rows, row_begin + span), tiles, g * kGroupRows,
                           std::min(kGroupRows, out_features - g * kGroupRows), b, out_features, o,
                           g + 1 < end ? q + (g + 1) * group_bytes : nullptr);
    });
  };
  dispatch_format(format, [&](auto format_tag) {
    if (dtype == at::kFloat)
      run(format_tag, x_rows.const_data_ptr<float>(), out.mutable_data_ptr<float>());
    else
      run(format_tag, x_rows.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("quant_pack(Tensor raw, int ggml_type, int out_features, int in_features) -> (Tensor, Tensor)");
  m.def(
      "quant_gemv(Tensor x, Tensor quants, Tensor scales, int ggml_type, int out_features, Tensor? bias=None)"
      " -> Tensor");
  m.def(
      "quant_dequantize(Tensor quants, Tensor scales, int ggml_type, int first_row, Tensor(a!) out) -> ()");
  m.def("quant_embedding(Tensor quants, Tensor scales, int ggml_type, Tensor ids, Tensor(a!) out) -> ()");
  m.def("quant_gemv_uses_tiles() -> bool", &quant_gemv_uses_tiles);
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_gemv", &quant_gemv);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_embedding", &quant_embedding);
}
