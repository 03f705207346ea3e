// Where one paged-attention call's tensors lie: query and output rows, the KV cache's blocks and the
// block table, as strides and base pointers that every work item reads through. Shared by the decode
// kernel (paged_attention.cpp) and the tiled one (tiled_attention.cpp), which add what each needs.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace raypage {

template <typename T>
struct PagedLayout {
  const char* op;  // the operator's name, for error messages
  int64_t head_dim, block_size, group, num_blocks, block_elems, head_elems;
  int64_t q_row_stride, q_head_stride, o_row_stride, o_head_stride, bt_seq_stride, bt_block_stride;
  const T *q_data, *k_data, *v_data;
  const int64_t* bt_data;
  T* o_data;

  // query and out [rows, num_heads, head_dim]; kv_cache [2, kv_heads, num_blocks, block_size,
  // head_dim], contiguous; block_table [num_seqs, blocks], any strides.
  PagedLayout(const char* op, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
              const at::Tensor& block_table)
      : op(op),
        head_dim(query.size(2)),
        block_size(kv_cache.size(3)),
        group(query.size(1) / kv_cache.size(1)),
        num_blocks(kv_cache.size(2)),
        block_elems(block_size * head_dim),
        head_elems(num_blocks * block_elems),  // one KV head's keys (or values), all blocks
        q_row_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        o_row_stride(out.stride(0)),
        o_head_stride(out.stride(1)),
        bt_seq_stride(block_table.stride(0)),
        bt_block_stride(block_table.stride(1)),
        q_data(query.const_data_ptr<T>()),
        k_data(kv_cache.const_data_ptr<T>()),
        v_data(k_data + kv_cache.size(1) * head_elems),
        bt_data(block_table.const_data_ptr<int64_t>()),
        o_data(out.mutable_data_ptr<T>()) {}

  const T* query_row(int64_t row, int64_t head) const { return q_data + row * q_row_stride + head * q_head_stride; }
  T* out_row(int64_t row, int64_t head) const { return o_data + row * o_row_stride + head * o_head_stride; }
  // The first row of the block holding token t of sequence s (keys or values of KV head h: `cache`
  // is k_data or v_data), its id checked against the cache's size.
  inline __attribute__((always_inline)) const T* block(const T* cache, int64_t s, int64_t h, int64_t t) const {
    const int64_t id = bt_data[s * bt_seq_stride + (t / block_size) * bt_block_stride];
    TORCH_CHECK(id >= 0 && id < num_blocks, op, ": block id ", id, " out of range [0, ", num_blocks, ")");
    return cache + h * head_elems + id * block_elems;
  }
};

}  // namespace raypage
