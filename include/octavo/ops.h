// Octavo's kernels as functions on tensor views: the one public entry point per op, with the
// same name in C++, in octavo._C.ops and in Python. Each checks its arguments (a bad dtype is a
// TypeError-kind Error, a bad shape / device / layout a ValueError-kind Error naming the
// argument) and runs where its tensors live: the best compiled CPU variant (see cpu_isa.h) on
// the thread pool (threading.h), or the CUDA kernel on this thread's current device and stream
// (cuda_info.h), when this build has CUDA kernels.
//
// Shapes use T = tokens, H = query heads, Hkv = KV heads, D = head size, B = sequences,
// V = vocabulary. "Rows" arguments may have any row stride as long as each row is contiguous,
// so views such as the query slice of a fused QKV output are accepted without copies.
// Activations are float32, bfloat16 or float16; all math accumulates in float32.
#pragma once

#include <cstdint>

#include "octavo/tensor_view.h"

namespace octavo {

// out = input / sqrt(mean(input^2) + eps) * weight, per row. weight_offset: Gemma's (1 + weight).
// out, input: [rows, hidden] (any leading shape); weight: [hidden]. out may alias input. input may
// also be [tokens, heads, hidden] with its own token stride (the heads of q or k inside a fused
// QKV output, normalized per head where they are); out is then [tokens, heads, hidden] too.
void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              bool weight_offset = false);

// residual += input; input = rms_norm(residual) * weight. Both updated in place, as in vLLM.
void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight, double eps,
                        bool weight_offset = false);

// Rotates query and key in place by their tokens' positions.
// positions: [T] int32 or int64, each in [0, max_position)
// query: [T, H * head_size] or [T, H, head_size]; key: the same with Hkv heads, or null
// cos_sin_cache: [max_position, rot_dim] float32, cos in [:rot_dim/2], sin in [rot_dim/2:];
//   rot_dim <= head_size rotates only the first rot_dim dims of each head (partial rotary).
// is_neox: pairs (i, i + rot_dim/2) (GPT-NeoX / Llama) or (2i, 2i+1) (GPT-J).
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView* key,
                      int64_t head_size, const TensorView& cos_sin_cache, bool is_neox);

// out = act(input[..., :d]) * input[..., d:]. input: [rows, 2d]; out: [rows, d].
void silu_and_mul(const TensorView& out, const TensorView& input);
enum class GeluApproximation { kNone, kTanh };  // exact erf form, or the tanh approximation
void gelu_and_mul(const TensorView& out, const TensorView& input, GeluApproximation approximate);

// Writes the step's new keys and values into the paged cache.
// key, value: [T, Hkv, D]; key_cache, value_cache: [num_blocks, Hkv, block_size, D] (contiguous);
// slot_mapping: [T] int32 or int64, block_id * block_size + offset, or -1 to skip the token.
// The caches may hold another float dtype than key / value (rounded to it; CUDA: on the CPU only)
// or fp8 (float8_e4m3fn, CPU and CUDA): then they hold key / k_scale and value / v_scale, rounded
// to the nearest E4M3 value and saturated at +-448 (vLLM's fp8 KV cache). Other caches take scales of 1.
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, double k_scale = 1.0,
                       double v_scale = 1.0);

// Attention over the paged cache for a flat batch mixing prefill chunks and decodes. Sequence b
// owns query rows [query_start_loc[b], query_start_loc[b+1]); its seq_lens[b] tokens of context
// (the new ones included, already written by reshape_and_cache) are found through
// block_tables[b]. The query row i of a chunk of n sits at position seq_len - n + i and sees
// keys at positions <= its own (and > its own - sliding_window when sliding_window > 0).
// out, query: [T, H, D]; key_cache, value_cache: [num_blocks, Hkv, block_size, D];
// query_start_loc: [B + 1] int32; seq_lens: [B] int32; block_tables: [B, max_blocks] int32.
// softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2).
// plan: null, or plan_paged_attention's result for this batch's query_start_loc and heads, on
// the query's device. The CUDA kernels use it (without one they lay the batch out on the device
// per call); the CPU kernel needs none and ignores it.
// num_decodes: how many of the batch's first sequences have one query token each (the caller
// knows its batch; 0 says nothing). On CUDA a batch with prompt chunks runs those decodes in
// the decode kernels, which split long contexts over the GPU, and the rest in the prefill
// kernel. The CPU checks the count; CUDA cannot read the batch on the host, so a wrong count
// there gives wrong rows (never a read outside the batch).
// The caches may hold another float dtype than the query (CPU only), or fp8 (CPU and CUDA).
// k_scale, v_scale: an fp8 cache's
// (reshape_and_cache); other caches take 1.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& query_start_loc, const TensorView& seq_lens,
                     const TensorView& block_tables, double scale, int64_t sliding_window = 0, double softcap = 0.0,
                     const TensorView* plan = nullptr, int64_t num_decodes = 0, double k_scale = 1.0,
                     double v_scale = 1.0);

// The host half of paged_attention on CUDA, computed once per step from the batch layout the
// host already has: plan [B + 1] int32 (CPU) gets, for each sequence, the offset of its first
// tile of query rows in the tensor-core prefill kernel. query_start_loc: [B + 1] int32 (CPU).
void plan_paged_attention(const TensorView& plan, const TensorView& query_start_loc, int64_t num_heads,
                          int64_t num_kv_heads);

// How `linear`'s weight is stored. kDense: [N, K] in the activations' dtype (torch's Linear
// layout). The GGUF block formats keep a file's quantized tensor as it is: weight is uint8
// [N, K / 32 * block_bytes], each row K / 32 blocks of 32 weights (ggml's block_q8_0, block_q4_0,
// block_q4_1). Octavo's own formats, for weights quantized at load time: kInt8, weight int8
// [N, K] with one float32 scale per row (w = q * s); kInt4, weight uint8 [N, K / 2] (each 32
// weights in 16 bytes: byte j's low nibble is weight j, its high nibble weight j + 16), float32
// scales and uint8 zero points [N, K / group_size] (w = (q - z) * s). K must be a multiple of 32,
// and of group_size (itself a multiple of 32) for kInt4. kBf16Tiles: a bfloat16 weight repacked
// once (pack_bf16_tiles) into the layout of AMX weight tiles, so that products on AMX read it
// without transposing it on every call; uint8 [N, K * 2], N a multiple of 32 (see
// csrc/kernels/bf16_tiles.h). CPU only. kInt4A8: kInt4's weights, but `linear` on the CPU first
// rounds each input row to int8 with one scale per weight group (W4A8: a = rint(x * 127 / m), m
// the group's largest |x|) and multiplies integers (cpu/linear_int8_inputs.h); the result is
// that of x rounded so. dequantize reads it as kInt4; CUDA multiplies only kInt4. kInt8A8 (W8A8):
// kInt8's weights, and each input row rounded to int8 with one scale for the whole row (dynamic
// per-token, as vLLM's W8A8): out = s * d * (exact integer sum); CPU only, dequantize reads it as
// kInt8.
//
// More GGUF formats (CPU and CUDA): kQ5_0, kQ5_1 and kIQ4_NL in blocks of 32 weights, and the
// K-quants kQ3_K, kQ4_K, kQ5_K, kQ6_K in super-blocks of 256 (ggml's block_q5_0 ... block_q6_K):
// weight uint8 [N, K / block_weights * block_bytes], K a multiple of the block's weights.
//
// kFp8: FP8 checkpoints' weights (E4M3), weight float8_e4m3fn [N, K] with float32 scales
// [N, K / group_size] (w = q * s): group_size K for per-channel and per-tensor scales, 128 for
// block-wise ones (each scale repeated over its block's rows). Multiplied with the activations'
// dtype (weight-only), CPU and CUDA. NaN codes are not weights: the CPU reads them as +-480 s.
enum class WeightFormat : uint8_t {
  kDense, kQ8_0, kQ4_0, kQ4_1, kInt8, kInt4, kBf16Tiles, kInt4A8, kInt8A8,
  kQ5_0, kQ5_1, kIQ4_NL, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kFp8
};
// "dense", "q8_0", "q4_0", "q4_1", "int8", "int4", "bf16_tiles", "int4_a8", "int8_a8", "q5_0",
// "q5_1", "iq4_nl", "q3_k", "q4_k", "q5_k", "q6_k", "fp8"
const char* weight_format_name(WeightFormat format);
WeightFormat parse_weight_format(const char* name);   // the inverse; throws for an unknown name
int64_t weight_block_weights(WeightFormat format);    // weights per block: 256 for K-quants, else 32
int64_t weight_block_bytes(WeightFormat format);      // weight bytes per block; 0 for kDense

// The scale / zero-point tensors of kInt8, kInt4 and kFp8 weights (null members for other formats).
struct WeightQuant {
  const TensorView* scales = nullptr;  // float32 (kInt8, kInt8A8: [N]; kInt4, kInt4A8, kFp8: [N, groups])
  const TensorView* zeros = nullptr;   // uint8 (kInt4, kInt4A8)
  int64_t group_size = 0;              // kInt4, kInt4A8, kFp8
  // GGUF block formats on the CPU: `linear` rounds each input row to int8 per block of 32 inputs
  // (a = rint(x * 127 / m), m the block's largest |x|: llama.cpp's Q8_0 activations) and multiplies
  // integers (cpu/linear_gguf_a8.h); the result is that of x rounded so. dequantize ignores it.
  bool int8_inputs = false;
  // CUDA, bfloat16 / float16 inputs, any weight format CUDA reads: `linear` multiplies on tensor
  // cores, decoding each weight once per 16 input rows (Marlin's design, for decode batches of 2 to
  // 16 and more). The weights are rounded to the inputs' dtype first, so the result is that of the
  // weights `dequantize` writes in that dtype, not the float32 products of the default kernel.
  // Not yet layers/linear.py's choice: it becomes so once a GPU measures it faster.
  bool tensor_cores = false;
};

// out = input · weightᵀ (+ bias): the dense projections of a decode step, read at memory speed.
// input: [M, K] (any leading shape, rows of K); weight: [N, K] contiguous in `format` (see
// WeightFormat); bias: [N] or null; out: [M, N], not overlapping input. out, input and bias
// share one float dtype (and a dense weight too). Quantized weights are decoded in registers to
// exactly the float32 values `dequantize` gives, so the result equals the dense kernel's on those
// floats, bit for bit. Each output row is computed the same way whatever M is (batch
// invariant). Meant for small M (decode batches); for large M a BLAS GEMM may be faster (see
// python/octavo/layers/linear.py for the measured crossover). On CUDA, dense weights need rows of
// a multiple of 32 inputs, and the weight and the input rows the alignment a contiguous tensor has.
void linear(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
            WeightFormat format = WeightFormat::kDense, const WeightQuant& quant = {});

// out [N, K] contiguous = the weights a quantized `weight` stands for, as float32 (for the GGUF
// formats exactly as the gguf package dequantizes them), or those floats rounded to bfloat16 /
// float16 (the weights torch's GEMM multiplies where M is large).
void dequantize(const TensorView& out, const TensorView& weight, WeightFormat format, const WeightQuant& quant = {});

// out uint8 [N, K * 2] = the bfloat16 weight [N, K] (contiguous, on the CPU; N and K multiples of
// 32) in WeightFormat::kBf16Tiles; `dequantize` gives the weight back bit for bit.
void pack_bf16_tiles(const TensorView& out, const TensorView& weight);

// ---- Mixture of experts ------------------------------------------------------------------
// The router: each token's top_k experts by score, where scores are softmax (or, with
// `scoring` kSigmoid, sigmoid) of the router logits, after logits = softcap * tanh(logits /
// softcap) when softcap > 0. With num_expert_group > 0 (DeepSeek's grouped routing) the experts
// form that many equal groups, a group's score is its best expert's, and only the topk_group best
// groups' experts are eligible. renormalize: the chosen weights are divided by their sum.
// Ties go to the lower expert id and a NaN score loses to any number; ids come out in
// descending weight. CPU and CUDA pick the same ids.
// gating_output: [T, E] float32, bfloat16 or float16; topk_weights: [T, k] float32;
// topk_ids: [T, k] int32.
enum class MoeScoring : uint8_t { kSoftmax, kSigmoid };
struct TopkArgs {
  bool renormalize = false;
  MoeScoring scoring = MoeScoring::kSoftmax;
  int64_t num_expert_group = 0;  // 0: plain top-k over all experts
  int64_t topk_group = 0;        // groups kept, in [1, num_expert_group]
  double softcap = 0.0;          // 0: off
};
void topk_softmax(const TensorView& topk_weights, const TensorView& topk_ids, const TensorView& gating_output,
                  const TopkArgs& args = {});

// vLLM's moe_align_block_size: the T * k (token, slot) pairs of topk_ids grouped by expert, in
// ascending flat index (t * k + slot) within an expert, each expert's run padded with the
// value T * k to a multiple of block_size, so a block of rows belongs to one expert.
// topk_ids: [T, k] int32, ids in [0, num_experts) or -1 (an expert this rank does not hold:
// left out); sorted_token_ids: [T * k + num_experts * (block_size - 1)] int32 (the tail past
// the used length is padding too); expert_ids: [that / block_size] int32, each block's expert
// (-1 past the used blocks); num_tokens_post_padded: [1] int32, the used length.
void moe_align(const TensorView& topk_ids, int64_t num_experts, int64_t block_size, const TensorView& sorted_token_ids,
               const TensorView& expert_ids, const TensorView& num_tokens_post_padded);

// One expert projection stack: weight [E, N, K] dense, or [E, N, K / 32 * block bytes] in a
// quantized format, with its scales / zero points stacked the same way ([E, N] for int8,
// [E, N, K / group_size] for int4).
struct ExpertWeights {
  const TensorView* weight = nullptr;
  WeightFormat format = WeightFormat::kDense;
  WeightQuant quant;
};

// out[t] = sum over slots s of topk_weights[t, s] * down_e(silu(gate_e(x)) * up_e(x)), e =
// topk_ids[t, s] (ids of -1 add nothing), x = hidden[t]: the MoE MLP in one op. Each expert's
// weights are read once per call for all the tokens routed to it (by the `linear` kernel, so
// every weight format linear reads works); the sum over slots runs in float32 in ascending expert
// order (a token alone or in a batch: the same bits on the same side of linear's row-count
// switches). Quantized experts with 16-bit activations compute in float32 where experts average
// fewer than 32 rows, and from there bfloat16 activations multiply the weights dequantized to
// bfloat16. w13: [E, 2I, H] gate rows then up rows; w2: [E, H, I].
// out, hidden: [T, H] in one float dtype (dense weights too); out must not overlap hidden.
// On CUDA (cuda/moe.cu): H and I multiples of 32, ids outside [0, E) skipped like -1; the
// intermediate results stay float32 up to the kernels' tensor-core path (16-bit activations,
// experts averaging 16 rows or more), which rounds weights and activation to the activations'
// type as a 16-bit GEMM does.
void fused_moe(const TensorView& out, const TensorView& hidden, const ExpertWeights& w13, const ExpertWeights& w2,
               const TensorView& topk_weights, const TensorView& topk_ids);

// Structured output's token mask: sets logits[indices[i], t] to -inf wherever bit t % 32 of
// bitmask[i, t / 32] is clear (xgrammar's layout: 1 = allowed). logits: [B, V] float32, each row
// contiguous; bitmask: [N, ceil(V / 32)] int32, contiguous; indices: [N] int32 rows of logits,
// each in [0, B) and listed once, or null for N = B and row i. Runs in place, before sample().
void apply_token_bitmask(const TensorView& logits, const TensorView& bitmask, const TensorView* indices);

// Samples one token per row of logits with per-request parameters (vLLM's order: biases and bans,
// penalties, temperature, min-p, top-k, top-p). Every per-request tensor is [B]; optional ones
// may be null. The draw of request b depends only on (seeds[b], counters[b]) and its own row, so
// a request samples the same token alone or in any batch.
struct SampleArgs {
  TensorView logits;                          // [B, V] float32
  TensorView temperature;                     // [B] float32; < 1e-5 means greedy (argmax)
  const TensorView* top_k = nullptr;          // [B] int32; <= 0 or >= V: off
  const TensorView* top_p = nullptr;          // [B] float32 in (0, 1]; 1: off
  const TensorView* min_p = nullptr;          // [B] float32 in [0, 1]; 0: off
  const TensorView* repetition_penalty = nullptr;  // [B] float32 > 0; 1: off (prompt + output)
  const TensorView* frequency_penalty = nullptr;   // [B] float32; 0: off (output tokens)
  const TensorView* presence_penalty = nullptr;    // [B] float32; 0: off (output tokens)
  const TensorView* prompt_offsets = nullptr;      // [B + 1] int32, CSR into prompt_token_ids
  const TensorView* prompt_token_ids = nullptr;    // [N] int32
  const TensorView* output_offsets = nullptr;      // [B + 1] int32, CSR into output_token_ids
  const TensorView* output_token_ids = nullptr;    // [M] int32
  // One bias / mask structure per request (logit_bias, allowed_token_ids, bad_words, min_tokens):
  // row b's entries [bias_offsets[b], bias_offsets[b + 1]) add bias_values to the logits of
  // bias_token_ids (-inf bans the token), each token at most once per row; where only_listed[b]
  // is nonzero, every token the row does not list is banned (allowed_token_ids).
  const TensorView* bias_offsets = nullptr;        // [B + 1] int32, CSR
  const TensorView* bias_token_ids = nullptr;      // [N] int32
  const TensorView* bias_values = nullptr;         // [N] float32
  const TensorView* only_listed = nullptr;         // [B] int32
  TensorView seeds;                           // [B] int64
  TensorView counters;                        // [B] int64, e.g. tokens generated so far
  // Outputs. Logprobs are of the raw logits (before penalties and temperature), as vLLM's
  // default; rank = number of tokens whose logprob is >= the sampled token's.
  TensorView sampled;                         // [B] int32
  const TensorView* sampled_logprobs = nullptr;  // [B] float32
  const TensorView* sampled_ranks = nullptr;     // [B] int32
  const TensorView* top_token_ids = nullptr;     // [B, n] int32, the n most likely tokens
  const TensorView* top_logprobs = nullptr;      // [B, n] float32
};
void sample(const SampleArgs& args);

// Speculative decoding's verification: sample() on every row (one row per position verified:
// each draft's predecessor and the last token, with that position's outputs so far, counter and
// bans), where row b checks draft_token_ids[b] (-1: none) and accepted[b] becomes 1 where the
// row's token is the draft, else 0 (int32, [B]). A request keeps its rows' tokens up to and
// including its first row not accepted.
// Drafts are proposed deterministically here (prompt lookup, a draft model's argmax), so the
// drafter's distribution q is one-hot at the draft d. The standard rule then accepts d with
// probability min(1, p(d) / q(d)) = p(d) and otherwise draws from the residual max(p - q, 0),
// which is p without d, renormalized. One draw t ~ p does both: t == d has probability p(d),
// and t given t != d follows the residual. The draw is sample()'s own (seed, counter), so a
// request generates the same tokens with or without speculation, greedy or seeded.
void rejection_sample(const SampleArgs& args, const TensorView& draft_token_ids, const TensorView& accepted);

}  // namespace octavo
