// paged_attention on CUDA, split-KV ("flash-decoding"): one block per (query token, KV head,
// split of the token's visible keys). The block holds the token's whole GQA group (the query
// heads that share the KV head), so every key and value row is read once for all of them, and
// folds tiles of kTile keys into a running max / sum / accumulator per head (online softmax).
// With more than one split, each split leaves an unnormalized partial result and
// merge_splits_kernel combines them. The head size is a template parameter, instantiated in
// attention_d64.cu, attention_d128.cu and attention_d256.cu.
//
// Nothing here reads the batch metadata on the host: a block id outside the cache or a position
// past the block table masks its key instead of reading stray memory.
#pragma once

#include "common.cuh"
#include "params.h"

namespace octavo::cuda {

constexpr int kAttentionThreads = 128;
constexpr int kTile = kAttentionThreads;  // keys per tile: one per thread for the scores
constexpr int kMaxGroup = 16;             // query heads per KV head

// Where split `split`'s partial results go (num_splits > 1): acc [tokens, heads, splits, D]
// unnormalized, and (max, sum) pairs [tokens, heads, splits, 2].
struct SplitOutputs {
  float* acc;
  float* max_sum;
  int num_splits;
};

// Shared memory for a group of `group` heads: query, accumulator, tile scores, tile block ids.
inline size_t attention_shared_bytes(int group, int head_size) {
  return sizeof(float) * (2 * group * head_size + group * kTile + 3 * group) + sizeof(int) * kTile;
}

template <typename T, int kD>
void launch_paged_attention(const PagedAttentionParams& p, const SplitOutputs& splits);

}  // namespace octavo::cuda
