// A thin per-ISA layer shared by the CPU kernels: a vector of kLanes floats (`Vec`) and the few
// operations they are written with, once for every ISA. The library is compiled with -march=native,
// so the widest one the CPU has is chosen here: AVX-512 (16 lanes), else AVX2 with FMA and F16C (8
// lanes). Without either, RAYPAGE_SIMD stays undefined and the kernels are plain loops (kLanes = 1),
// which -O3 vectorizes as far as it can: not the float32 sums, without fast-math.
//
// Every kernel runs kLanes floats at a time under `#if defined(RAYPAGE_SIMD)`, then finishes the
// rest (n % kLanes, or everything without SIMD) one at a time.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <cstdint>

namespace raypage::simd {

#if defined(__AVX512F__)
#define RAYPAGE_SIMD 1
constexpr int64_t kLanes = 16;
using Vec = __m512;

inline Vec load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load_floats(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec load_floats(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec load_floats(const int8_t* p) {  // an int8 KV cache's values, exactly
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_floats(float* p, Vec x) { _mm512_storeu_ps(p, x); }
// Stores lanes that already hold values of the narrower type (round_lanes' output): exact.
inline void store_rounded(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline void store_rounded(c10::BFloat16* p, Vec x) {  // the top halves, narrowed
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline void store_rounded(c10::Half* p, Vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// max and min return b where either is NaN (x86's maxps and minps).
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline float reduce_add(Vec x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(Vec x) { return _mm512_reduce_max_ps(x); }
inline Vec round_nearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// Lanes holding integers of [-128, 127] (as float32s) stored as kLanes int8s.
inline void store_int8(int8_t* p, Vec integral) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(integral)));
}
// Per-lane comparisons (false where either side is NaN), as a mask that `select` takes and
// `mask_bits` turns into one bit per lane, lane 0 lowest.
using Mask = __mmask16;
inline Mask less(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask equal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline Vec select(Mask m, Vec if_set, Vec if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
inline uint32_t mask_bits(Mask m) { return static_cast<uint32_t>(m); }
// The bits of a float32 as 32-bit integers, and back: bf16 rounding works on these.
using IVec = __m512i;
inline IVec bits_of(Vec x) { return _mm512_castps_si512(x); }
inline Vec from_bits(IVec x) { return _mm512_castsi512_ps(x); }
inline IVec iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec shift_right(IVec x, int bits) { return _mm512_srli_epi32(x, bits); }
inline Vec round_half(Vec x) {  // float32 -> float16 -> float32, to nearest even
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// y * 2^n for integral n (as float32s) no lower than kExpFloor / ln 2 rounds to, by `vscalefps`.
inline Vec times_pow2(Vec y, Vec n) { return _mm512_scalef_ps(y, n); }
// Where exp_lanes clamps its input: e^x underflows to zero below it.
constexpr float kExpFloor = -88.3762626647949f;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RAYPAGE_SIMD 1
constexpr int64_t kLanes = 8;
using Vec = __m256;

inline Vec load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load_floats(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec load_floats(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec load_floats(const int8_t* p) {  // an int8 KV cache's values, exactly
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store_floats(float* p, Vec x) { _mm256_storeu_ps(p, x); }
// Stores lanes that already hold values of the narrower type (round_lanes' output): exact.
inline void store_rounded(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline void store_rounded(c10::BFloat16* p, Vec x) {  // the top halves, packed (they fit in 16 bits unsigned)
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}
inline void store_rounded(c10::Half* p, Vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
// max and min return b where either is NaN (x86's maxps and minps).
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline float reduce_add(Vec x) {  // halves folded: 8 -> 4 -> 2 -> 1
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}
inline float reduce_max(Vec x) {  // folded as reduce_add is
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline Vec round_nearest(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// Lanes holding integers of [-128, 127] (as float32s) stored as kLanes int8s: packed to 16 bits, then
// 8, with signed saturation that such values never reach.
inline void store_int8(int8_t* p, Vec integral) {
  const __m256i ints = _mm256_cvtps_epi32(integral);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}
// Per-lane comparisons (false where either side is NaN), as a mask that `select` takes and
// `mask_bits` turns into one bit per lane, lane 0 lowest.
using Mask = __m256;
inline Mask less(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline Mask equal(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline Vec select(Mask m, Vec if_set, Vec if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
inline uint32_t mask_bits(Mask m) { return static_cast<uint32_t>(_mm256_movemask_ps(m)); }
using IVec = __m256i;
inline IVec bits_of(Vec x) { return _mm256_castps_si256(x); }
inline Vec from_bits(IVec x) { return _mm256_castsi256_ps(x); }
inline IVec iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec iand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec shift_right(IVec x, int bits) { return _mm256_srli_epi32(x, bits); }
inline Vec round_half(Vec x) {  // float32 -> float16 -> float32, to nearest even
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// y * 2^n for integral n (as float32s) of [-126, 127]. AVX2 has no scalef: 2^n is built from its
// exponent bits, n + 127, which make a normal float32 only for n >= -126; kExpFloor keeps n there.
inline Vec times_pow2(Vec y, Vec n) {
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
// ln(2^-126), so that round(x / ln 2) >= -126: inputs below it give 2^-126 (1.2e-38), not less. That
// is negligible where exp_lanes serves, a softmax shifted by its peak: the peak's term e^0 = 1 is in
// every sum, so the sum is unchanged in float32, and such a key's share of the output stays below
// 1.2e-38 of its value row (AVX-512's floor of -88.38 leaves about 4e-39).
constexpr float kExpFloor = -87.3365447505531f;
#endif

#if defined(RAYPAGE_SIMD)
// x rounded to T's precision and widened back (the identity for float32).
template <typename T>
inline Vec round_lanes(Vec x);
template <>
inline Vec round_lanes<float>(Vec x) {
  return x;
}
template <>
inline Vec round_lanes<c10::BFloat16>(Vec x) {  // to nearest even, as c10::BFloat16(float) for finite x
  const IVec bits = bits_of(x);
  const IVec odd = iand(shift_right(bits, 16), iset1(1));
  return from_bits(iand(iadd(bits, iadd(odd, iset1(0x7fff))), iset1(0xffff0000u)));
}
template <>
inline Vec round_lanes<c10::Half>(Vec x) {
  return round_half(x);
}

// e^x for x <= 0 within about 2 ulp: Cephes' expf (range reduction by ln 2, a degree-6 polynomial,
// the exponent put back by times_pow2), kLanes at a time where std::exp takes one. Inputs below
// kExpFloor count as kExpFloor.
inline Vec exp_lanes(Vec x) {
  x = max(x, set1(kExpFloor));
  const Vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  x = fnmadd(n, set1(0.693359375f), x);
  x = fnmadd(n, set1(-2.12194440e-4f), x);
  Vec y = set1(1.9875691500e-4f);
  y = fmadd(y, x, set1(1.3981999507e-3f));
  y = fmadd(y, x, set1(8.3334519073e-3f));
  y = fmadd(y, x, set1(4.1665795894e-2f));
  y = fmadd(y, x, set1(1.6666665459e-1f));
  y = fmadd(y, x, set1(5.0000001201e-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.f)));
  return times_pow2(y, n);
}

// silu(x) = x / (1 + e^-x), with the exponential always of -|x| (exp_lanes' domain): for x < 0 it
// is x e^x / (1 + e^x), the same value. Where e^-|x| underflows it is zero, so that large |x| give
// x and -0 as torch's formula does (and -inf gives NaN, as torch's -inf / inf does).
inline Vec silu_lanes(Vec x) {
  const Vec zero = set1(0.f);
  const Vec negative_abs = min(x, sub(zero, x));
  const Vec e = select(less(negative_abs, set1(kExpFloor)), zero, exp_lanes(negative_abs));
  return div(select(less(x, zero), mul(x, e), x), add(set1(1.f), e));
}

// cap * tanh(s / cap), attention scores' soft cap (Gemma 2): tanh(|x|) = (1 - e) / (1 + e) with
// e = e^(-2|x|) (exp_lanes' domain), the sign of x put back.
inline Vec soft_cap_lanes(Vec s, float cap) {
  const Vec zero = set1(0.f), one = set1(1.f), x = div(s, set1(cap));
  const Vec negative_abs = min(x, sub(zero, x));
  const Vec e = exp_lanes(add(negative_abs, negative_abs));
  const Vec magnitude = div(sub(one, e), add(one, e));
  return mul(select(less(x, zero), sub(zero, magnitude), magnitude), set1(cap));
}
#else
constexpr int64_t kLanes = 1;
#endif

}  // namespace raypage::simd
