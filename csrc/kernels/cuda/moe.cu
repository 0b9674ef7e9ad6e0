// Mixture of experts on CUDA: the router's top-k (topk_softmax), the grouping of (token, slot)
// pairs by expert (moe_align), and the experts' MLP (fused_moe), with the CPU kernels'
// semantics (cpu/moe.cc): the same ids, ties to the lower id, ids of -1 skipped.
//
// fused_moe runs in four launches per chunk of tokens:
//   1. align_kernel groups the chunk's pairs by expert into blocks (moe_align's layout);
//   2. the gated pass computes act = silu(x·gateᵀ) * (x·upᵀ) for each block's rows, reading the
//      rows of hidden_states its pairs name;
//   3. the down pass computes y = act·downᵀ (float32);
//   4. combine_kernel adds each token's y rows, weighted, in ascending expert order.
// The passes have two paths each. The GEMV path (blocks of kGemvPairs) runs linear.cu's decode
// kernels over a block of pairs: expert_gemv_kernel (linear_kernel's shape, every format) or, for
// dense 16-bit experts, expert_dense_kernel (dense_gemv_kernel's), against the block's real pairs
// only (with_real_pairs: at decode, one). Each weight tile streams from
// memory once per step while the blocks of its expert read it from L2, which is what decode
// needs; act stays float32, so the result is the float32 product rounded once. expert_mma_kernel
// (expert_mma.cuh, blocks of kMmaPairs) runs the products on tensor cores, for 16-bit
// activations once a chunk has enough pairs (mma_pays); its act is rounded to
// the activations' type. Within a path a pair's sums do not depend on the other pairs in its
// block, and the combine's order is fixed: a token gets the same bits alone or in any batch that
// takes the same path.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "common.cuh"
#include "cuda_kernels.h"
#include "expert_mma.cuh"
#include "weight_rows.cuh"

namespace octavo::cuda {
namespace {

// ---- topk_softmax -------------------------------------------------------------------------

constexpr int kTopkThreads = 128;

// An expert and its score; id -1: none yet.
struct Candidate {
  float score;
  int id;
};

// The better of two candidates: a number beats NaN, a higher score beats a lower one, and ties go
// to the lower id (the CPU kernel's rule). Associative, so any reduction order gives the same one.
__device__ __forceinline__ Candidate better(Candidate a, Candidate b) {
  if (a.id < 0) return b;
  if (b.id < 0) return a;
  const bool a_nan = a.score != a.score, b_nan = b.score != b.score;
  if (a_nan != b_nan) return a_nan ? b : a;
  if (!a_nan && a.score != b.score) return a.score > b.score ? a : b;
  return a.id < b.id ? a : b;
}

// The block's best candidate, for every thread; the scratches hold 32 entries of shared memory.
__device__ Candidate block_best(Candidate c, float* score_scratch, int* id_scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    c = better(c, Candidate{__shfl_xor_sync(0xffffffffu, c.score, offset), __shfl_xor_sync(0xffffffffu, c.id, offset)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) score_scratch[warp] = c.score, id_scratch[warp] = c.id;
  __syncthreads();
  c = lane < static_cast<int>(blockDim.x / 32) ? Candidate{score_scratch[lane], id_scratch[lane]} : Candidate{0.0f, -1};
  for (int offset = 16; offset > 0; offset /= 2)
    c = better(c, Candidate{__shfl_xor_sync(0xffffffffu, c.score, offset), __shfl_xor_sync(0xffffffffu, c.id, offset)});
  __syncthreads();  // the scratch may be reused right after
  return c;
}

// Scores (soft-capped, then softmax or sigmoid) into `scores`.
template <typename T>
__device__ void score_row(const TopkParams& p, const T* logits, float* scores, float* scratch) {
  const int E = static_cast<int>(p.num_experts);
  const float cap = static_cast<float>(p.args.softcap);
  float top = -INFINITY;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float x = to_float(logits[e]);
    scores[e] = cap > 0.0f ? cap * tanhf(x / cap) : x;
    top = fmaxf(top, scores[e]);
  }
  if (p.args.scoring == MoeScoring::kSigmoid) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    __syncthreads();
    return;
  }
  top = block_reduce(top, [](float a, float b) { return fmaxf(a, b); }, -INFINITY, scratch);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < E; e += blockDim.x) sum += scores[e] = expf(scores[e] - top);
  sum = block_sum(sum, scratch);
  for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] /= sum;
  __syncthreads();
}

// eligible[e] = 1 for the experts of the topk_group best groups (a group's score is its best
// expert's), chosen as the CPU kernel chooses them; 1 for all without groups.
__device__ void mark_eligible(const TopkParams& p, const float* scores, unsigned char* eligible, float* group_best) {
  const int E = static_cast<int>(p.num_experts), groups = static_cast<int>(p.args.num_expert_group);
  if (groups == 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) eligible[e] = 1;
    __syncthreads();
    return;
  }
  const int per_group = E / groups;
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    float best = scores[g * per_group];
    for (int e = 1; e < per_group; ++e) best = fmaxf(best, scores[g * per_group + e]);
    group_best[g] = best;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // a few groups: one thread picks them, in the CPU kernel's order
    for (int e = 0; e < E; ++e) eligible[e] = 0;
    for (int pick = 0; pick < p.args.topk_group; ++pick) {
      Candidate chosen{0.0f, -1};
      for (int g = 0; g < groups; ++g)
        if (!eligible[g * per_group]) chosen = better(chosen, Candidate{group_best[g], g});
      for (int e = 0; e < per_group; ++e) eligible[chosen.id * per_group + e] = 1;
    }
  }
  __syncthreads();
}

// One block per token. Dynamic shared memory: scores [E] floats, then eligible [E] bytes, then
// the groups' best scores.
template <typename T>
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(TopkParams p) {
  __shared__ float scratch[32];
  __shared__ int id_scratch[32];
  const int E = static_cast<int>(p.num_experts);
  float* scores = reinterpret_cast<float*>(dynamic_shared_memory());
  float* group_best = scores + E;
  unsigned char* eligible = reinterpret_cast<unsigned char*>(group_best + p.args.num_expert_group);
  const int64_t t = blockIdx.x;
  score_row(p, static_cast<const T*>(p.gating_output) + t * p.gating_stride, scores, scratch);
  mark_eligible(p, scores, eligible, group_best);
  float* weights = p.topk_weights + t * p.top_k;
  int32_t* ids = p.topk_ids + t * p.top_k;
  float sum = 0.0f;  // thread 0's, in slot order as the CPU adds them
  for (int64_t slot = 0; slot < p.top_k; ++slot) {
    Candidate c{0.0f, -1};
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (eligible[e]) c = better(c, Candidate{scores[e], e});
    c = block_best(c, scratch, id_scratch);
    if (threadIdx.x == 0) {
      eligible[c.id] = 0;
      ids[slot] = c.id;
      sum += weights[slot] = scores[c.id];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && p.args.renormalize)
    for (int64_t slot = 0; slot < p.top_k; ++slot) weights[slot] /= sum;
}

size_t topk_shared_bytes(const TopkParams& p) {
  return (p.num_experts + p.args.num_expert_group) * sizeof(float) + p.num_experts;
}

// ---- grouping by expert -------------------------------------------------------------------

constexpr int kAlignThreads = 1024;

struct AlignParams {
  const int32_t* topk_ids;  // [pairs]
  int32_t* sorted_token_ids;
  int32_t* expert_ids;
  int32_t* num_tokens_post_padded;
  int32_t* pair_rows;  // [pairs]: where each pair landed in sorted_token_ids, or null
  int32_t pairs, num_experts, block_size, capacity;
};

constexpr int kAlignWarps = kAlignThreads / 32;

// Shared memory of align_kernel: offsets [kAlignWarps][E], counts [E], starts [E + 1].
size_t align_shared_bytes(int64_t num_experts) {
  return ((kAlignWarps + 2) * static_cast<size_t>(num_experts) + 1) * sizeof(int32_t);
}

// A pair's expert as align_kernel groups it: ids outside [0, E), and lanes past the warp's pairs, are -1.
__device__ __forceinline__ int32_t align_expert(const AlignParams& p, int i, int end) {
  const int32_t id = i < end ? p.topk_ids[i] : -1;
  return id >= 0 && id < p.num_experts ? id : -1;
}

// One block. Each warp takes a contiguous range of the pairs and counts them per expert; a prefix
// over the warps then gives each warp where its pairs of each expert start, and each warp places
// its pairs in order, 32 at a time (__match_any_sync groups a round's lanes by expert). So every
// expert's pairs keep their order, as on the CPU, in O(pairs / threads) steps per thread.
__global__ void __launch_bounds__(kAlignThreads) align_kernel(AlignParams p) {
  const int E = p.num_experts, B = p.block_size;
  int32_t* offsets = reinterpret_cast<int32_t*>(dynamic_shared_memory());  // [warp][expert]
  int32_t* counts = offsets + kAlignWarps * E;
  int32_t* starts = counts + E;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned below = (1u << lane) - 1u;  // the lanes before this one
  const int per_warp = (p.pairs + kAlignWarps - 1) / kAlignWarps;
  const int begin = warp * per_warp, end = min(p.pairs, begin + per_warp);
  int32_t* mine = offsets + warp * E;
  for (int i = threadIdx.x; i < kAlignWarps * E; i += blockDim.x) offsets[i] = 0;
  __syncthreads();
  for (int base = begin; base < end; base += 32) {
    const int32_t id = align_expert(p, base + lane, end);
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    if (id >= 0 && (peers & below) == 0) mine[id] += __popc(peers);  // one lane per expert and round
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // counts, and each warp's offset in its expert
    int32_t total = 0;
    for (int w = 0; w < kAlignWarps; ++w) {
      const int32_t n = offsets[w * E + e];
      offsets[w * E + e] = total;
      total += n;
    }
    counts[e] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t used = 0;
    for (int e = 0; e < E; ++e) {
      starts[e] = used;
      used += (counts[e] + B - 1) / B * B;
    }
    starts[E] = used;
    *p.num_tokens_post_padded = used;
  }
  __syncthreads();
  const int32_t used = starts[E];
  for (int i = threadIdx.x; i < p.capacity; i += blockDim.x) p.sorted_token_ids[i] = p.pairs;
  for (int b = threadIdx.x; b < p.capacity / B; b += blockDim.x)
    p.expert_ids[b] = b * B < used ? last_at_most(starts, E, b * B) : -1;
  __syncthreads();  // the padding first: the pairs overwrite some of it
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const int32_t id = align_expert(p, i, end);
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    if (id >= 0) {
      const int32_t row = starts[id] + mine[id] + __popc(peers & below);
      p.sorted_token_ids[row] = i;
      if (p.pair_rows != nullptr) p.pair_rows[i] = row;
    }
    __syncwarp();  // every lane has read its expert's offset before the first lane moves it on
    if (id >= 0 && (peers & below) == 0) mine[id] += __popc(peers);
    __syncwarp();
  }
}

void launch_align(const AlignParams& p) {
  const size_t bytes = align_shared_bytes(p.num_experts);
  static std::atomic<size_t> allowed[kMaxDevices];
  allow_shared_memory(align_kernel, bytes, allowed, "moe_align");
  launch_kernel(align_kernel, dim3(1), kAlignThreads, bytes, p);
  check_launch("moe_align");
}

// ---- the experts' projections -------------------------------------------------------------

constexpr int kGemvPairs = 4;  // pairs per moe_align block for the GEMV kernels: their input rows
constexpr int kExpertThreads = 128;
constexpr int kExpertRows = 4;  // weight rows per CUDA block (gated: 2 gate rows and their 2 up rows)

// One projection of fused_moe over the aligned pairs.
struct ExpertPass {
  ExpertStack w;
  int64_t in_features;  // of each weight row
  int64_t features;     // outputs per pair: the intermediate size (gated) or the hidden size
  const void* input;    // gated: hidden_states, rows by token; else act, rows by aligned position
  int64_t in_stride;
  void* out;            // [capacity, features]: float32, but the tensor-core gated pass's act is T
  const int32_t* sorted_token_ids;
  const int32_t* expert_ids;
  int64_t blocks, pairs, top_k;  // aligned blocks; pairs in the chunk
};

// Expert e's rows as linear's row decoders take them.
__device__ __forceinline__ LinearParams expert_weight(const ExpertPass& p, int e) {
  LinearParams lp{};
  lp.weight = static_cast<const uint8_t*>(p.w.weight) + e * p.w.expert_bytes;
  lp.scales = p.w.scales != nullptr ? p.w.scales + e * p.w.expert_scales : nullptr;
  lp.zeros = p.w.zeros != nullptr ? p.w.zeros + e * p.w.expert_zeros : nullptr;
  lp.in_features = p.in_features;
  lp.out_features = p.w.rows;
  lp.group_size = p.w.group_size;
  return lp;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// The input rows of aligned block `block`'s first kC pairs (gated: hidden_states rows by token;
// else act rows by position). A block with an expert holds at least one pair, its first; padding
// repeats it (its results are not stored).
template <bool kGated, typename TIn, int kC>
__device__ __forceinline__ void gemv_inputs(const ExpertPass& p, int64_t block, const TIn* (&x)[kC]) {
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const bool real = p.sorted_token_ids[block * kGemvPairs + c] < p.pairs;
    const int64_t row = block * kGemvPairs + (real ? c : 0);
    const int64_t input_row = kGated ? p.sorted_token_ids[row] / p.top_k : row;
    x[c] = static_cast<const TIn*>(p.input) + input_row * p.in_stride;
  }
}

// Calls fn(std::integral_constant<int, kC>) with the fewest input rows (1, 2 or all kGemvPairs)
// that hold aligned block `block`'s real pairs (moe_align pads an expert's last block at its
// end). At decode most blocks hold one pair, and multiplying the padding too made the dense
// kernel L1-bound (H200, Mixtral-shaped experts at one token: 0.55 of read bandwidth, now 0.98).
template <typename Fn>
__device__ __forceinline__ void with_real_pairs(const ExpertPass& p, int64_t block, Fn&& fn) {
  static_assert(kGemvPairs == 4, "the cases below");
  const int32_t* ids = p.sorted_token_ids + block * kGemvPairs;
  if (ids[1] >= p.pairs) fn(std::integral_constant<int, 1>{});
  else if (ids[2] >= p.pairs) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, kGemvPairs>{});
}

// A CUDA block: 4 weight rows of one aligned block's expert against its first kC pairs' rows
// (with_real_pairs), split over the threads as linear_kernel splits a row (kParts threads per block
// of 32 weights), partial sums reduced in a fixed order. kGated: rows n, n + 1 of gate and of up,
// stored as silu(gate) * up; else rows n..n + 3, stored as they are. Aligned blocks are numbered
// fastest, as linear_kernel numbers its input-row chunks, so the blocks that read one weight
// tile run together and it comes from memory about once.
template <typename TIn, typename Row, bool kGated, int kC>
__device__ __forceinline__ void expert_gemv_rows(const ExpertPass& p, int64_t block, int64_t tile, int e) {
  __shared__ float partial[kExpertThreads / 32][kExpertRows][kC];
  const int64_t n0 = tile * (kGated ? 2 : kExpertRows);
  const TIn* x[kC];
  gemv_inputs<kGated>(p, block, x);
  const LinearParams lp = expert_weight(p, e);
  const int64_t last = p.features - 1;
  const int64_t up = kGated ? p.features : 0;
  const Row w[kExpertRows] = {
      Row(lp, min64(n0, last)), Row(lp, min64(n0 + 1, last)),
      Row(lp, kGated ? up + min64(n0, last) : min64(n0 + 2, last)),
      Row(lp, kGated ? up + min64(n0 + 1, last) : min64(n0 + 3, last))};
  dot_rows<kExpertThreads>(w, x, p.in_features, partial);
  if (threadIdx.x >= kExpertRows * kC) return;
  const int r = threadIdx.x / kC, c = threadIdx.x % kC;
  const auto sum = [&](int row) { return sum_partial(partial, row, c); };
  if (kGated && r >= 2) return;
  const int64_t n = n0 + r;
  const int64_t pos = block * kGemvPairs + c;
  if (n >= p.features || p.sorted_token_ids[pos] >= p.pairs) return;
  static_cast<float*>(p.out)[pos * p.features + n] = kGated ? silu(sum(r)) * sum(r + 2) : sum(r);
}

template <typename TIn, typename Row, bool kGated>
__global__ void __launch_bounds__(kExpertThreads) expert_gemv_kernel(ExpertPass p) {
  const int64_t block = blockIdx.x % p.blocks, tile = blockIdx.x / p.blocks;
  const int e = p.expert_ids[block];
  if (e < 0) return;
  with_real_pairs(p, block, [&](auto c) { expert_gemv_rows<TIn, Row, kGated, decltype(c)::value>(p, block, tile, e); });
}

// Dense 16-bit experts are read as linear.cu's dense_gemv_kernel reads such weights (its shape,
// measured on an H200: 4 warps of one row each, 8 loads in flight per lane). The kernel there keeps
// its own copy of this loop: sharing this one made ptxas spill in it.
constexpr int kGemvWarps = 4;   // weight rows per CUDA block, a warp each
constexpr int kGemvUnroll = 8;  // 16-byte weight loads in flight per lane

// acc[c] = dot(w, x[c]) over K for a dense bfloat16 / float16 weight row w, by one warp: the bytes
// are all the work at decode, so each lane streams its 16-byte packs of the row, kGemvUnroll in
// flight, and sums their products in k order; a butterfly then sums the lanes (every lane gets
// the sums). The same order for any kC: a row's result is the same bits whatever the batch. The
// row and the input rows must be 16-byte aligned (inputs of T) or 4-float aligned (float32).
template <typename T, typename TIn, int kC>
__device__ __forceinline__ void warp_row_dot(const T* w, const TIn* const (&x)[kC], int64_t K, float (&acc)[kC]) {
  constexpr int kVec = Pack<T>::kSize, kStep = 32 * kVec;
  const auto fold = [&](const Pack<T>& wp, int64_t k) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      if constexpr (std::is_same_v<TIn, T>) {  // inputs of T: one 16-byte load
        const Pack<T> xp = load_pack(x[c] + k);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[c] = fmaf(to_float(wp.v[j]), to_float(xp.v[j]), acc[c]);
      } else {  // float32 inputs: kVec / 4 loads of 4
        float xs[kVec];
#pragma unroll
        for (int j = 0; j < kVec; j += 4) load4(x[c] + k + j, xs + j);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[c] = fmaf(to_float(wp.v[j]), xs[j], acc[c]);
      }
    }
  };
  const int lane = threadIdx.x % 32;
  int64_t k = lane * kVec;
  for (; k + (kGemvUnroll - 1) * kStep < K; k += kGemvUnroll * kStep) {
    Pack<T> wp[kGemvUnroll];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) wp[u] = load_pack(w + k + u * kStep);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) fold(wp[u], k + u * kStep);
  }
  for (; k < K; k += kStep) fold(load_pack(w + k), k);
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    float v = acc[c];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    acc[c] = v;
  }
}

// expert_gemv_kernel for dense bfloat16 / float16 experts, as linear's dense_gemv_kernel reads
// such weights: a warp per feature (gated: its gate row, then its up row; warp_row_dot) streams
// 16-byte packs against the block's first kC pairs' rows (with_real_pairs). Features are
// numbered aligned block fastest.
template <typename T, typename TIn, bool kGated, int kC>
__device__ __forceinline__ void expert_dense_rows(const ExpertPass& p, int64_t block, int64_t n, int e) {
  const TIn* x[kC];
  gemv_inputs<kGated>(p, block, x);
  const T* w = reinterpret_cast<const T*>(static_cast<const uint8_t*>(p.w.weight) + e * p.w.expert_bytes);
  float acc[kC] = {}, up[kC] = {};
  warp_row_dot(w + n * p.in_features, x, p.in_features, acc);
  if constexpr (kGated) warp_row_dot(w + (p.features + n) * p.in_features, x, p.in_features, up);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int64_t pos = block * kGemvPairs + c;
    if (lane != c || p.sorted_token_ids[pos] >= p.pairs) continue;
    static_cast<float*>(p.out)[pos * p.features + n] = kGated ? silu(acc[c]) * up[c] : acc[c];
  }
}

template <typename T, typename TIn, bool kGated>
__global__ void __launch_bounds__(kGemvWarps * 32) expert_dense_kernel(ExpertPass p) {
  const int64_t block = blockIdx.x % p.blocks;
  const int64_t n = blockIdx.x / p.blocks * kGemvWarps + threadIdx.x / 32;
  const int e = p.expert_ids[block];
  if (e < 0 || n >= p.features) return;  // a whole block or a whole warp: nothing waits for it
  with_real_pairs(p, block, [&](auto c) { expert_dense_rows<T, TIn, kGated, decltype(c)::value>(p, block, n, e); });
}

// The tensor-core version of expert_gemv_kernel (expert_mma.cuh): a block of kMmaPairs pairs
// against kMmaRows weight rows (gated: 32 features' gate and up rows), act stored as T.
template <typename T, typename Row, bool kGated>
__global__ void __launch_bounds__(kMmaThreads) expert_mma_kernel(ExpertPass p) {
  T* shared = reinterpret_cast<T*>(dynamic_shared_memory());
  const int64_t block = blockIdx.x % p.blocks, tile = blockIdx.x / p.blocks;
  const int e = p.expert_ids[block];
  if (e < 0) return;
  const int64_t n0 = tile * (kGated ? kMmaRows / 2 : kMmaRows), first = block * kMmaPairs;
  const LinearParams lp = expert_weight(p, e);
  // This thread's two chunks of each step: tile rows r and r + 32 (see load_mma_step).
  const T* x[2];
  bool x_real[2];
  const T* w_dense[2];
  int64_t w_rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (threadIdx.x + h * kMmaThreads) / 4;
    const int32_t sorted = p.sorted_token_ids[first + r];
    x_real[h] = sorted < p.pairs;  // padding reads a real row, zero-filled
    const int64_t input_row = kGated ? (x_real[h] ? sorted / p.top_k : 0) : first + r;
    x[h] = static_cast<const T*>(p.input) + input_row * p.in_stride;
    w_rows[h] = tile_weight_row<kGated>(n0, r, p.features);
    w_dense[h] = static_cast<const T*>(lp.weight) + w_rows[h] * p.in_features;  // read for dense weights only
  }
  const Row w[2] = {Row(lp, w_rows[0]), Row(lp, w_rows[1])};
  const int64_t steps = p.in_features / kBlockWeights;
  load_mma_step<T, Row>(x, x_real, w, w_dense, 0, shared);
  copy_async_commit();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp % 2, wn = warp / 2;
  float c[2][4][4] = {};
  for (int64_t s = 0; s < steps; ++s) {
    const int buf = static_cast<int>(s % 2);
    if (s + 1 < steps) {  // the next step's copy runs while this one is multiplied
      load_mma_step<T, Row>(x, x_real, w, w_dense, s + 1, shared + (buf ^ 1) * kMmaTile);
      copy_async_commit();
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    __syncthreads();
    multiply_mma_step<T>(shared + buf * kMmaTile, wm, wn, lane, c);
    __syncthreads();  // before the next step's copy overwrites this buffer
  }
  // C fragments: m-tile i rows g, g + 8 (g = lane / 4), n-tile n columns 2t, 2t + 1 (t = lane % 4).
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t pos = first + 32 * wm + 16 * i + g + 8 * hh;
      if (p.sorted_token_ids[pos] >= p.pairs) continue;
      if constexpr (kGated) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int64_t f = n0 + 16 * wn + 8 * n + 2 * t;  // features are whole 32s: f + 1 is real too
          if (f >= p.features) continue;
          const float* gate = &c[i][n][2 * hh];
          const float* up = &c[i][n + 2][2 * hh];
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + pos * p.features + f) =
              pack_pair<T>(silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
        }
      } else {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int64_t f = n0 + 32 * wn + 8 * n + 2 * t;
          if (f >= p.features) continue;
          float* y = static_cast<float*>(p.out) + pos * p.features + f;
          y[0] = c[i][n][2 * hh];
          y[1] = c[i][n][2 * hh + 1];
        }
      }
    }
}

// ---- the weighted sum -----------------------------------------------------------------------

constexpr int kCombineThreads = 256;

struct CombineParams {
  void* out;  // the chunk's first row
  const float* y;
  const float* topk_weights;  // the chunk's first token's
  const int32_t* topk_ids;
  const int32_t* pair_rows;
  int64_t hidden, top_k, out_stride, num_experts;
};

// A block per token and kCombineColumns of its columns: its slots ordered by (expert, slot) by
// thread 0, as the CPU kernel adds them, with each slot's weight and y row kept beside the
// order, then each thread sums its columns in that order. At decode a token's columns are all
// there is to spread over the device: one block per token took 10-14 us per call, its threads
// walking their columns through chains of dependent loads. Dynamic shared memory: combine_shared_bytes.
constexpr int kCombineColumns = 4 * kCombineThreads;

inline size_t combine_shared_bytes(int64_t top_k) {
  return static_cast<size_t>(top_k) * (sizeof(int64_t) + sizeof(float) + sizeof(int32_t));
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams p) {
  int64_t* rows = reinterpret_cast<int64_t*>(dynamic_shared_memory());  // y's offsets, in slot order
  float* weights = reinterpret_cast<float*>(rows + p.top_k);
  int32_t* order = reinterpret_cast<int32_t*>(weights + p.top_k);
  __shared__ int count;
  const int64_t t = blockIdx.x;
  const int32_t* ids = p.topk_ids + t * p.top_k;
  if (threadIdx.x == 0) {
    int n = 0;
    for (int slot = 0; slot < p.top_k; ++slot) {
      if (ids[slot] < 0 || ids[slot] >= p.num_experts) continue;
      int j = n++;
      for (; j > 0 && ids[order[j - 1]] > ids[slot]; --j) order[j] = order[j - 1];
      order[j] = slot;
    }
    for (int j = 0; j < n; ++j) {
      const int64_t pair = t * p.top_k + order[j];
      weights[j] = p.topk_weights[pair];
      rows[j] = p.pair_rows[pair] * p.hidden;
    }
    count = n;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + t * p.out_stride;
  const int64_t end = min64(p.hidden, (blockIdx.y + int64_t{1}) * kCombineColumns);
  for (int64_t h = blockIdx.y * int64_t{kCombineColumns} + threadIdx.x; h < end; h += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < count; ++j) acc += weights[j] * p.y[rows[j] + h];
    out[h] = from_float<T>(acc);
  }
}

// ---- fused_moe ------------------------------------------------------------------------------

// The intermediates of one chunk of tokens take at most this many floats (256 MiB), or what
// kMinChunkPairs pairs need if that is more: a Mixtral-sized layer (hidden 4096, intermediate
// 14336, top-2) runs ~1500 tokens at once, a Qwen3-30B-A3B-sized one (2048, 768, top-8) ~1900.
constexpr int64_t kWorkspaceFloats = int64_t{1} << 26;
constexpr int64_t kMinChunkPairs = 2048;
// The tensor-core kernels take 16-bit activations once a chunk fills one of their blocks
// (kMmaPairs), or once the experts average this many pairs, where the GEMV kernels would read each
// weight tile once per kGemvPairs of them. Measured on an H200 (bench_moe.py, both paths at 1-128
// tokens, bench/RESULTS.md): Mixtral-like dense experts cross over at ~2 pairs each, int4 ones at
// ~4 (their tiles cost the decode too); Qwen3-30B-like experts (128 of them, small) from 64 pairs.
constexpr int64_t kMmaFromPairsPerDenseExpert = 2;
constexpr int64_t kMmaFromPairsPerQuantizedExpert = 4;

// OCTAVO_FUSED_MOE_MMA_FROM_PAIRS, read once where set, replaces the rule: tensor cores from that
// many pairs per expert (0: wherever rows fit). Benchmarks time both paths at the same sizes with it.
int64_t forced_mma_from_pairs() {
  static const int64_t value = [] {
    const char* set = std::getenv("OCTAVO_FUSED_MOE_MMA_FROM_PAIRS");
    return set ? std::clamp<int64_t>(std::strtoll(set, nullptr, 10), 0, int64_t{1} << 30) : int64_t{-1};
  }();
  return value;
}

// Whether `pairs` are enough for the tensor-core kernels (above).
bool mma_pays(const FusedMoeParams& p, int64_t pairs) {
  const int64_t experts = std::min(p.num_experts, pairs), forced = forced_mma_from_pairs();
  if (forced >= 0) return pairs >= forced * experts;
  const bool quantized = p.w13.format != WeightFormat::kDense || p.w2.format != WeightFormat::kDense;
  return pairs >= kMmaPairs ||
         pairs >= (quantized ? kMmaFromPairsPerQuantizedExpert : kMmaFromPairsPerDenseExpert) * experts;
}

// The chunk's scratch in one workspace: sorted ids, expert ids, the padded count, pair rows,
// then act [capacity, I] (float32, or T on the tensor-core path) and y [capacity, H] float32.
struct MoeScratch {
  int32_t *sorted, *expert_ids, *post_padded, *pair_rows;
  float *act, *y;
  int64_t capacity;
};

// Capacity: the most rows the blocks can take, pairs + (block - 1) for each expert that can have
// pairs (at most `pairs` of them: a decode step's few pairs then launch a few blocks, not one per
// expert that has none).
MoeScratch moe_scratch(const FusedMoeParams& p, int64_t pairs, int block) {
  const int64_t cap = pairs + std::min(p.num_experts, pairs) * (block - 1);
  const int64_t ints = (cap + cap / block + 1 + pairs + 3) / 4 * 4;  // the floats start 16-byte aligned
  const size_t bytes = (ints + cap * (p.intermediate + p.hidden)) * sizeof(float);
  auto* base = static_cast<int32_t*>(device_workspace(WorkspaceSlot::kMoe, bytes, "fused_moe"));
  float* floats = reinterpret_cast<float*>(base + ints);
  return MoeScratch{base,   base + cap, base + cap + cap / block, base + cap + cap / block + 1,
                    floats, floats + cap * p.intermediate, cap};
}

// Whether a dense 16-bit stack's rows, and the pass's input rows, can be read in 16-byte packs.
template <typename TIn, typename Row>
bool dense_packs_fit(const ExpertPass& pass) {
  if constexpr (std::is_same_v<Row, DenseRow<bf16>> || std::is_same_v<Row, DenseRow<f16>>) {
    return aligned(pass.w.weight, 16) && pass.w.expert_bytes % 16 == 0 && pass.in_features % 8 == 0 &&
           aligned(pass.input, 16) && pass.in_stride * sizeof(TIn) % 16 == 0;
  } else {
    return false;
  }
}

// One pass of the chunk on the kernel its path and weights take; TIn: the type of its input rows.
template <typename TIn, typename Row, bool kGated, bool kMma>
void launch_pass(const ExpertPass& pass) {
  OCTAVO_CHECK(aligned(pass.w.weight, Row::kAlign) && pass.w.expert_bytes % Row::kAlign == 0,
               "fused_moe on CUDA: each expert's weights must start at a " << Row::kAlign << "-byte boundary");
  const bool dense = !kMma && dense_packs_fit<TIn, Row>(pass);
  const int rows = kMma ? (kGated ? kMmaRows / 2 : kMmaRows) : dense ? kGemvWarps : (kGated ? 2 : kExpertRows);
  const int64_t blocks = pass.blocks * ceil_div(pass.features, rows);
  OCTAVO_CHECK(blocks < (int64_t{1} << 31), "fused_moe on CUDA: too many outputs for one launch");
  const dim3 grid(static_cast<unsigned>(blocks));
  if constexpr (kMma) {
    launch_kernel(expert_mma_kernel<TIn, Row, kGated>, grid, kMmaThreads, kMmaSharedBytes, pass);
  } else if constexpr (std::is_same_v<Row, DenseRow<bf16>> || std::is_same_v<Row, DenseRow<f16>>) {
    using TW = std::conditional_t<std::is_same_v<Row, DenseRow<bf16>>, bf16, f16>;
    if (dense) launch_kernel(expert_dense_kernel<TW, TIn, kGated>, grid, kGemvWarps * 32, 0, pass);
    else launch_kernel(expert_gemv_kernel<TIn, Row, kGated>, grid, kExpertThreads, 0, pass);
  } else {
    launch_kernel(expert_gemv_kernel<TIn, Row, kGated>, grid, kExpertThreads, 0, pass);
  }
  check_launch("fused_moe");
}

// Calls fn(Row*) with the row decoder of a stack's format (dense: of T).
template <typename T, typename Fn>
void dispatch_stack(const ExpertStack& w, Fn&& fn) {
  // int4_a8, int8_a8, bf16_tiles: refused before launch (ops/moe.cc), CPU only
  OCTAVO_CHECK(dispatch_rows<T>(w.format, fn), "fused_moe on CUDA: experts in " << weight_format_name(w.format)
                                                   << " (a CPU layout) are not read on CUDA");
}

// Whether a chunk of `pairs` with 16-bit activations takes the tensor-core kernels: enough pairs
// (mma_pays), and rows that cp.async can copy (16-byte aligned input rows and dense expert rows).
template <typename T>
bool takes_mma(const FusedMoeParams& p, int64_t pairs) {
  const auto dense_fits = [](const ExpertStack& w) {
    return w.format != WeightFormat::kDense || (aligned(w.weight, 16) && w.expert_bytes % 16 == 0);
  };
  return mma_pays(p, pairs) && packs_fit<T>(p.hidden_states, p.hidden, p.in_stride) && dense_fits(p.w13) && dense_fits(p.w2);
}

// Tokens [t0, t1) through their experts into out's rows t0..t1.
template <typename T, bool kMma>
void run_chunk(const FusedMoeParams& p, int64_t t0, int64_t t1) {
  constexpr int block = kMma ? kMmaPairs : kGemvPairs;
  using Act = std::conditional_t<kMma, T, float>;  // the type of act, the down pass's input
  const int64_t pairs = (t1 - t0) * p.top_k;
  const MoeScratch s = moe_scratch(p, pairs, block);
  launch_align(AlignParams{p.topk_ids + t0 * p.top_k, s.sorted, s.expert_ids, s.post_padded, s.pair_rows,
                           static_cast<int32_t>(pairs), static_cast<int32_t>(p.num_experts), block,
                           static_cast<int32_t>(s.capacity)});
  const T* hidden = static_cast<const T*>(p.hidden_states) + t0 * p.in_stride;
  const int64_t blocks = s.capacity / block;
  const ExpertPass up{p.w13, p.hidden, p.intermediate, hidden, p.in_stride, s.act, s.sorted, s.expert_ids,
                      blocks, pairs, p.top_k};
  dispatch_stack<T>(p.w13, [&](auto* row) { launch_pass<T, std::remove_pointer_t<decltype(row)>, true, kMma>(up); });
  const ExpertPass down{p.w2, p.intermediate, p.hidden, s.act, p.intermediate, s.y, s.sorted, s.expert_ids,
                        blocks, pairs, p.top_k};
  dispatch_stack<T>(p.w2,
                    [&](auto* row) { launch_pass<Act, std::remove_pointer_t<decltype(row)>, false, kMma>(down); });
  const CombineParams c{static_cast<T*>(p.out) + t0 * p.out_stride, s.y, p.topk_weights + t0 * p.top_k,
                        p.topk_ids + t0 * p.top_k, s.pair_rows, p.hidden, p.top_k, p.out_stride, p.num_experts};
  const dim3 grid(static_cast<unsigned>(t1 - t0), static_cast<unsigned>(ceil_div(p.hidden, kCombineColumns)));
  static std::atomic<size_t> allowed[kMaxDevices];
  allow_shared_memory(combine_kernel<T>, combine_shared_bytes(p.top_k), allowed, "fused_moe");
  launch_kernel(combine_kernel<T>, grid, kCombineThreads, combine_shared_bytes(p.top_k), c);
  check_launch("fused_moe");
}

template <typename T>
void run_fused_moe(const FusedMoeParams& p) {
  OCTAVO_CHECK(static_cast<int64_t>(combine_shared_bytes(p.top_k)) <= shared_memory_optin(),
               "fused_moe on CUDA: " << p.top_k << " slots per token (top_k) need more shared memory than the device has");
  OCTAVO_CHECK(p.hidden % kBlockWeights == 0 && p.intermediate % kBlockWeights == 0,
               "fused_moe on CUDA reads rows of 32 inputs: hidden size " << p.hidden << " and intermediate size "
                                                                        << p.intermediate
                                                                        << " must be multiples of 32");
  OCTAVO_CHECK(aligned(p.hidden_states, 4 * sizeof(T)) && p.in_stride % 4 == 0,
               "fused_moe on CUDA: hidden_states rows must start at 4-element boundaries (a contiguous tensor's do)");
  const int64_t pairs = std::max(kMinChunkPairs, kWorkspaceFloats / (p.intermediate + p.hidden) -
                                                     p.num_experts * (kMmaPairs - 1));
  const int64_t chunk = std::max<int64_t>(1, pairs / p.top_k);
  for (int64_t t0 = 0; t0 < p.tokens; t0 += chunk) {
    const int64_t t1 = std::min(p.tokens, t0 + chunk);
    if constexpr (!std::is_same_v<T, float>) {
      if (takes_mma<T>(p, (t1 - t0) * p.top_k)) {
        run_chunk<T, true>(p, t0, t1);
        continue;
      }
    }
    run_chunk<T, false>(p, t0, t1);
  }
}

}  // namespace

void topk_softmax(const TopkParams& p) {
  if (p.tokens == 0) return;
  const size_t bytes = topk_shared_bytes(p);
  OCTAVO_CHECK(static_cast<int64_t>(bytes) <= shared_memory_optin(),
               "topk_softmax on CUDA: " << p.num_experts << " experts need more shared memory than the device has");
  dispatch_float(p.dtype, "topk_softmax", [&](auto t) {
    using T = decltype(t);
    static std::atomic<size_t> allowed[kMaxDevices];
    allow_shared_memory(topk_kernel<T>, bytes, allowed, "topk_softmax");
    launch_kernel(topk_kernel<T>, dim3(static_cast<unsigned>(p.tokens)), kTopkThreads, bytes, p);
  });
  check_launch("topk_softmax");
}

void moe_align(const MoeAlignParams& p) {
  OCTAVO_CHECK(static_cast<int64_t>(align_shared_bytes(p.num_experts)) <= shared_memory_optin(),
               "moe_align on CUDA: " << p.num_experts << " experts need more shared memory than the device has");
  launch_align(AlignParams{p.topk_ids, p.sorted_token_ids, p.expert_ids, p.num_tokens_post_padded, nullptr,
                           static_cast<int32_t>(p.pairs), static_cast<int32_t>(p.num_experts),
                           static_cast<int32_t>(p.block_size), static_cast<int32_t>(p.capacity)});
}

void fused_moe(const FusedMoeParams& p) {
  if (p.tokens == 0) return;
  OCTAVO_CHECK(static_cast<int64_t>(align_shared_bytes(p.num_experts)) <= shared_memory_optin(),
               "fused_moe on CUDA: " << p.num_experts << " experts need more shared memory than the device has");
  dispatch_float(p.dtype, "fused_moe", [&](auto t) { run_fused_moe<decltype(t)>(p); });
}

}  // namespace octavo::cuda
