// The kernel template behind launch_paged_attention (attention.cuh); included only by the
// per-head-size files that instantiate it.
#pragma once

#include <cfloat>

#include "attention.cuh"

namespace octavo::cuda {
namespace attention_detail {

// The sequence owning query token t: the last b with query_start_loc[b] <= t.
__device__ inline int seq_of_token(const int32_t* query_start_loc, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <typename T, int kD>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_kernel(PagedAttentionParams p,
                                                                             SplitOutputs splits) {
  extern __shared__ float shared[];
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  float* q_s = shared;                       // [group][kD], scaled
  float* acc_s = q_s + group * kD;           // [group][kD]
  float* score_s = acc_s + group * kD;       // [group][kTile]
  float* max_s = score_s + group * kTile;    // [group]
  float* sum_s = max_s + group;              // [group]
  float* alpha_s = sum_s + group;            // [group]
  int* block_s = reinterpret_cast<int*>(alpha_s + group);  // [kTile] cache block of each tile key, -1 masked

  const int token = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int seq = seq_of_token(p.query_start_loc, static_cast<int>(p.num_seqs), token);
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t n_query = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  const int64_t pos = seq_len - n_query + (token - p.query_start_loc[seq]);  // this query's position
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  const int64_t lo = p.sliding_window > 0 ? max64(0, pos - p.sliding_window + 1) : 0;
  const int64_t hi = min64(pos + 1, capacity);  // keys [lo, hi)
  // Splits take whole tiles, so that only the last tile of the range is partial.
  const int64_t span = hi > lo ? hi - lo : 0;
  const int64_t per_split = ceil_div(ceil_div(span, splits.num_splits), kTile) * kTile;
  const int64_t k_begin = lo + split * per_split, k_end = min64(hi, k_begin + per_split);

  const T* query = static_cast<const T*>(p.query) + token * p.query_stride + kv_head * group * kD;
  for (int i = threadIdx.x; i < group * kD; i += blockDim.x) {
    q_s[i] = to_float(query[i]) * p.scale;
    acc_s[i] = 0.0f;
  }
  if (threadIdx.x < group) {
    max_s[threadIdx.x] = -FLT_MAX;
    sum_s[threadIdx.x] = 0.0f;
  }
  const int32_t* table = p.block_tables + seq * p.block_table_stride;
  const int64_t head_stride = p.block_size * kD;             // between KV heads of one block
  const int64_t block_stride = p.num_kv_heads * head_stride;  // between blocks
  const T* key_cache = static_cast<const T*>(p.key_cache) + kv_head * head_stride;
  const T* value_cache = static_cast<const T*>(p.value_cache) + kv_head * head_stride;
  __syncthreads();

  for (int64_t tile = k_begin; tile < k_end; tile += kTile) {
    const int count = static_cast<int>(min64(kTile, k_end - tile));
    // Scores: thread j takes key tile + j for every head of the group.
    const int j = threadIdx.x;
    if (j < count) {
      const int64_t key_pos = tile + j;
      const int block = table[key_pos / p.block_size];
      const bool valid = block >= 0 && block < p.num_blocks;
      block_s[j] = valid ? block : -1;
      float dots[kMaxGroup];
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) dots[g] = 0.0f;
      if (valid) {
        const T* k = key_cache + block * block_stride + (key_pos % p.block_size) * kD;
        for (int d = 0; d < kD; d += Pack<T>::kSize) {
          const Pack<T> kp = load_pack(k + d);
#pragma unroll
          for (int e = 0; e < Pack<T>::kSize; ++e) {
            const float kv = to_float(kp.v[e]);
#pragma unroll
            for (int g = 0; g < kMaxGroup; ++g)
              if (g < group) dots[g] += q_s[g * kD + d + e] * kv;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= group) break;
        float s = dots[g];
        if (p.softcap > 0) s = p.softcap * tanhf(s / p.softcap);
        score_s[g * kTile + j] = valid ? s : -INFINITY;
      }
    }
    __syncthreads();
    // Online softmax: warp w takes heads w, w + 4, ...; scores become probabilities in place.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int g = warp; g < group; g += kAttentionThreads / 32) {
      float m = -INFINITY;
      for (int i = lane; i < count; i += 32) m = fmaxf(m, score_s[g * kTile + i]);
      for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float m_new = fmaxf(max_s[g], m);
      float sum = 0.0f;
      for (int i = lane; i < count; i += 32) {
        const float e = __expf(score_s[g * kTile + i] - m_new);  // 0 for masked keys
        score_s[g * kTile + i] = e;
        sum += e;
      }
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) {
        const float alpha = __expf(max_s[g] - m_new);
        alpha_s[g] = alpha;
        sum_s[g] = sum_s[g] * alpha + sum;
        max_s[g] = m_new;
      }
    }
    __syncthreads();
    // acc[g][d] = acc[g][d] * alpha[g] + sum_j p[g][j] v_j[d]; consecutive threads read
    // consecutive d of a value row.
    for (int i = threadIdx.x; i < group * kD; i += blockDim.x) {
      const int g = i / kD, d = i % kD;
      float a = acc_s[i] * alpha_s[g];
      for (int jj = 0; jj < count; ++jj) {
        const int block = block_s[jj];
        if (block < 0) continue;
        const int64_t key_pos = tile + jj;
        a += score_s[g * kTile + jj] *
             to_float(value_cache[block * block_stride + (key_pos % p.block_size) * kD + d]);
      }
      acc_s[i] = a;
    }
    __syncthreads();
  }

  const int64_t head0 = static_cast<int64_t>(kv_head) * group;
  if (splits.num_splits == 1) {
    T* out = static_cast<T*>(p.out) + token * p.out_stride + head0 * kD;
    for (int i = threadIdx.x; i < group * kD; i += blockDim.x) {
      const float sum = sum_s[i / kD];
      out[i] = from_float<T>(sum > 0 ? acc_s[i] / sum : 0.0f);
    }
    return;
  }
  for (int i = threadIdx.x; i < group * kD; i += blockDim.x) {
    const int64_t row = (token * p.num_heads + head0 + i / kD) * splits.num_splits + split;
    splits.acc[row * kD + i % kD] = acc_s[i];
  }
  if (threadIdx.x < group) {
    const int64_t row = (token * p.num_heads + head0 + threadIdx.x) * splits.num_splits + split;
    splits.max_sum[2 * row] = max_s[threadIdx.x];
    splits.max_sum[2 * row + 1] = sum_s[threadIdx.x];
  }
}

}  // namespace attention_detail

template <typename T, int kD>
void launch_paged_attention(const PagedAttentionParams& p, const SplitOutputs& splits) {
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const size_t shared = attention_shared_bytes(group, kD);
  auto kernel = attention_detail::paged_attention_kernel<T, kD>;
  if (shared > 48 * 1024) {
    OCTAVO_CHECK_KIND(ErrorKind::kRuntime,
                      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared)) == cudaSuccess,
                      "paged_attention: " << shared << " bytes of shared memory are not available");
  }
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(splits.num_splits));
  kernel<<<grid, kAttentionThreads, shared, current_stream()>>>(p, splits);
  check_launch("paged_attention");
}

#define OCTAVO_INSTANTIATE_PAGED_ATTENTION(D)                                                          \
  template void launch_paged_attention<float, D>(const PagedAttentionParams&, const SplitOutputs&); \
  template void launch_paged_attention<bf16, D>(const PagedAttentionParams&, const SplitOutputs&);  \
  template void launch_paged_attention<f16, D>(const PagedAttentionParams&, const SplitOutputs&);

}  // namespace octavo::cuda
