// paged_attention's prefill path on tensor cores (WMMA, bfloat16 / float16), FlashAttention-2
// style: a block takes a tile of 64 query rows and walks the keys in tiles, keeping each row's
// running max and sum and its output accumulator across them. With GQA the rows are (token,
// query head) pairs of one KV head (64 / group tokens x group heads), so a K/V tile read from
// the paged cache serves the whole group. Each warp owns 16 rows from S = Q·Kᵀ through the
// softmax to O += P·V, so only the K/V loads need the whole block.
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

constexpr int kPrefillThreads = 128;  // 4 warps x 16 rows

// Keys per tile: fewer for head size 256, so that shared memory fits an A100's 163 KiB.
__host__ __device__ constexpr int prefill_keys(int head_size) { return head_size == 256 ? 32 : 64; }

template <typename T, int kD>
void launch_prefill_attention(const PagedAttentionParams& p, const int32_t* tile_offsets, int64_t max_tiles);

}  // namespace octavo::cuda
