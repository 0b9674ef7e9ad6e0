// The kernel template behind launch_prefill_attention (prefill_attention.cuh); included only by
// the per-head-size files that instantiate it.
#pragma once

#include <mma.h>

#include <atomic>
#include <cfloat>

#include "prefill_attention.cuh"

namespace octavo::cuda {
namespace prefill_detail {

namespace wmma = nvcuda::wmma;

using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// acc += A·B for A [16, k] row-major at `a` (leading dimension lda) and B [k, 16] at `b` in
// layout BLayout (leading dimension ldb); B's next 16 rows of k start b_step elements further.
template <typename T, typename BLayout>
__device__ void mma_accumulate(Accumulator& acc, const T* a, int lda, const T* b, int b_step, int ldb, int k) {
  for (int k0 = 0; k0 < k; k0 += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> b_frag;
    wmma::load_matrix_sync(a_frag, a + k0, lda);
    wmma::load_matrix_sync(b_frag, b + (k0 / 16) * b_step, ldb);
    wmma::mma_sync(acc, a_frag, b_frag, acc);
  }
}

// Row strides in shared memory, padded against bank conflicts; every 16-row tile start stays
// 32-byte aligned, as wmma's loads and stores need.
template <int kD>
struct Layout {
  static constexpr int kKeys = prefill_keys(kD);
  static constexpr int kLdQ = kD + 8;     // Q, K, V rows (16-bit elements)
  static constexpr int kLdS = kKeys + 4;  // scores (float)
  static constexpr int kLdP = kKeys + 8;  // probabilities (16-bit)
  static constexpr int kLdO = kD + 4;     // output accumulator (float)
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(uint16_t) * kPrefillRows * kLdQ;
  static constexpr size_t kV = kK + sizeof(uint16_t) * kKeys * kLdQ;
  static constexpr size_t kS = kV + sizeof(uint16_t) * kKeys * kLdQ;
  static constexpr size_t kP = kS + sizeof(float) * kPrefillRows * kLdS;
  static constexpr size_t kO = kP + sizeof(uint16_t) * kPrefillRows * kLdP;
  static constexpr size_t kStats = kO + sizeof(float) * kPrefillRows * kLdO;  // max, sum per row
  static constexpr size_t kBytes = kStats + sizeof(float) * 2 * kPrefillRows;
};

// Writes keys [k0, k0 + kKeys) of sequence `table`'s KV head into shared rows; keys past
// `k_end` or in a block outside the cache become zeros (their scores are masked; zeros keep a
// masked NaN out of P·V).
template <typename T, int kD>
__device__ void load_kv_tile(const PagedAttentionParams& p, const int32_t* table, int kv_head, int64_t k0,
                             int64_t k_end, T* k_s, T* v_s) {
  using L = Layout<kD>;
  constexpr int kPacks = kD / Pack<T>::kSize;
  const int64_t head_stride = p.block_size * kD, block_stride = p.num_kv_heads * head_stride;
  for (int i = threadIdx.x; i < L::kKeys * kPacks; i += kPrefillThreads) {
    const int j = i / kPacks, d = (i % kPacks) * Pack<T>::kSize;
    const int64_t key = k0 + j;
    Pack<T> kp = zero_pack<T>(), vp = zero_pack<T>();
    if (key < k_end) {
      const int block = table[key / p.block_size];
      if (block >= 0 && block < p.num_blocks) {
        const int64_t at = block * block_stride + kv_head * head_stride + (key % p.block_size) * kD + d;
        kp = load_pack(static_cast<const T*>(p.key_cache) + at);
        vp = load_pack(static_cast<const T*>(p.value_cache) + at);
      }
    }
    store_pack(k_s + j * L::kLdQ + d, kp);
    store_pack(v_s + j * L::kLdQ + d, vp);
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kPrefillThreads) prefill_kernel(PagedAttentionParams p, const int32_t* tile_offsets) {
  using L = Layout<kD>;
  constexpr int kKeys = L::kKeys;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);
  T* k_s = reinterpret_cast<T*>(smem + L::kK);
  T* v_s = reinterpret_cast<T*>(smem + L::kV);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  T* p_s = reinterpret_cast<T*>(smem + L::kP);
  float* o_s = reinterpret_cast<float*>(smem + L::kO);
  float* max_s = reinterpret_cast<float*>(smem + L::kStats);
  float* sum_s = max_s + kPrefillRows;

  // Which sequence and query tokens this block takes.
  const int64_t num_seqs = p.num_seqs;
  const int tile = blockIdx.x, kv_head = blockIdx.y;
  if (tile >= tile_offsets[num_seqs]) return;
  const int seq = last_at_most(tile_offsets, static_cast<int>(num_seqs), tile);
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int tokens_per_tile = kPrefillRows / group;
  const int64_t first_token = p.query_start_loc[seq];
  const int64_t n_query = p.query_start_loc[seq + 1] - first_token;
  const int64_t q_begin = static_cast<int64_t>(tile - tile_offsets[seq]) * tokens_per_tile;
  const int64_t q_count = min64(tokens_per_tile, n_query - q_begin);
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t pos0 = seq_len - n_query + q_begin;  // position of the tile's first token
  const int64_t capacity = p.max_blocks_per_seq * p.block_size;
  const int32_t* table = p.block_tables + seq * p.block_table_stride;

  // Row r is token q_begin + r / group, query head kv_head * group + r % group.
  constexpr int kPacks = kD / Pack<T>::kSize;
  for (int i = threadIdx.x; i < kPrefillRows * kPacks; i += kPrefillThreads) {
    const int r = i / kPacks, d = (i % kPacks) * Pack<T>::kSize;
    Pack<T> qp = zero_pack<T>();
    if (r / group < q_count) {
      const int64_t token = first_token + q_begin + r / group;
      qp = load_pack(static_cast<const T*>(p.query) + token * p.query_stride + (kv_head * group + r % group) * kD + d);
    }
    store_pack(q_s + r * L::kLdQ + d, qp);
  }
  for (int i = threadIdx.x; i < kPrefillRows * L::kLdO; i += kPrefillThreads) o_s[i] = 0.0f;
  if (threadIdx.x < kPrefillRows) {
    max_s[threadIdx.x] = -FLT_MAX;
    sum_s[threadIdx.x] = 0.0f;
  }
  __syncthreads();  // rows are initialized by one thread and read by two others, even with no key

  // Keys [k_begin, k_end): what the tile's first and last tokens can see between them.
  const int64_t last_pos = pos0 + q_count - 1;
  const int64_t k_end = min64(last_pos + 1, capacity);
  const int64_t k_begin = p.sliding_window > 0 ? max64(0, pos0 - p.sliding_window + 1) / kKeys * kKeys : 0;
  const int warp = threadIdx.x / 32;
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;  // softmax: two threads per row, in the row's warp
  const bool row_valid = row / group < q_count;
  const int64_t row_pos = pos0 + row / group;

  for (int64_t k0 = k_begin; k0 < k_end; k0 += kKeys) {
    __syncthreads();  // the previous tile's K / V are no longer read (and, first time, Q is stored)
    load_kv_tile<T, kD>(p, table, kv_head, k0, k_end, k_s, v_s);
    __syncthreads();

    // S = Q·Kᵀ for this warp's 16 rows (Kᵀ: the K rows read column-major).
    for (int n0 = 0; n0 < kKeys; n0 += 16) {
      Accumulator acc;
      wmma::fill_fragment(acc, 0.0f);
      mma_accumulate<T, wmma::col_major>(acc, q_s + warp * 16 * L::kLdQ, L::kLdQ, k_s + n0 * L::kLdQ, 16, L::kLdQ, kD);
      wmma::store_matrix_sync(s_s + warp * 16 * L::kLdS + n0, acc, L::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of the row's scores; P in 16 bits, the accumulator rescaled.
    float m = -INFINITY;
    float* s_row = s_s + row * L::kLdS;
    for (int c = half * kKeys / 2; c < (half + 1) * kKeys / 2; ++c) {
      const int64_t key = k0 + c;
      float s = s_row[c] * p.scale;
      if (p.softcap > 0) s = p.softcap * tanhf(s / p.softcap);
      const bool visible = row_valid && key <= row_pos && key < k_end &&
                           (p.sliding_window == 0 || key > row_pos - p.sliding_window);
      s_row[c] = visible ? s : -INFINITY;
      m = fmaxf(m, s_row[c]);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const float m_old = max_s[row];
    const float m_new = fmaxf(m_old, m);
    float sum = 0.0f;
    for (int c = half * kKeys / 2; c < (half + 1) * kKeys / 2; ++c) {
      const float e = __expf(s_row[c] - m_new);  // 0 for masked keys
      p_s[row * L::kLdP + c] = from_float<T>(e);
      sum += e;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = __expf(m_old - m_new);
    for (int d = half * kD / 2; d < (half + 1) * kD / 2; ++d) o_s[row * L::kLdO + d] *= alpha;
    __syncwarp();
    if (half == 0) {
      max_s[row] = m_new;
      sum_s[row] = sum_s[row] * alpha + sum;
    }

    // O += P·V for this warp's 16 rows.
    for (int d0 = 0; d0 < kD; d0 += 16) {
      Accumulator acc;
      float* o_tile = o_s + warp * 16 * L::kLdO + d0;
      wmma::load_matrix_sync(acc, o_tile, L::kLdO, wmma::mem_row_major);
      mma_accumulate<T, wmma::row_major>(acc, p_s + warp * 16 * L::kLdP, L::kLdP, v_s + d0, 16 * L::kLdQ, L::kLdQ,
                                         kKeys);
      wmma::store_matrix_sync(o_tile, acc, L::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  // out = O / sum for the valid rows; a row that saw no key (none in range) gets zeros.
  if (row_valid) {
    const int64_t token = first_token + q_begin + row / group;
    T* out = static_cast<T*>(p.out) + token * p.out_stride + (kv_head * group + row % group) * kD;
    const float sum = sum_s[row];
    for (int d = half * kD / 2; d < (half + 1) * kD / 2; ++d)
      out[d] = from_float<T>(sum > 0 ? o_s[row * L::kLdO + d] / sum : 0.0f);
  }
}

}  // namespace prefill_detail

template <typename T, int kD>
void launch_prefill_attention(const PagedAttentionParams& p, const int32_t* tile_offsets, int64_t max_tiles) {
  using L = prefill_detail::Layout<kD>;
  auto kernel = prefill_detail::prefill_kernel<T, kD>;
  static std::atomic<bool> opted_in[kMaxDevices] = {};  // the shared-memory limit is per device and kernel
  const int device = current_device();
  if (!opted_in[device].load()) {
    OCTAVO_CHECK_KIND(ErrorKind::kRuntime,
                      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(L::kBytes)) == cudaSuccess,
                      "paged_attention: the prefill kernel's " << L::kBytes
                                                               << " bytes of shared memory are not available");
    opted_in[device].store(true);
  }
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, kPrefillThreads, L::kBytes, current_stream()>>>(p, tile_offsets);
  check_launch("paged_attention (prefill)");
}

#define OCTAVO_INSTANTIATE_PREFILL_ATTENTION(D)                                                         \
  template void launch_prefill_attention<bf16, D>(const PagedAttentionParams&, const int32_t*, int64_t); \
  template void launch_prefill_attention<f16, D>(const PagedAttentionParams&, const int32_t*, int64_t);

}  // namespace octavo::cuda
