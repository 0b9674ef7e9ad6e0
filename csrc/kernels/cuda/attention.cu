// paged_attention's host side: which kernel takes a batch (prefill, grouped decode or split-KV
// decode; a mixed batch's counted decodes apart from its chunks), how many splits, the split
// workspace and its reservation, the head-size and dtype dispatch, and the merge of split results.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention.cuh"
#include "cuda_kernels.h"
#include "prefill_attention.cuh"

namespace octavo::cuda {
namespace {

constexpr int kMaxSplits = 128;  // a batch-1 MQA step has one (token, KV head): up to ~2 blocks per SM from splits alone
constexpr int64_t kMinKeysPerSplit = 256;  // below this a split's fixed costs dominate

// Enough blocks to fill the GPU twice over, without splits shorter than kMinKeysPerSplit. The
// host cannot read seq_lens, so the table's width bounds the context; splits past a sequence's
// end are empty and weigh nothing in the merge.
int choose_splits(const PagedAttentionParams& p) {
  const int64_t blocks = p.num_tokens * p.num_kv_heads;
  const int64_t want = ceil_div(2 * multiprocessor_count(), blocks);
  const int64_t most = ceil_div(p.max_blocks_per_seq * p.block_size, kMinKeysPerSplit);
  return static_cast<int>(max64(1, min64(min64(want, most), kMaxSplits)));
}

// out[token, head] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s. One block
// per (token, head), a thread per element of the head.
template <typename T>
__global__ void merge_splits_kernel(PagedAttentionParams p, SplitOutputs splits) {
  const int64_t token = blockIdx.x, head = blockIdx.y, row0 = (token * p.num_heads + head) * splits.num_splits;
  float m = -INFINITY;
  for (int s = 0; s < splits.num_splits; ++s)
    if (splits.max_sum[2 * (row0 + s) + 1] > 0) m = fmaxf(m, splits.max_sum[2 * (row0 + s)]);
  T* out = static_cast<T*>(p.out) + token * p.out_stride + head * p.head_size;
  for (int64_t d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < splits.num_splits; ++s) {
      const float sum = splits.max_sum[2 * (row0 + s) + 1];
      if (sum <= 0) continue;  // an empty split
      const float w = __expf(splits.max_sum[2 * (row0 + s)] - m);
      num += w * splits.acc[(row0 + s) * p.head_size + d];
      den += w * sum;
    }
    out[d] = from_float<T>(den > 0 ? num / den : 0.0f);
  }
}

// Tiles per sequence, prefix-summed: offsets[b] = tiles of sequences before b (what
// plan_paged_attention computes on the host).
__global__ void tile_offsets_kernel(const int32_t* query_start_loc, int64_t num_seqs, int group, int32_t* offsets) {
  if (threadIdx.x != 0) return;
  int32_t total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    offsets[b] = total;
    total += prefill_tiles(query_start_loc[b + 1] - query_start_loc[b], group);
  }
  offsets[num_seqs] = total;
}

// Calls fn(std::integral_constant<int, D>{}) for the head size D (checked by paged_attention).
template <typename Fn>
void dispatch_head_size(int64_t head_size, Fn&& fn) {
  switch (head_size) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    default: return fn(std::integral_constant<int, 256>{});
  }
}

// The tensor-core prefill kernel takes batches with at least one multi-token query (a sequence
// of decodes alone is the decode kernels' case) in bfloat16 / float16, when query and output
// rows can be read in 16-byte packs; over an fp8 cache, where its shape fits the device too (a
// 16-bit cache's always does on the devices Octavo runs on, and a smaller one is told so).
template <typename T, typename C>
bool takes_prefill_kernel(const PagedAttentionParams& p) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    bool fits = std::is_same_v<T, C>;
    if (!fits) dispatch_head_size(p.head_size, [&](auto d) { fits = prefill_fits<T, d(), C>(); });
    return fits && p.num_tokens != p.num_seqs && packs_fit<T>(p.query, p.head_size, p.query_stride) &&
           packs_fit<T>(p.out, p.head_size, p.out_stride);
  }
}

template <typename T, typename C>
void run_prefill(const PagedAttentionParams& p) {
  if constexpr (!std::is_same_v<T, float>) {  // the tensor-core kernel takes 16-bit types only
    const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
    const int64_t max_tiles = p.num_seqs + ceil_div(p.num_tokens, kPrefillRows / group);
    const int32_t* offsets = p.tile_offsets;
    if (offsets == nullptr) {  // no host plan: lay the tiles out here, still without a host sync
      auto* laid_out = static_cast<int32_t*>(device_workspace(WorkspaceSlot::kAttentionTiles,
                                                              (p.num_seqs + 1) * sizeof(int32_t), "paged_attention"));
      launch_kernel(tile_offsets_kernel, 1, 32, 0, p.query_start_loc, p.num_seqs, group, laid_out);
      check_launch("paged_attention (prefill tiles)");
      offsets = laid_out;
    }
    dispatch_head_size(p.head_size, [&](auto d) { launch_prefill_attention<T, d(), C>(p, offsets, max_tiles); });
  }
}

// Decodes of large GQA groups (bfloat16 / float16) go to the tensor-core kernel, which reads the
// query rows in 16-byte packs.
template <typename T>
bool use_grouped_decode(const PagedAttentionParams& p) {
  return p.num_heads / p.num_kv_heads >= kMinMmaGroup && packs_fit<T>(p.query, p.head_size, p.query_stride);
}

// The split-KV workspace: the partial output, max and sum of every (token, head, split).
size_t split_workspace_bytes(const PagedAttentionParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(p.num_tokens * p.num_heads * num_splits);
  return rows * (p.head_size + 2) * sizeof(float);
}

// The decode kernels (one block per token and KV head, split over the keys when that fills the
// GPU better), for any batch. C: the cache's element type (T, or fp8e4m3).
template <typename T, typename C>
void run_decodes(const PagedAttentionParams& p) {
  SplitOutputs splits{nullptr, nullptr, choose_splits(p)};
  if (splits.num_splits > 1) {
    auto* workspace = static_cast<float*>(device_workspace(WorkspaceSlot::kAttentionSplits,
                                                           split_workspace_bytes(p, splits.num_splits),
                                                           "paged_attention"));
    splits.acc = workspace;  // [tokens, heads, splits, head_size], then [tokens, heads, splits, 2]
    splits.max_sum = workspace + p.num_tokens * p.num_heads * splits.num_splits * p.head_size;
  }
  dispatch_head_size(p.head_size, [&](auto d) {
    if constexpr (!std::is_same_v<T, float>) {  // the tensor-core kernels take 16-bit queries only
      if (use_grouped_decode<T>(p)) return launch_grouped_decode<T, d(), C>(p, splits);
    }
    launch_paged_attention<T, d(), C>(p, splits);
  });
  if (splits.num_splits > 1) {
    const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_heads));
    launch_kernel(merge_splits_kernel<T>, grid, static_cast<unsigned>(min64(p.head_size, 256)), 0, p, splits);
    check_launch("paged_attention (merge)");
  }
}

// A mixed step's first num_decodes sequences (one query token each) as a batch of their own...
PagedAttentionParams leading_decodes(const PagedAttentionParams& p) {
  PagedAttentionParams d = p;
  d.num_seqs = d.num_tokens = d.num_decodes = p.num_decodes;
  d.tile_offsets = nullptr;
  return d;
}

// ... and the rest. Query and output rows keep their indices (query_start_loc's entries are
// absolute), and so do the plan's tiles (the prefill kernel counts from tile_offsets[0]).
PagedAttentionParams after_leading_decodes(const PagedAttentionParams& p) {
  PagedAttentionParams r = p;
  r.query_start_loc += p.num_decodes;
  r.seq_lens += p.num_decodes;
  r.block_tables += p.num_decodes * p.block_table_stride;
  r.num_seqs -= p.num_decodes;
  r.num_tokens -= p.num_decodes;
  r.num_decodes = 0;
  if (p.tile_offsets != nullptr) r.tile_offsets += p.num_decodes;
  return r;
}

// A batch with prompt chunks goes to the prefill kernel, whose tiles fit long queries; its
// leading decodes, when the caller counted them, go to the decode kernels instead, which split
// a long context over the GPU (in the prefill kernel a decode is one block walking its whole
// context alone). C: the cache's element type (T, or fp8e4m3 for an fp8 cache: every kernel
// reads one, staging its bytes and converting them to T in shared memory).
template <typename T, typename C>
void run_on(const PagedAttentionParams& p) {
  if (!takes_prefill_kernel<T, C>(p)) return run_decodes<T, C>(p);
  if (p.num_decodes == 0) return run_prefill<T, C>(p);
  run_decodes<T, C>(leading_decodes(p));
  run_prefill<T, C>(after_leading_decodes(p));
}

template <typename T>
void run(const PagedAttentionParams& p) {
  if (p.cache_dtype == DType::kFloat8E4M3) return run_on<T, fp8e4m3>(p);
  run_on<T, T>(p);
}

}  // namespace

void reserve_paged_attention_workspaces(const CudaStepLimits& limits) {
  PagedAttentionParams p{};
  p.num_heads = limits.num_heads;
  p.num_kv_heads = limits.num_kv_heads;
  p.head_size = limits.head_size;
  p.block_size = limits.block_size;
  p.max_blocks_per_seq = limits.max_blocks_per_seq;
  size_t largest = 0;
  // Splits only happen while tokens x KV heads are under twice the SM count; past that, none.
  for (int64_t n = 1; n <= limits.max_tokens && n * limits.num_kv_heads < 2 * multiprocessor_count(); ++n) {
    p.num_tokens = n;
    largest = std::max(largest, split_workspace_bytes(p, choose_splits(p)));
  }
  if (largest > 0) device_workspace(WorkspaceSlot::kAttentionSplits, largest, "paged_attention");
  device_workspace(WorkspaceSlot::kAttentionTiles, (limits.max_seqs + 1) * sizeof(int32_t), "paged_attention");
}

void paged_attention(const PagedAttentionParams& p) {
  if (p.num_tokens == 0) return;
  OCTAVO_CHECK(p.head_size == 64 || p.head_size == 128 || p.head_size == 256,
               "paged_attention: head_size " << p.head_size << " has no CUDA kernel (compiled: 64, 128, 256)");
  const int64_t group = p.num_heads / p.num_kv_heads;
  OCTAVO_CHECK(group <= kMaxGroup, "paged_attention: " << group << " query heads per KV head; the CUDA kernel takes "
                                                       << "at most " << kMaxGroup);
  dispatch_float(p.dtype, "paged_attention", [&](auto t) { run<decltype(t)>(p); });
}

}  // namespace octavo::cuda
