// paged_attention on CUDA, split-KV ("flash-decoding"): one block per (query token, KV head,
// split of the token's visible keys). The block holds the token's whole GQA group (the query
// heads that share the KV head), so every key and value row is read from memory once for all of
// them. Tiles of keys are copied into shared memory with cp.async, the next tile in flight while
// the current one is used. Each thread keeps a slice of one head's query and output in
// registers and folds keys into them with an online softmax. With more than one split, each
// split leaves an unnormalized partial result and merge_splits_kernel combines them. GQA groups
// of kMinMmaGroup or more in bfloat16 / float16 take the grouped decode kernel instead
// (grouped_decode_kernel.cuh): the same grid, splits and partial results, on tensor cores. The
// head size is a template parameter, instantiated in attention_d64.cu, attention_d128.cu and
// attention_d256.cu.
//
// Nothing here reads the batch metadata on the host: a block id outside the cache or a position
// past the block table masks its key instead of reading stray memory.
#pragma once

#include "common.cuh"
#include "params.h"

namespace octavo::cuda {

constexpr int kDecodeThreads = 128;        // threads per block aimed at; a group of 16 takes more
constexpr int kMaxDecodeThreads = 512;     // 32 lanes x kMaxGroup heads
constexpr int kDecodeTileBytes = 8 * 1024;  // bytes of K per tile (as many again of V, twice over)

// Where split `split`'s partial results go (num_splits > 1): acc [tokens, heads, splits, D]
// unnormalized, and (max, sum) pairs [tokens, heads, splits, 2].
struct SplitOutputs {
  float* acc;
  float* max_sum;
  int num_splits;
};

// Whether split `split` of the token's keys [k_begin, k_end) is empty: decode graphs size their
// splits by the block table's width, not the context, so short contexts leave trailing splits
// with no key. Such a block marks its rows' partial results empty (sum 0: the merge skips them,
// whatever an earlier call left in the workspace) and can exit at once.
__device__ inline bool skip_empty_split(const PagedAttentionParams& p, const SplitOutputs& splits, int64_t k_begin,
                                        int64_t k_end, int token, int kv_head, int split, int tid, int threads) {
  if (splits.num_splits == 1 || k_begin < k_end) return false;
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t r = tid; r < group; r += threads) {
    const int64_t row = (token * p.num_heads + kv_head * group + r) * splits.num_splits + split;
    splits.max_sum[2 * row] = -INFINITY;
    splits.max_sum[2 * row + 1] = 0.0f;
  }
  return true;
}

// T: the query's and output's type; C: the cache's (T, or fp8e4m3 for an fp8 cache).
template <typename T, int kD, typename C = T>
void launch_paged_attention(const PagedAttentionParams& p, const SplitOutputs& splits);

// Decodes of GQA groups this large or larger (bfloat16 / float16 queries, over a cache of their
// type or fp8) go to the tensor-core kernel (grouped_decode_kernel.cuh), which takes the same splits.
constexpr int kMinMmaGroup = 4;
template <typename T, int kD, typename C = T>
void launch_grouped_decode(const PagedAttentionParams& p, const SplitOutputs& splits);

}  // namespace octavo::cuda
