// What each kernel launcher receives: raw pointers, sizes and strides (in elements), filled by
// the checked adapters in csrc/kernels/ops/. Plain structs, shared by every backend. Shape
// comments use the names of include/octavo/ops.h.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "octavo/ops.h"
#include "octavo/tensor_view.h"

namespace octavo {

struct RmsNormParams {
  void* out;             // [rows, hidden], row stride out_stride (may alias input)
  const void* input;     // [rows, hidden], row stride in_stride; or in groups, see input_row
  void* residual;        // [rows, hidden], row stride residual_stride; null for plain rms_norm
  const void* weight;    // [hidden]
  int64_t rows, hidden, in_stride, out_stride, residual_stride;
  // 0, or the input's rows come in groups of in_group_rows, in_group_stride apart (each head of
  // q or k inside a fused QKV output's token rows: in_stride = head size, group stride = token's)
  int64_t in_group_rows = 0, in_group_stride = 0;
  DType dtype;           // of out, input, residual and weight
  float eps;
  bool weight_offset;    // multiply by (1 + weight)
};

// Element offset of input row `row`.
OCTAVO_HOST_DEVICE inline int64_t input_row(const RmsNormParams& p, int64_t row) {
  if (p.in_group_rows == 0) return row * p.in_stride;
  return row / p.in_group_rows * p.in_group_stride + row % p.in_group_rows * p.in_stride;
}

struct RotaryParams {
  const void* positions;       // [tokens], int32 or int64 (positions_dtype)
  void* query;                 // [tokens, num_heads, head_size], token stride query_stride
  void* key;                   // [tokens, num_kv_heads, head_size], token stride key_stride; or null
  const float* cos_sin_cache;  // [max_position, rot_dim]
  int64_t num_tokens, num_heads, num_kv_heads, head_size, rot_dim, query_stride, key_stride, max_position;
  DType dtype, positions_dtype;
  bool is_neox;
};

struct GatedActivationParams {
  void* out;          // [rows, d], row stride out_stride
  const void* input;  // [rows, 2d], row stride in_stride
  int64_t rows, d, in_stride, out_stride;
  DType dtype;
};

struct CacheWriteParams {
  const void* key;            // [tokens, num_kv_heads, head_size], token stride key_stride
  const void* value;          // [tokens, num_kv_heads, head_size], token stride value_stride
  void* key_cache;            // [num_blocks, num_kv_heads, block_size, head_size]
  void* value_cache;          // [num_blocks, num_kv_heads, block_size, head_size]
  const void* slot_mapping;   // [tokens], int32 or int64 (slot_dtype); -1 = skip
  int64_t num_tokens, num_kv_heads, head_size, block_size, num_blocks, key_stride, value_stride;
  DType dtype, slot_dtype;
  DType cache_dtype;          // the caches' (CPU: any float dtype, converted on write; CUDA: dtype or fp8)
  float k_scale = 1.0f, v_scale = 1.0f;  // an fp8 cache holds key / k_scale and value / v_scale
};

struct PagedAttentionParams {
  void* out;                       // [tokens, num_heads, head_size], token stride out_stride
  const void* query;               // [tokens, num_heads, head_size], token stride query_stride
  const void* key_cache;           // [num_blocks, num_kv_heads, block_size, head_size]
  const void* value_cache;         // [num_blocks, num_kv_heads, block_size, head_size]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* block_tables;     // [num_seqs, block_table_stride]
  int64_t num_seqs, num_tokens, num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int64_t block_table_stride, max_blocks_per_seq, out_stride, query_stride;  // max_blocks_per_seq: the table's width
  int64_t sliding_window;          // 0: off
  float scale, softcap;            // softcap 0: off
  DType dtype;                     // the query's and out's
  DType cache_dtype;               // the caches' (CPU: any float dtype; CUDA: dtype or fp8)
  float k_scale = 1.0f, v_scale = 1.0f;  // an fp8 cache's values are these times what it holds
  const int32_t* tile_offsets;     // CUDA only: plan_paged_attention's [num_seqs + 1], or null
  int64_t num_decodes;             // the first num_decodes sequences have one query token each (0: not counted)
};

struct LinearParams {
  void* out;             // [rows, out_features], row stride out_stride (dequantize: [out_features, in_features])
  const void* input;     // [rows, in_features], row stride in_stride
  const void* weight;    // [out_features, in_features] contiguous, or rows in weight_format
  const void* bias;      // [out_features] or null
  const float* scales;   // kInt8: [out_features]; kInt4: [out_features, in_features / group_size]
  const uint8_t* zeros;  // kInt4: [out_features, in_features / group_size]
  int64_t rows, in_features, out_features, in_stride, out_stride, group_size;
  DType dtype;           // of out, input and bias (and of a dense weight); dequantize: of out
  WeightFormat weight_format;
  bool int8_inputs;      // GGUF formats on the CPU: inputs rounded to int8 per block of 32 (linear_gguf_a8.h)
  bool tensor_cores;     // CUDA, 16-bit inputs: linear_mma.cu's kernel (WeightQuant::tensor_cores)
};

struct TopkParams {
  float* topk_weights;        // [tokens, top_k]
  int32_t* topk_ids;          // [tokens, top_k]
  const void* gating_output;  // [tokens, num_experts], row stride gating_stride
  int64_t tokens, num_experts, top_k, gating_stride;
  DType dtype;                // of gating_output
  TopkArgs args;
};

struct MoeAlignParams {
  const int32_t* topk_ids;         // [pairs] (tokens * top_k)
  int32_t* sorted_token_ids;       // [capacity]
  int32_t* expert_ids;             // [capacity / block_size]
  int32_t* num_tokens_post_padded; // [1]
  int64_t pairs, num_experts, block_size, capacity;
};

// One expert stack in launcher form: expert e's rows start at weight + e * expert_bytes (and its
// scales / zero points at e * expert_scales / e * expert_zeros elements).
struct ExpertStack {
  const void* weight;
  const float* scales;
  const uint8_t* zeros;
  int64_t rows, expert_bytes, expert_scales, expert_zeros, group_size;  // rows: N per expert
  WeightFormat format;
};

struct FusedMoeParams {
  void* out;                  // [tokens, hidden], row stride out_stride
  const void* hidden_states;  // [tokens, hidden], row stride in_stride
  const float* topk_weights;  // [tokens, top_k]
  const int32_t* topk_ids;    // [tokens, top_k], in [0, num_experts) or -1
  ExpertStack w13, w2;        // [E, 2 * intermediate, hidden], [E, hidden, intermediate]
  int64_t tokens, hidden, intermediate, num_experts, top_k, in_stride, out_stride;
  DType dtype;
};

struct TokenBitmaskParams {
  float* logits;           // [batch_rows, vocab_size], row stride logits_stride
  int64_t batch_rows, vocab_size, logits_stride;
  const int32_t* bitmask;  // [num_rows, words], bit t % 32 of word t / 32 set = token t allowed
  int64_t num_rows, words;
  const int32_t* indices;  // [num_rows]: the logits row of each bitmask row, or null (row i)
};

struct SampleParams {
  const float* logits;  // [num_reqs, vocab_size], row stride logits_stride
  int64_t num_reqs, vocab_size, logits_stride;
  const float* temperature;         // [num_reqs]
  const int32_t* top_k;             // [num_reqs] or null, likewise below
  const float* top_p;
  const float* min_p;
  const float* repetition_penalty;
  const float* frequency_penalty;
  const float* presence_penalty;
  const int32_t* prompt_offsets;    // [num_reqs + 1] CSR into prompt_token_ids, or null
  const int32_t* prompt_token_ids;
  const int32_t* output_offsets;    // [num_reqs + 1] CSR into output_token_ids, or null
  const int32_t* output_token_ids;
  const int32_t* bias_offsets;      // [num_reqs + 1] CSR into bias_token_ids / bias_values, or null
  const int32_t* bias_token_ids;
  const float* bias_values;         // added to the logits; -inf bans
  const int32_t* only_listed;       // [num_reqs] or null: nonzero bans every token not in the row's list
  const int64_t* seeds;             // [num_reqs]
  const int64_t* counters;          // [num_reqs]
  int32_t* sampled;                 // [num_reqs]
  float* sampled_logprobs;          // [num_reqs] or null
  int32_t* sampled_ranks;           // [num_reqs] or null
  int32_t* top_token_ids;           // [num_reqs, num_top] or null
  float* top_logprobs;              // [num_reqs, num_top] or null
  int64_t num_top;
  const int32_t* draft_token_ids;   // [num_reqs] or null (rejection_sample): the draft row r checks, -1: none
  int32_t* accepted;                // [num_reqs] with draft_token_ids: 1 where sampled[r] is the draft
};

}  // namespace octavo
