// The kernel template behind launch_grouped_decode (attention.cuh); included only by the
// per-head-size files that instantiate it.
//
// Decode on tensor cores for GQA groups of kMinMmaGroup and more, where the split-KV kernel's
// per-head dot products would cost more instruction issue than the K/V reads take: one block per
// (query token, KV head, split), its 16 rows the group's query heads (padded with zero rows).
// Each warp takes its own 16 keys of every tile through the warp-level steps of
// attention_mma.cuh, so K and V are read from memory once for the group and from shared memory
// once per warp. At the end the warps' partial results are folded together through shared
// memory, and written as the split-KV kernel writes them (so one merge serves both).
//
// An fp8 cache (kv_cache_dtype="fp8") is copied as it is into staging rows of bytes, two tiles
// deep as the 16-bit tiles are, and each tile is converted into the query's type in shared memory
// (E4M3 values are exact in bfloat16 and float16) before the warps read it: half the bytes from
// memory, one more pass over shared memory. Its k_scale joins the softmax scale and v_scale the
// output.
#pragma once

#include <atomic>
#include <type_traits>

#include "attention.cuh"
#include "attention_mma.cuh"
#include "cuda_kernels.h"
#include "paged_kv.cuh"

namespace octavo::cuda {
namespace grouped_decode_detail {

// Shared memory: the group's 16 query rows, then K and V twice (the next tile is copied while
// this one is used); the keys' flags ride in the K rows' padding. The fold at the end reuses the
// tiles. With an fp8 cache (kFp8) the 16-bit K and V are one tile each, and its staging rows
// (Fp8Stage) follow them.
template <int kD, bool kFp8 = false>
struct Shape {
  static constexpr int kKeys = kD == 256 ? 32 : 64;  // per tile, 16 per warp: shared memory under 80 KiB
  static constexpr int kWarps = kKeys / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLd = kD + 8;
  static constexpr int kTile = kKeys * kLd;
  static constexpr int kBuffers = kFp8 ? 1 : 2;  // 16-bit tiles of K and of V
  static constexpr int kK = 16 * kLd, kV = kK + kBuffers * kTile, kEnd = kV + kBuffers * kTile;
  using Stage = Fp8Stage<kD, kKeys>;
  static constexpr size_t kStageBytes = kFp8 ? Stage::kBytes : 0;
  static constexpr size_t kBytes = sizeof(uint16_t) * kEnd + kStageBytes;
  static constexpr size_t kFoldBytes = sizeof(float) * kWarps * 16 * (kD + 2);
  static_assert(kFoldBytes <= sizeof(uint16_t) * 2 * kBuffers * kTile + kStageBytes,
                "the warps' fold fits in the tiles' memory");
};

// Folds the warps' (max, sum, o) of the group's rows into the block's result, through shared
// memory at `fold`, and writes it: the normalized output with one split, else the split's
// unnormalized accumulator and (max, sum), as merge_splits_kernel reads them.
template <typename T, int kD>
__device__ void fold_and_write(const PagedAttentionParams& p, const SplitOutputs& splits, int token, int kv_head,
                               int split, int group, const mma_attention::RowStats<1>& rows,
                               const mma_attention::Outputs<1, kD>& o,
                               float* fold) {
  using S = Shape<kD>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* stats = fold;                      // [warps][16] (max, sum)
  float* accs = fold + 2 * S::kWarps * 16;  // [warps][16][kD]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + lane / 4 + 8 * h;
    const float sum = rows.total(0, h);
    if (lane % 4 == 0) {
      stats[2 * row] = rows.m[0][h];
      stats[2 * row + 1] = sum;
    }
#pragma unroll
    for (int c = 0; c < kD / 8; ++c) {
      accs[row * kD + 8 * c + 2 * (lane % 4)] = o[0][c][2 * h];
      accs[row * kD + 8 * c + 2 * (lane % 4) + 1] = o[0][c][2 * h + 1];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * kD; i += S::kThreads) {
    const int r = i / kD, d = i % kD;
    float m = -FLT_MAX;
    for (int w = 0; w < S::kWarps; ++w) m = fmaxf(m, stats[2 * (w * 16 + r)]);
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < S::kWarps; ++w) {
      const float weight = __expf(stats[2 * (w * 16 + r)] - m);
      num += weight * accs[(w * 16 + r) * kD + d];
      den += weight * stats[2 * (w * 16 + r) + 1];
    }
    const int64_t q_head = static_cast<int64_t>(kv_head) * group + r;
    if (splits.num_splits == 1) {
      static_cast<T*>(p.out)[token * p.out_stride + q_head * kD + d] = from_float<T>(den > 0 ? num / den : 0.0f);
      continue;
    }
    const int64_t split_row = (token * p.num_heads + q_head) * splits.num_splits + split;
    splits.acc[split_row * kD + d] = num;
    if (d == 0) {
      splits.max_sum[2 * split_row] = m;
      splits.max_sum[2 * split_row + 1] = den;
    }
  }
}

// Starts copying keys [start, start + kKeys) into buffer `buf`: the 16-bit tiles, or with an fp8
// cache (C) the staging rows.
template <typename T, int kD, typename C>
__device__ void copy_tile(const DecodeWork& w, int64_t start, int buf, T* k_s, T* v_s,
                          const typename Shape<kD, true>::Stage& stage) {
  using S = Shape<kD, !std::is_same_v<T, C>>;
  if constexpr (std::is_same_v<T, C>) {
    copy_kv_tile<T, kD, S::kKeys, S::kLd>(w.kv, start, k_s + buf * S::kTile, v_s + buf * S::kTile, nullptr,
                                          threadIdx.x, S::kThreads);
  } else {
    stage.copy(w.kv, start, buf, S::kThreads);
  }
}

// T: the query's and output's type; C: the cache's (T, or fp8e4m3).
template <typename T, int kD, typename C>
__global__ void __launch_bounds__(Shape<kD>::kThreads) grouped_decode_kernel(PagedAttentionParams p,
                                                                            SplitOutputs splits) {
  constexpr bool kFp8 = !std::is_same_v<T, C>;
  using S = Shape<kD, kFp8>;
  unsigned char* const smem = dynamic_shared_memory();
  T* q_s = reinterpret_cast<T*>(smem);           // [16][kLd]
  T* k_s = q_s + S::kK;                          // [kBuffers][kKeys][kLd]
  T* v_s = q_s + S::kV;                          // [kBuffers][kKeys][kLd]
  const typename Shape<kD, true>::Stage stage{reinterpret_cast<uint8_t*>(q_s + S::kEnd)};  // fp8 only

  const int token = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const DecodeWork w = decode_work<C, kD, S::kKeys>(p, token, kv_head, split, splits.num_splits);
  if (skip_empty_split(p, splits, w.k_begin, w.kv.k_end, token, kv_head, split, threadIdx.x, S::kThreads)) return;
  PagedAttentionParams scaled = p;
  scaled.scale *= p.k_scale;  // q . (k_scale k) = k_scale (q . k); 1 but for an fp8 cache

  // Row r is query head kv_head * group + r; rows past the group are zeros.
  mma_attention::copy_query_rows<T, kD, 16, S::kLd>(p, token, 1, kv_head, group, q_s, S::kThreads);
  if (w.k_begin < w.kv.k_end) copy_tile<T, kD, C>(w, w.k_begin, 0, k_s, v_s, stage);
  copy_async_commit();  // the query rows and the first tile

  mma_attention::Outputs<1, kD> o = {};
  mma_attention::RowStats<1> rows;
  int buf = 0;
  for (int64_t k0 = w.k_begin; k0 < w.kv.k_end; k0 += S::kKeys, buf ^= 1) {
    if (k0 + S::kKeys < w.kv.k_end) {  // the next tile's copy runs while this one is used
      copy_tile<T, kD, C>(w, k0 + S::kKeys, buf ^ 1, k_s, v_s, stage);
      copy_async_commit();
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();  // every thread's copies into `buf` are done
    int at = buf * S::kTile;  // the 16-bit tiles' offset
    if constexpr (kFp8) {
      stage.template convert<T, S::kLd>(buf, k_s, v_s, S::kThreads);
      at = 0;
      __syncthreads();
    }
    const int first = warp * 16;  // the warp's keys in the tile
    const T* k_tile = k_s + at + first * S::kLd;
    mma_attention::Scores<1, 16> s;
    mma_attention::score_tile<T, 1, kD, 16, S::kLd>(q_s, k_tile, lane, s);
    // Every key of a decode split is in the query's range; only keys past its end or in a block
    // outside the cache are hidden.
    const auto visible = [k_tile](int, int, int j) { return *row_flag<kD, S::kLd>(k_tile, j) != 0; };
    mma_attention::softmax_tile<1, kD, 16>(scaled, visible, lane, s, rows, o);
    mma_attention::accumulate_tile<T, 1, kD, 16, S::kLd>(s, v_s + at + first * S::kLd, lane, o);
    __syncthreads();  // `buf` is refilled by the next iteration's copy (and, after the last, folded into)
  }
  copy_async_wait<0>();  // with no key at all, the query's copies are still pending
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kD / 8; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][c][e] *= p.v_scale;  // v = v_scale x what the cache holds
  fold_and_write<T, kD>(p, splits, token, kv_head, split, group, rows, o, reinterpret_cast<float*>(k_s));
}

}  // namespace grouped_decode_detail

template <typename T, int kD, typename C>
void launch_grouped_decode(const PagedAttentionParams& p, const SplitOutputs& splits) {
  using S = grouped_decode_detail::Shape<kD, !std::is_same_v<T, C>>;
  auto kernel = grouped_decode_detail::grouped_decode_kernel<T, kD, C>;
  static std::atomic<bool> opted_in[kMaxDevices] = {};
  allow_shared_memory(kernel, S::kBytes, opted_in, "paged_attention (grouped decode)");
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(splits.num_splits));
  launch_kernel(kernel, grid, S::kThreads, S::kBytes, p, splits);
  check_launch("paged_attention (grouped decode)");
}

#define OCTAVO_INSTANTIATE_GROUPED_DECODE(D)                                                                \
  template void launch_grouped_decode<bf16, D, bf16>(const PagedAttentionParams&, const SplitOutputs&);    \
  template void launch_grouped_decode<f16, D, f16>(const PagedAttentionParams&, const SplitOutputs&);      \
  template void launch_grouped_decode<bf16, D, fp8e4m3>(const PagedAttentionParams&, const SplitOutputs&); \
  template void launch_grouped_decode<f16, D, fp8e4m3>(const PagedAttentionParams&, const SplitOutputs&);

}  // namespace octavo::cuda
