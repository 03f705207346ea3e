// A whole pre-norm Llama decoder layer in one call, on the CPU kernels of this library.
//
// torch.ops.raypage.llama_decoder_layer(hidden, residual?, positions, input_norm, qkv, qkv_packs,
//     qkv_bias?, o, o_packs, post_norm, gate_up, gate_up_packs, down, down_packs, cos, sin, kv_cache,
//     slot_mapping, block_table, seq_lens, query_start_loc, num_decodes, shared_blocks, num_heads,
//     num_kv_heads, eps, scale) -> (hidden, residual)
//
// The same operators, in the same order, as LlamaDecoderLayer.forward with the CPU kernels
// (engine/models/llama.py): the input norm (adding the residual after the first layer), the QKV
// projection, rotary embedding in place, the step's keys and values into the cache,
// decode rows through paged_decode_attention (cascade_decode_attention over `shared_blocks` leading
// blocks they hold in common, where the caller found that it pays) and prefill chunks through
// tiled_prefill_attention, the output projection, the post-attention norm, the gated MLP's SiLU and
// product, and the down projection. The results are the same bit for bit; what goes is Python: a
// decode step of a small model runs about 35 operators per layer, each a Python call, a dispatch and
// its wrappers' checks, a noticeable share of a small model's decode step (docs/performance.md) that
// this call replaces with a dozen dispatches from C++.
//
// Each projection's weight is a list of tensors and a list of ints (`Projection` below): bf16
// panels from pack_panels (gate_up in two shards, gate and up, multiplied with the SiLU and product
// in the kernel's epilogue), or GGUF blocks as kernels/quant_linear.py packs them, multiplied by
// quant_gemv (so at most GEMV_MAX_ROWS tokens: the caller runs larger batches layer by layer).
// hidden and residual bf16 [tokens, hidden_size]; the attention arguments as cpu_paged_attention
// reads them (kernels/attention/cpu_paged.py), with the decode rows first. A fused layer has no
// sliding window and no soft cap (engine/models/fused_layers.py fuses only such layers). Nothing is
// checked here that the operators do not check themselves.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// The library's operators, looked up once by name.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// A projection's weight as the caller passes it, multiplied as kernels/linear.py's `linear` and
// `silu_and_mul_linear` multiply it: one tensor of packed panels (`packs` empty), or GGUF packs,
// `weights` holding each pack's (quants, scales) in turn and `packs` each one's (ggml_type, rows).
class Projection {
 public:
  Projection(at::TensorList weights, at::IntArrayRef packs) : weights_(weights), packs_(packs) {}

  Tensor operator()(const Tensor& x, const std::optional<Tensor>& bias) const {
    static const auto panel_linear =
        op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>("raypage::panel_linear");
    if (packs_.empty()) return panel_linear.call(x, weights_[0], bias);
    if (packs_.size() == 2) return pack(x, 0, bias);
    // Rows of several formats (Q4_K_M's Q4_K and Q6_K): each pack's product, side by side.
    std::vector<Tensor> parts;
    for (size_t index = 0; index < packs_.size() / 2; ++index) parts.push_back(pack(x, index, std::nullopt));
    const Tensor out = at::cat(parts, -1);
    return bias ? out + *bias : out;
  }

  // silu(gate) * up of the projection [gate | up].
  Tensor silu_and_mul(const Tensor& x) const {
    static const auto panel_silu_and_mul =
        op<Tensor(const Tensor&, const Tensor&)>("raypage::panel_silu_and_mul");
    static const auto silu_and_mul = op<Tensor(const Tensor&)>("raypage::silu_and_mul");
    if (packs_.empty()) return panel_silu_and_mul.call(x, weights_[0]);
    return silu_and_mul.call((*this)(x, std::nullopt));
  }

 private:
  Tensor pack(const Tensor& x, size_t index, const std::optional<Tensor>& bias) const {
    static const auto quant_gemv =
        op<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, const std::optional<Tensor>&)>(
            "raypage::quant_gemv");
    return quant_gemv.call(x, weights_[2 * index], weights_[2 * index + 1], packs_[2 * index], packs_[2 * index + 1],
                           bias);
  }

  at::TensorList weights_;
  at::IntArrayRef packs_;
};

std::tuple<Tensor, Tensor> llama_decoder_layer(
    Tensor hidden, const std::optional<Tensor>& residual_in, const Tensor& positions, const Tensor& input_norm,
    at::TensorList qkv_weight, at::IntArrayRef qkv_packs, const std::optional<Tensor>& qkv_bias,
    at::TensorList o_weight, at::IntArrayRef o_packs, const Tensor& post_norm, at::TensorList gate_up_weight,
    at::IntArrayRef gate_up_packs, at::TensorList down_weight, at::IntArrayRef down_packs, const Tensor& cos,
    const Tensor& sin, Tensor kv_cache,
    const Tensor& slot_mapping, const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
    int64_t num_decodes, int64_t shared_blocks, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  static const auto rms_norm = op<Tensor(const Tensor&, const Tensor&, double)>("raypage::rms_norm");
  static const auto add_rms_norm = op<void(Tensor&, Tensor&, const Tensor&, double)>("raypage::fused_add_rms_norm");
  static const auto rotary =
      op<void(const Tensor&, Tensor&, Tensor&, const Tensor&, const Tensor&)>("raypage::rotary_embedding");
  static const auto cache_write =
      op<void(const Tensor&, const Tensor&, Tensor&, const Tensor&)>("raypage::reshape_and_cache");
  static const auto decode_attention =
      op<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
              const std::optional<Tensor>&, int64_t, double)>("raypage::paged_decode_attention");
  static const auto cascade_attention =
      op<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double)>(
          "raypage::cascade_decode_attention");
  static const auto prefill_attention =
      op<void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t,
              double)>("raypage::tiled_prefill_attention");
  const Projection qkv_proj(qkv_weight, qkv_packs), o_proj(o_weight, o_packs);
  const Projection gate_up_proj(gate_up_weight, gate_up_packs), down_proj(down_weight, down_packs);

  Tensor residual;
  if (residual_in.has_value()) {
    residual = *residual_in;
    add_rms_norm.call(hidden, residual, input_norm, eps);  // hidden = norm(hidden + residual), in place
  } else {
    residual = hidden;
    hidden = rms_norm.call(hidden, input_norm, eps);
  }
  const int64_t tokens = hidden.size(0), head_dim = kv_cache.size(4);
  const Tensor qkv = qkv_proj(hidden, qkv_bias);
  Tensor query = qkv.narrow(1, 0, num_heads * head_dim).view({tokens, num_heads, head_dim});
  Tensor key = qkv.narrow(1, num_heads * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
  const Tensor value =
      qkv.narrow(1, (num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
  rotary.call(positions, query, key, cos, sin);
  cache_write.call(key, value, kv_cache, slot_mapping);
  Tensor attended = at::empty_like(query);
  if (num_decodes > 0) {
    Tensor decoded = attended.narrow(0, 0, num_decodes);
    const Tensor rows = query.narrow(0, 0, num_decodes), table = block_table.narrow(0, 0, num_decodes);
    const Tensor lens = seq_lens.narrow(0, 0, num_decodes);
    if (shared_blocks > 0) {
      cascade_attention.call(decoded, rows, kv_cache, table, lens, shared_blocks, scale);
    } else {
      decode_attention.call(decoded, rows, kv_cache, table, lens, scale, std::nullopt, 0, 0.0);
    }
  }
  const int64_t num_seqs = seq_lens.size(0);
  if (num_decodes < num_seqs) {
    prefill_attention.call(attended, query, kv_cache, block_table.narrow(0, num_decodes, num_seqs - num_decodes),
                           seq_lens.narrow(0, num_decodes, num_seqs - num_decodes),
                           query_start_loc.narrow(0, num_decodes, num_seqs - num_decodes + 1), scale, 0, 0.0);
  }
  Tensor projected = o_proj(attended.view({tokens, num_heads * head_dim}), std::nullopt);
  add_rms_norm.call(projected, residual, post_norm, eps);
  return {down_proj(gate_up_proj.silu_and_mul(projected), std::nullopt), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raypage, m) {
  m.def(
      "llama_decoder_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor positions, Tensor input_norm, "
      "Tensor[] qkv, int[] qkv_packs, Tensor? qkv_bias, Tensor[] o, int[] o_packs, Tensor post_norm, "
      "Tensor[] gate_up, int[] gate_up_packs, Tensor[] down, int[] down_packs, Tensor cos, "
      "Tensor sin, Tensor(c!) kv_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int num_decodes, int shared_blocks, int num_heads, int num_kv_heads, float eps, "
      "float scale) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raypage, CPU, m) { m.impl("llama_decoder_layer", &llama_decoder_layer); }
