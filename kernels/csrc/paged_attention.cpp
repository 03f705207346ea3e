// Decode attention over the paged KV cache on the CPU, reading each sequence's blocks in place.
//
// torch.ops.raypage.paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale):
//   out, query   [num_seqs, num_heads, head_dim], one query token per sequence
//   kv_cache     [2, num_kv_heads, num_blocks, block_size, head_dim], contiguous (keys, then values)
//   block_table  [num_seqs, >= blocks needed] int64, any strides (a slice of the batch's table)
//   seq_lens     [num_seqs] int64, tokens each sequence attends to (its cached context and itself)
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Three primitives carry all the arithmetic: widening a row of the cache to float32, a dot product
// and acc += p * x. With AVX-512 (the library is compiled with -march=native) they work on 16 floats
// at a time; otherwise plain loops, which -O3 vectorizes as far as it can.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;

inline __m512 load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_floats(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load_floats(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
constexpr int64_t kLanes = 1;
#endif

// dst[0:n] = float(src[0:n])
template <typename T>
inline void widen(float* __restrict dst, const T* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(dst + i, load_floats(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 partial = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) partial = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), partial);
  sum = _mm512_reduce_add_ps(partial);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// acc[0:dim] += sum over t < n of p[t] * float(rows[t * dim : (t + 1) * dim]): one block's values.
// Each 16-float slice of acc stays in a register across the block's rows instead of going through
// memory once per row.
template <typename T>
inline void accumulate_rows(float* __restrict acc, const float* __restrict p, const T* __restrict rows, int64_t n,
                            int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + kLanes <= dim; d += kLanes) {
    __m512 sum = _mm512_loadu_ps(acc + d);
    for (int64_t t = 0; t < n; ++t) sum = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load_floats(rows + t * dim + d), sum);
    _mm512_storeu_ps(acc + d, sum);
  }
#endif
  for (; d < dim; ++d) {
    for (int64_t t = 0; t < n; ++t) acc[d] += p[t] * static_cast<float>(rows[t * dim + d]);
  }
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 round16(__m512 x);
template <>
inline __m512 round16<float>(__m512 x) {
  return x;
}
template <>
inline __m512 round16<c10::BFloat16>(__m512 x) {  // to nearest even, as c10::BFloat16(float) for finite x
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
template <>
inline __m512 round16<c10::Half>(__m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// p[0:n] = round_to<T>(p * pre) * post
template <typename T>
inline void round_scaled(float* p, int64_t n, float pre, float post) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 before = _mm512_set1_ps(pre), after = _mm512_set1_ps(post);
  for (; i + kLanes <= n; i += kLanes) {
    _mm512_storeu_ps(p + i, _mm512_mul_ps(round16<T>(_mm512_mul_ps(_mm512_loadu_ps(p + i), before)), after));
  }
#endif
  for (; i < n; ++i) p[i] = round_to<T>(p[i] * pre) * post;
}

#if defined(__AVX512F__)
// e^x for 16 floats within about 2 ulp: Cephes' expf (range reduction by ln 2, a degree-6 polynomial,
// the exponent put back by scalef), 16 lanes at a time where std::exp takes one.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}
#endif

// p[0:n] = e^(p - peak); returns their sum.
inline float exp_shifted(float* p, int64_t n, float peak) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 sums = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), shift));
    _mm512_storeu_ps(p + i, e);
    sums = _mm512_add_ps(sums, e);
  }
  total = _mm512_reduce_add_ps(sums);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - peak);
    total += p[i];
  }
  return total;
}

// Blocks lie anywhere in a cache of many megabytes: without prefetching, the kernel spent most of
// its time waiting for each key and value row to arrive from memory.
template <typename T>
inline void prefetch(const T* data, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t offset = 0; offset < elems * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens, float scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3), group = num_heads / num_kv_heads;
  const int64_t table_width = block_table.size(1);
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_seq_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t bt_seq_stride = block_table.stride(0), bt_block_stride = block_table.stride(1);
  const int64_t lens_stride = seq_lens.stride(0);
  const int64_t block_elems = block_size * head_dim;
  const int64_t head_elems = num_blocks * block_elems;  // one KV head's keys (or values), all blocks

  const T* q_data = query.const_data_ptr<T>();
  const T* k_data = kv_cache.const_data_ptr<T>();
  const T* v_data = k_data + num_kv_heads * head_elems;
  const int64_t* bt_data = block_table.const_data_ptr<int64_t>();
  const int64_t* lens_data = seq_lens.const_data_ptr<int64_t>();
  T* o_data = out.mutable_data_ptr<T>();

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
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(group * head_dim), row(head_dim), acc(group * head_dim), scores(group * max_len);
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = lens_data[s * lens_stride];
      for (int64_t g = 0; g < group; ++g) {
        widen(&q[g * head_dim], q_data + s * q_seq_stride + (h * group + g) * q_head_stride, head_dim);
      }
      // Physical block of token t0's logical block; the next one is prefetched while this one is used.
      const auto block_of = [&](int64_t t0) {
        const int64_t block = bt_data[s * bt_seq_stride + (t0 / block_size) * bt_block_stride];
        TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block,
                    " out of range [0, ", num_blocks, ")");
        return block;
      };
      const auto prefetch_next = [&](const T* cache, int64_t t0) {
        if (t0 + block_size < len) prefetch(cache + h * head_elems + block_of(t0 + block_size) * block_elems, block_elems);
      };
      // Pass 1: every query head's score against every key, block by block where the keys lie.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        prefetch_next(k_data, t0);
        const T* keys = k_data + h * head_elems + block_of(t0) * block_elems;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t) {
          widen(row.data(), keys + (t - t0) * head_dim, head_dim);
          for (int64_t g = 0; g < group; ++g) {
            scores[g * max_len + t] = dot(&q[g * head_dim], row.data(), head_dim);
          }
        }
      }
      prefetch(v_data + h * head_elems + block_of(0) * block_elems, block_elems);
      // Softmax in float32 per query head; probabilities rounded to the cache dtype.
      for (int64_t g = 0; g < group; ++g) {
        float* p = &scores[g * max_len];
        round_scaled<T>(p, len, 1.f, scale);  // a bf16 matmul's output, scaled in float32
        const float total = exp_shifted(p, len, *std::max_element(p, p + len));
        round_scaled<T>(p, len, 1.f / total, 1.f);
      }
      // Pass 2: the probability-weighted sum of the values, read block by block in place.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        prefetch_next(v_data, t0);
        const T* values = v_data + h * head_elems + block_of(t0) * block_elems;
        for (int64_t g = 0; g < group; ++g) {
          accumulate_rows(&acc[g * head_dim], &scores[g * max_len + t0], values, std::min(block_size, len - t0),
                          head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = o_data + s * o_seq_stride + (h * group + g) * o_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
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
  if (query.size(0) == 0) return;
  const float fscale = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, kv_cache, block_table, seq_lens, fscale);
    case at::kBFloat16:
      return decode_kernel<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens, fscale);
    case at::kHalf:
      return decode_kernel<c10::Half>(out, query, kv_cache, block_table, seq_lens, fscale);
    default:
      TORCH_CHECK(false, "paged_decode_attention: dtype ", query.scalar_type(),
                  " is not supported (float32, bfloat16, float16)");
  }
}

}  // namespace

TORCH_LIBRARY(raypage, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
