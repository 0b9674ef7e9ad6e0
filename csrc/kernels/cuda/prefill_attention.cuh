// paged_attention's prefill path on tensor cores (mma.sync, bfloat16 / float16), FlashAttention-2
// style: a block takes a tile of kPrefillRows query rows and walks the keys in tiles, keeping
// each row's running max and sum and its output accumulator in registers across them. With GQA
// the rows are (token, query head) pairs of one KV head (kPrefillRows / group tokens x group
// heads), so a K/V tile read from the paged cache serves the whole group. Each warp owns its rows
// from S = Q·Kᵀ through the softmax to O += P·V, so only the copies into shared memory need the
// whole block.
//
// Sequence b's tiles are [offsets[b], offsets[b + 1]), ceil(query tokens / tokens per tile) of
// them: the host plan's (plan_paged_attention, once per step) or, without one, laid out on the
// device by attention.cu's tile_offsets_kernel. The grid is an upper bound and blocks past the
// last tile return, so nothing is read back on the host and a step can run in a CUDA graph.
#pragma once

#include "common.cuh"
#include "cuda_kernels.h"  // kPrefillRows
#include "params.h"

namespace octavo::cuda {

// C: the cache's element type (T, or fp8e4m3).
template <typename T, int kD, typename C = T>
void launch_prefill_attention(const PagedAttentionParams& p, const int32_t* tile_offsets, int64_t max_tiles);
// Whether launch_prefill_attention<T, kD, C> has a shape that fits the current device's shared
// memory (all do but head size 256 over an fp8 cache on a 99 KiB device).
template <typename T, int kD, typename C = T>
bool prefill_fits();

}  // namespace octavo::cuda
