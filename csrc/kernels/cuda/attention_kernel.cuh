// The kernel template behind launch_paged_attention (attention.cuh); included only by the
// per-head-size files that instantiate it.
//
// A block is kLanes x heads x slices threads, heads being the GQA group padded to whole warps
// (the padding heads compute on a zero query and write nothing). The kLanes threads of one
// (head, slice) share each key row, kVec consecutive elements (whole 16-byte packs) apiece: a
// score is their partial dot products summed by shuffles, and each keeps kVec elements of the
// head's output. The slices take disjoint runs of each tile's keys and are folded together at
// the end. Every thread works through the same number of keys (masked ones included), so all
// branches around the shuffles and barriers are uniform, and every warp is whole, so the
// shuffles name all 32 lanes.
//
// The cache may hold fp8 (E4M3, kv_cache_dtype="fp8") beside a query of any float type: the
// kernel's shape follows the cache's type C (its rows move in 16-byte packs), K and V are
// converted to float as they are read from shared memory, and the cache's scales come in as
// factors (k_scale of the query's scale, v_scale of the output).
#pragma once

#include <cfloat>

#include "attention.cuh"
#include "paged_kv.cuh"

namespace octavo::cuda {
namespace attention_detail {

constexpr int kChunk = 4;  // keys scored together before one softmax update

// C: the cache's element type.
template <typename C, int kD>
struct DecodeShape {
  static constexpr int kPack = Pack<C>::kSize;
  static constexpr int kLanes = kD / kPack < 32 ? kD / kPack : 32;  // threads per key row
  static constexpr int kVec = kD / kLanes;                          // elements per thread
  static constexpr int kTileKeys = kDecodeTileBytes / (kD * static_cast<int>(sizeof(C)));
  static constexpr int kTileElements = kTileKeys * kD;
  // K and V, two buffers each, then a flag per key of each buffer.
  static constexpr size_t kTileBytes = 4 * sizeof(C) * kTileElements + 2 * sizeof(int) * kTileKeys;
  // The fold of the slices reuses the tiles' memory: (max, sum) and an accumulator per row.
  static constexpr size_t kFoldBytes = sizeof(float) * (kMaxDecodeThreads / kLanes) * (kD + 2);
  static constexpr size_t kSharedBytes = kTileBytes > kFoldBytes ? kTileBytes : kFoldBytes;
  static_assert(kVec % kPack == 0 && kTileKeys % kChunk == 0, "whole packs per thread, whole chunks per tile");
  static_assert(kSharedBytes <= 48 * 1024, "no opt-in for more shared memory needed");
};

// Sum of v over the kLanes threads of this thread's key row (aligned runs of kLanes lanes of a
// whole warp); each of them gets it.
template <int kLanes>
__device__ __forceinline__ float segment_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset, kLanes);
  return v;
}

// Heads per block: the group padded so that kLanes x heads fills whole warps.
template <int kLanes>
inline int padded_heads(int group) {
  const int per_warp = 32 / kLanes > 1 ? 32 / kLanes : 1;
  return static_cast<int>(ceil_div(group, per_warp) * per_warp);
}

template <int kVec, typename T>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[kVec]) {
  constexpr int kPack = Pack<T>::kSize;
#pragma unroll
  for (int i = 0; i < kVec; i += kPack) {
    const Pack<T> pack = load_pack(src + i);
#pragma unroll
    for (int e = 0; e < kPack; ++e) dst[i + e] = to_float(pack.v[e]);
  }
}

// Starts copying keys [start, start + kTileKeys) into buffer `buf` (see copy_kv_tile).
template <typename C, int kD>
__device__ void load_tile(const DecodeWork& w, int64_t start, int buf, int tid, int threads, C* k_s, C* v_s,
                          int* ok_s) {
  using S = DecodeShape<C, kD>;
  const int64_t at = buf * S::kTileElements;
  copy_kv_tile<C, kD, S::kTileKeys, kD>(w.kv, start, k_s + at, v_s + at, ok_s + buf * S::kTileKeys, tid, threads);
  copy_async_commit();
}

// A thread's running softmax state for its head: max m, sum l, and kVec output elements.
template <int kVec>
struct Running {
  float m = -FLT_MAX;  // finite, so that a chunk of masked keys gives e^0 = 1 for alpha, not NaN
  float l = 0.0f;
  float acc[kVec] = {};
};

// Folds keys [j0, j0 + kChunk) of the tile in k_tile / v_tile into `run`.
template <typename C, int kD>
__device__ __forceinline__ void fold_chunk(const PagedAttentionParams& p, const float (&q)[DecodeShape<C, kD>::kVec],
                                           const C* k_tile, const C* v_tile, const int* ok_tile, int j0, int lane,
                                           Running<DecodeShape<C, kD>::kVec>& run) {
  using S = DecodeShape<C, kD>;
  float s[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    float k[S::kVec];
    load_floats<S::kVec>(k_tile + (j0 + c) * kD + lane * S::kVec, k);
    s[c] = 0.0f;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) s[c] += q[e] * k[e];
  }
  float m_new = run.m;
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    s[c] = segment_sum<S::kLanes>(s[c]);
    if (p.softcap > 0) s[c] = p.softcap * tanhf(s[c] / p.softcap);
    if (!ok_tile[j0 + c]) s[c] = -INFINITY;
    m_new = fmaxf(m_new, s[c]);
  }
  const float alpha = __expf(run.m - m_new);
  run.m = m_new;
  run.l *= alpha;
#pragma unroll
  for (int e = 0; e < S::kVec; ++e) run.acc[e] *= alpha;
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    const float weight = __expf(s[c] - m_new);  // 0 for masked keys
    float v[S::kVec];
    load_floats<S::kVec>(v_tile + (j0 + c) * kD + lane * S::kVec, v);
    run.l += weight;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) run.acc[e] += weight * v[e];
  }
}

// Folds the slices' states into slice 0's threads through shared memory (`fold`, free once the
// tiles are done). Returns false on the other slices' threads, which are then finished.
template <int kD, int kVec>
__device__ bool fold_slices(Running<kVec>& run, float* fold, int lane, int head, int slice, int group, int slices) {
  float* stats = fold;                       // [slices][group] (max, sum)
  float* accs = fold + 2 * slices * group;   // [slices][group][kD]
  const int row = slice * group + head;
  if (lane == 0) {
    stats[2 * row] = run.m;
    stats[2 * row + 1] = run.l;
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) accs[row * kD + lane * kVec + e] = run.acc[e];
  __syncthreads();
  if (slice != 0) return false;
  float m = -FLT_MAX;
  for (int z = 0; z < slices; ++z) m = fmaxf(m, stats[2 * (z * group + head)]);
  Running<kVec> total;
  total.m = m;
  for (int z = 0; z < slices; ++z) {
    const int r = z * group + head;
    const float w = __expf(stats[2 * r] - m);
    total.l += w * stats[2 * r + 1];
#pragma unroll
    for (int e = 0; e < kVec; ++e) total.acc[e] += w * accs[r * kD + lane * kVec + e];
  }
  run = total;
  return true;
}

// The explicit one block per SM: without it ptxas aimed at 64 registers and spilled in the float16
// variants (nvcc 13.0, sm_90); with it, 63-85 and no spills. For the usual 128-thread blocks in
// 16 bits, shared memory (32 KiB of tiles each) still limits the blocks per SM before registers
// do; float32 at head size 256 (85 registers) fits one block fewer than shared memory allows.
// T: the query's and output's type; C: the cache's (T, or fp8).
template <typename T, int kD, typename C>
__global__ void __launch_bounds__(kMaxDecodeThreads, 1) paged_attention_kernel(PagedAttentionParams p,
                                                                                SplitOutputs splits) {
  using S = DecodeShape<C, kD>;
  unsigned char* const smem = dynamic_shared_memory();
  C* k_s = reinterpret_cast<C*>(smem);                                 // [2][kTileKeys][kD]
  C* v_s = k_s + 2 * S::kTileElements;                                 // [2][kTileKeys][kD]
  int* ok_s = reinterpret_cast<int*>(v_s + 2 * S::kTileElements);      // [2][kTileKeys]

  const int lane = threadIdx.x, head = threadIdx.y, slice = threadIdx.z;  // head: within the group
  const int heads = blockDim.y, slices = blockDim.z;  // heads: the group and its padding
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int tid = lane + S::kLanes * (head + heads * slice), threads = S::kLanes * heads * slices;
  const int token = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const DecodeWork w = decode_work<C, kD, S::kTileKeys>(p, token, kv_head, split, splits.num_splits);
  if (skip_empty_split(p, splits, w.k_begin, w.kv.k_end, token, kv_head, split, tid, threads)) return;
  const int64_t q_head = static_cast<int64_t>(kv_head) * group + head;

  float q[S::kVec] = {};  // this thread's slice of its head's query, scaled; zero for padding
  if (head < group) {
    const T* query = static_cast<const T*>(p.query) + token * p.query_stride + q_head * kD + lane * S::kVec;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) q[e] = to_float(query[e]) * (p.scale * p.k_scale);
  }

  Running<S::kVec> run;
  const int per_slice = S::kTileKeys / slices;
  if (w.k_begin < w.kv.k_end) load_tile<C, kD>(w, w.k_begin, 0, tid, threads, k_s, v_s, ok_s);
  int buf = 0;
  for (int64_t start = w.k_begin; start < w.kv.k_end; start += S::kTileKeys, buf ^= 1) {
    if (start + S::kTileKeys < w.kv.k_end) {  // the next tile's copy runs while this one is used
      load_tile<C, kD>(w, start + S::kTileKeys, buf ^ 1, tid, threads, k_s, v_s, ok_s);
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();  // every thread's copies into `buf` are done
    const C* k_tile = k_s + buf * S::kTileElements;
    const C* v_tile = v_s + buf * S::kTileElements;
    for (int j0 = slice * per_slice; j0 < (slice + 1) * per_slice; j0 += kChunk)
      fold_chunk<C, kD>(p, q, k_tile, v_tile, ok_s + buf * S::kTileKeys, j0, lane, run);
    __syncthreads();  // `buf` is refilled by the next iteration's copy
  }
  if (slices > 1 && !fold_slices<kD>(run, reinterpret_cast<float*>(smem), lane, head, slice, heads, slices)) return;
  if (head >= group) return;
#pragma unroll
  for (int e = 0; e < S::kVec; ++e) run.acc[e] *= p.v_scale;  // v = v_scale x what the cache holds

  if (splits.num_splits == 1) {
    T* out = static_cast<T*>(p.out) + token * p.out_stride + q_head * kD + lane * S::kVec;
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) out[e] = from_float<T>(run.l > 0 ? run.acc[e] / run.l : 0.0f);
    return;
  }
  const int64_t row = (token * p.num_heads + q_head) * splits.num_splits + split;
#pragma unroll
  for (int e = 0; e < S::kVec; ++e) splits.acc[row * kD + lane * S::kVec + e] = run.acc[e];
  if (lane == 0) {
    splits.max_sum[2 * row] = run.m;
    splits.max_sum[2 * row + 1] = run.l;
  }
}

}  // namespace attention_detail

// Slices: as many as bring the block to kDecodeThreads, each with whole chunks of a tile.
template <typename T, int kD, typename C>
void launch_paged_attention(const PagedAttentionParams& p, const SplitOutputs& splits) {
  using S = attention_detail::DecodeShape<C, kD>;
  const int heads = attention_detail::padded_heads<S::kLanes>(static_cast<int>(p.num_heads / p.num_kv_heads));
  int slices = 1;
  while (S::kLanes * heads * slices * 2 <= kDecodeThreads && slices * 2 * attention_detail::kChunk <= S::kTileKeys)
    slices *= 2;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(splits.num_splits));
  const dim3 block(S::kLanes, static_cast<unsigned>(heads), static_cast<unsigned>(slices));
  launch_kernel(attention_detail::paged_attention_kernel<T, kD, C>, grid, block, S::kSharedBytes, p, splits);
  check_launch("paged_attention");
}

#define OCTAVO_INSTANTIATE_PAGED_ATTENTION(D)                                                                      \
  template void launch_paged_attention<float, D, float>(const PagedAttentionParams&, const SplitOutputs&);     \
  template void launch_paged_attention<bf16, D, bf16>(const PagedAttentionParams&, const SplitOutputs&);       \
  template void launch_paged_attention<f16, D, f16>(const PagedAttentionParams&, const SplitOutputs&);         \
  template void launch_paged_attention<float, D, fp8e4m3>(const PagedAttentionParams&, const SplitOutputs&);   \
  template void launch_paged_attention<bf16, D, fp8e4m3>(const PagedAttentionParams&, const SplitOutputs&);    \
  template void launch_paged_attention<f16, D, fp8e4m3>(const PagedAttentionParams&, const SplitOutputs&);

}  // namespace octavo::cuda
