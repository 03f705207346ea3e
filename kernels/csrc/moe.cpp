// A mixture-of-experts feed-forward block on the CPU: every token through its top-k experts in one call.
//
// torch.ops.raypage.moe_experts(hidden [T, H], topk_ids [T, K] int64, topk_weights [T, K] float32,
//     w13 [E, 2I, H], w2 [E, H, I], first_expert) -> [T, H] in hidden's dtype
//   out[t] = sum over k of topk_weights[t, k] * w2[e] (silu(gate_e x_t) * (up_e x_t)), e = topk_ids[t, k]
//   - first_expert, where w13[e] stacks expert e's gate rows over its up rows. Ids outside
//   [first_expert, first_expert + E) are experts another rank holds (expert parallelism): they add
//   nothing here. float32, bf16 or float16, all one dtype; the weights as loaded, contiguous.
//
// Why one call: a per-expert loop in torch runs some ten operators per expert (a search, a gather,
// two matmuls, the activation, the scale, an index_add), each a dispatch and a pass over memory, and
// each matmul so thin (a few rows per expert at decode sizes) that it cannot keep both cores busy
// streaming the expert's weights. Here the (token, k) pairs are grouped by expert once (a counting
// sort), and the work items are (expert, block of output columns) for all experts together, handed
// to the threads from an atomic counter, most rows first, so the cores stream different experts'
// weights at the same time however unevenly the router spreads the tokens.
//
// Work. Phase 1, per item (expert, block of kBlockCols intermediate columns): the expert's rows
// times the block's gate rows and its up rows, and the epilogue silu(gate) * up into `act` (one row
// per (token, k) pair, grouped by expert). Phase 2, per item
// (expert, block of hidden columns): the act rows times w2's rows into `down`. Phase 3, per token:
// the weighted sum of its rows of `down`, k in order. The products run on AMX tiles or on
// dot-product tiles (moe_tiles.h says which, and how); the weights are used as loaded, no packing.
//
// Numerics follow the torch reference (kernels/moe.py, fused_experts_torch) operator by operator:
// each projection a float32 sum of products rounded to the dtype, silu(gate) and the product rounded
// as silu_and_mul rounds them, the weighted sum in float32 rounded once. Only the order of the
// float32 sums differs (and SiLU's exponential, in its last place: simd.h's exp_lanes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moe_tiles.h"

namespace {

using namespace raypage::moe_tiles;

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// out[j] = silu(gate[j]) * up[j] for sums of projections, each step rounded to T as silu_and_mul
// of the rounded projections rounds.
template <typename T>
void silu_and_mul_row(const float* gate, const float* up, int64_t n, T* out) {
  int64_t j = 0;
#if defined(RAYPAGE_SIMD)
  for (; j + kLanes <= n; j += kLanes) {
    const Vec g = round_lanes<T>(load_floats(gate + j)), u = round_lanes<T>(load_floats(up + j));
    store_rounded(out + j, round_lanes<T>(mul(round_lanes<T>(silu_lanes(g)), u)));
  }
#endif
  for (; j < n; ++j) {
    const float g = round_to<T>(gate[j]);
    out[j] = static_cast<T>(round_to<T>(g / (1.f + std::exp(-g))) * round_to<T>(up[j]));
  }
}

template <typename T>
void store_row(const float* sums, int64_t n, T* out) {
  int64_t j = 0;
#if defined(RAYPAGE_SIMD)
  for (; j + kLanes <= n; j += kLanes) store_rounded(out + j, round_lanes<T>(load_floats(sums + j)));
#endif
  for (; j < n; ++j) out[j] = static_cast<T>(sums[j]);
}

// The (token, k) pairs of the experts held here, grouped by expert, in token order within each.
struct Groups {
  std::vector<int64_t> offsets;  // [E + 1]: expert e's rows are offsets[e] .. offsets[e + 1]
  std::vector<int64_t> tokens;   // the token of each row
  std::vector<int64_t> row_of;   // [T * K]: the row of each pair, -1 for another rank's expert
};

Groups group_by_expert(const int64_t* ids, int64_t pairs, int64_t top_k, int64_t first_expert, int64_t experts) {
  Groups groups{std::vector<int64_t>(experts + 1, 0), {}, std::vector<int64_t>(pairs, -1)};
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first_expert;
    if (e >= 0 && e < experts) ++groups.offsets[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) groups.offsets[e + 1] += groups.offsets[e];
  groups.tokens.resize(groups.offsets[experts]);
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p] - first_expert;
    if (e < 0 || e >= experts) continue;
    groups.row_of[p] = next[e]++;
    groups.tokens[groups.row_of[p]] = p / top_k;
  }
  return groups;
}

struct Item {
  int64_t expert, column;
};

// Every (expert with rows, block of `columns`), the experts with most rows first.
std::vector<Item> items_of(const Groups& groups, int64_t columns) {
  std::vector<int64_t> experts;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(groups.offsets.size()); ++e)
    if (groups.offsets[e + 1] > groups.offsets[e]) experts.push_back(e);
  std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) {
    return groups.offsets[a + 1] - groups.offsets[a] > groups.offsets[b + 1] - groups.offsets[b];
  });
  std::vector<Item> items;
  for (const int64_t e : experts)
    for (int64_t c = 0; c < columns; c += kBlockCols) items.push_back({e, c});
  return items;
}

template <typename Body>
void run_items(const std::vector<Item>& items, Body body) {
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < count; i = next++) body(items[i]);
  });
}

template <typename T>
void run_moe(const T* hidden, int64_t num_tokens, int64_t hidden_size, const int64_t* ids, const float* weights,
             int64_t top_k, const T* w13, const T* w2, int64_t experts, int64_t inter, int64_t first_expert, T* act,
             T* down, T* out) {
  const Groups groups = group_by_expert(ids, num_tokens * top_k, top_k, first_expert, experts);
  static std::atomic<uint64_t> phases{0};
  const uint64_t gate_up_phase = ++phases, down_phase = ++phases;
  run_items(items_of(groups, inter), [&](const Item& item) {
    const int64_t first = groups.offsets[item.expert], width = std::min(kBlockCols, inter - item.column);
    const T* gate_w = w13 + (item.expert * 2 * inter + item.column) * hidden_size;
    const std::array<const T*, 2> gate_up{gate_w, gate_w + inter * hidden_size};
    project_rows(
        groups.offsets[item.expert + 1] - first,
        [&](int64_t r) { return hidden + groups.tokens[first + r] * hidden_size; }, gate_up, width, hidden_size,
        [&](int64_t r, const std::array<const float*, 2>& sums) {
          silu_and_mul_row(sums[0], sums[1], width, act + (first + r) * inter + item.column);
        },
        GroupKey{gate_up_phase, item.expert});
  });
  run_items(items_of(groups, hidden_size), [&](const Item& item) {
    const int64_t first = groups.offsets[item.expert], width = std::min(kBlockCols, hidden_size - item.column);
    const std::array<const T*, 1> w{w2 + (item.expert * hidden_size + item.column) * inter};
    project_rows(
        groups.offsets[item.expert + 1] - first, [&](int64_t r) { return act + (first + r) * inter; }, w, width,
        inter, [&](int64_t r, const std::array<const float*, 1>& sums) {
          store_row(sums[0], width, down + (first + r) * hidden_size + item.column);
        },
        GroupKey{down_phase, item.expert});
  });
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden_size);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t row = groups.row_of[t * top_k + k];
        if (row < 0) continue;
        const float weight = weights[t * top_k + k];
        const T* y = down + row * hidden_size;
        int64_t j = 0;
#if defined(RAYPAGE_SIMD)
        // A product, then a sum, each rounded: the reference's (y * weight).sum(), not a fused multiply-add.
        for (; j + kLanes <= hidden_size; j += kLanes)
          store_floats(acc.data() + j, add(load_floats(acc.data() + j), mul(load_floats(y + j), set1(weight))));
#endif
        for (; j < hidden_size; ++j) acc[j] += static_cast<float>(y[j]) * weight;
      }
      store_row(acc.data(), hidden_size, out + t * hidden_size);
    }
  });
}

at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13, const at::Tensor& w2, int64_t first_expert) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "moe_experts: hidden must be float32, bf16 or float16, got ", dtype);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "moe_experts: hidden must be contiguous [tokens, hidden]");
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == num_tokens && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "moe_experts: topk_ids must be contiguous int64 [", num_tokens, ", top_k], got ", topk_ids.scalar_type(),
              " of shape ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "moe_experts: topk_weights must be contiguous float32 shaped like topk_ids");
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == hidden_size && w13.size(1) % 2 == 0 && w13.scalar_type() == dtype &&
                  w13.is_contiguous(),
              "moe_experts: w13 must be contiguous [experts, 2 * intermediate, ", hidden_size,
              "] of hidden's dtype, got ", w13.scalar_type(), " of shape ", w13.sizes());
  const int64_t experts = w13.size(0), inter = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == experts && w2.size(1) == hidden_size && w2.size(2) == inter &&
                  w2.scalar_type() == dtype && w2.is_contiguous(),
              "moe_experts: w2 must be contiguous [", experts, ", ", hidden_size, ", ", inter,
              "] of hidden's dtype, got ", w2.scalar_type(), " of shape ", w2.sizes());
  const int64_t top_k = topk_ids.size(1);
  at::Tensor out = at::empty_like(hidden);
  if (num_tokens == 0) return out;
  at::Tensor act = at::empty({num_tokens * top_k, inter}, hidden.options());
  at::Tensor down = at::empty({num_tokens * top_k, hidden_size}, hidden.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    run_moe<T>(hidden.const_data_ptr<T>(), num_tokens, hidden_size, topk_ids.const_data_ptr<int64_t>(),
               topk_weights.const_data_ptr<float>(), top_k, w13.const_data_ptr<T>(), w2.const_data_ptr<T>(), experts,
               inter, first_expert, act.mutable_data_ptr<T>(), down.mutable_data_ptr<T>(), out.mutable_data_ptr<T>());
  };
  if (dtype == at::kFloat) run(float{});
  if (dtype == at::kBFloat16) run(bf16{});
  if (dtype == at::kHalf) run(c10::Half{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def("moe_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, int first_expert=0)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("moe_experts", &moe_experts); }
