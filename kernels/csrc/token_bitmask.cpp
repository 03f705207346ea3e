// A grammar's token bitmask applied to logits in place (structured outputs): every token that its
// row's mask disallows gets -inf, so that sampling can only pick an allowed one.
//
// torch.ops.raypage.apply_token_bitmask(logits, bitmask, rows)   logits written in place
//
// logits: [num_rows, vocab] float32, bf16 or fp16, each row contiguous, any row stride. bitmask:
// [n, words] int32 in llguidance's and xgrammar's layout: bit t % 32 (least significant first) of
// word t / 32 is set where token t is allowed; any row stride. rows: n distinct int64 indices into
// logits, mask row i applying to logits row rows[i]; None for rows 0 .. n-1. Tokens at or past
// 32 * words get -inf too (a model's vocabulary may be padded beyond its tokenizer's); mask bits at
// or past vocab are ignored. kernels/token_bitmask.py holds the same in plain torch and in Triton.
//
// A grammar state allows either nearly every token (free text inside a JSON string) or a few (the
// punctuation that may come next), so most words are all ones, which cost only reading the word, or
// all zeros, 32 stores of -inf that the compiler makes whole vector stores. Only mixed words select
// bit by bit, in a loop of fixed length that the compiler turns into vector blends. Nothing is
// computed with the logits: each element keeps its bits or gets -inf's, so the kernel works on the
// dtypes' storage as unsigned integers of their width, one instantiation per width.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

// -inf's bit pattern in each dtype's storage.
constexpr uint32_t kNegInfFloat = 0xff800000u;
constexpr uint16_t kNegInfBFloat16 = 0xff80u;
constexpr uint16_t kNegInfHalf = 0xfc00u;

// Mask words per parallel task: a row of a large vocabulary is work enough for a thread, while a few
// rows of a small one would cost more to hand to a second thread than they take.
constexpr int64_t kWordsPerTask = 4096;

// One row: `mask` holds `words` words, `row` holds `vocab` logits.
template <typename Bits>
void mask_row(Bits* row, const int32_t* mask, int64_t words, int64_t vocab, Bits neg_inf) {
  // Words whose 32 tokens all lie inside the vocabulary.
  const int64_t whole_words = std::min(words, vocab / 32);
  for (int64_t j = 0; j < whole_words; ++j) {
    const uint32_t word = static_cast<uint32_t>(mask[j]);
    if (word == 0xffffffffu) continue;
    Bits* out = row + 32 * j;
    if (word == 0) {
      for (int b = 0; b < 32; ++b) out[b] = neg_inf;
      continue;
    }
    // Every element is stored, the allowed ones unchanged: a branch per bit would not vectorize.
    for (int b = 0; b < 32; ++b) out[b] = ((word >> b) & 1u) ? out[b] : neg_inf;
  }
  int64_t token = 32 * whole_words;
  if (whole_words < words) {
    // The mask reaches past the vocabulary: one word straddles its end (none where vocab % 32 == 0),
    // its bits past the end ignored.
    const uint32_t word = static_cast<uint32_t>(mask[whole_words]);
    for (int b = 0; token < vocab; ++b, ++token) {
      if (!((word >> b) & 1u)) row[token] = neg_inf;
    }
  }
  // Tokens past the mask's width.
  std::fill(row + token, row + vocab, neg_inf);
}

template <typename Bits>
void mask_rows(at::Tensor& logits, const at::Tensor& bitmask, const int64_t* rows, Bits neg_inf) {
  const int64_t n = bitmask.size(0), words = bitmask.size(1), vocab = logits.size(1);
  Bits* base = static_cast<Bits*>(logits.data_ptr());
  const int32_t* masks = bitmask.const_data_ptr<int32_t>();
  const int64_t logits_stride = logits.stride(0), mask_stride = bitmask.stride(0);
  const int64_t grain = std::max<int64_t>(1, kWordsPerTask / std::max<int64_t>(words, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = rows != nullptr ? rows[i] : i;
      mask_row(base + row * logits_stride, masks + i * mask_stride, words, vocab, neg_inf);
    }
  });
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu(), "logits and bitmask must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "bitmask must be int32 [n, words] with contiguous rows");
  const int64_t n = bitmask.size(0), num_rows = logits.size(0);
  const int64_t* row_ids = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->device().is_cpu() && rows->scalar_type() == at::kLong && rows->dim() == 1 &&
                    rows->is_contiguous() && rows->numel() == n,
                "rows must be a contiguous int64 [n] CPU tensor, one logits row per mask row");
    row_ids = rows->const_data_ptr<int64_t>();
    // Checked before any thread writes: a row out of range would be a write outside logits.
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "row ", row_ids[i], " is outside logits' ", num_rows,
                  " rows");
    }
  } else {
    TORCH_CHECK(n == num_rows, "without rows the bitmask needs one row per logits row");
  }
  switch (logits.scalar_type()) {
    case at::kFloat:
      mask_rows<uint32_t>(logits, bitmask, row_ids, kNegInfFloat);
      break;
    case at::kBFloat16:
      mask_rows<uint16_t>(logits, bitmask, row_ids, kNegInfBFloat16);
      break;
    case at::kHalf:
      mask_rows<uint16_t>(logits, bitmask, row_ids, kNegInfHalf);
      break;
    default:
      TORCH_CHECK(false, "apply_token_bitmask takes float32, bfloat16 or float16 logits, not ",
                  logits.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? rows) -> ()");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
