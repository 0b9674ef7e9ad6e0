// reshape_and_cache: one block per token copies its keys and values into their slot of the
// paged cache [num_blocks, num_kv_heads, block_size, head_size], in 16-byte packs where the
// layout allows. A slot of -1, or one outside the cache, is skipped (see cuda_kernels.h). An fp8
// cache (float8_e4m3fn) takes each value divided by its scale and rounded (fp8_e4m3.h), as the
// CPU kernel writes it.
#include "common.cuh"
#include "cuda_kernels.h"
#include "fp8_e4m3.h"

namespace octavo::cuda {
namespace {

constexpr int64_t kMaxThreads = 512;

// Block `token`'s cache slot, or -1 when it writes nothing.
__device__ __forceinline__ int64_t token_slot(const CacheWriteParams& p, int64_t token) {
  const int64_t slot = p.slot_dtype == DType::kInt32 ? static_cast<const int32_t*>(p.slot_mapping)[token]
                                                    : static_cast<const int64_t*>(p.slot_mapping)[token];
  return slot < p.num_blocks * p.block_size ? slot : -1;
}

template <typename T, bool kPacked>
__global__ void cache_write_kernel(CacheWriteParams p) {
  constexpr int kStep = kPacked ? Pack<T>::kSize : 1;
  const int64_t token = blockIdx.x;
  const int64_t slot = token_slot(p, token);
  if (slot < 0) return;
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int64_t row = p.num_kv_heads * p.head_size;
  const T* key = static_cast<const T*>(p.key) + token * p.key_stride;
  const T* value = static_cast<const T*>(p.value) + token * p.value_stride;
  for (int64_t e = threadIdx.x * kStep; e < row; e += blockDim.x * kStep) {
    const int64_t h = e / p.head_size, d = e % p.head_size;
    const int64_t at = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size + d;
    if constexpr (kPacked) {
      store_pack(static_cast<T*>(p.key_cache) + at, load_pack(key + e));
      store_pack(static_cast<T*>(p.value_cache) + at, load_pack(value + e));
    } else {
      static_cast<T*>(p.key_cache)[at] = key[e];
      static_cast<T*>(p.value_cache)[at] = value[e];
    }
  }
}

// 16 values of src (16-byte aligned) divided by scale and rounded to E4M3: one 16-byte store.
template <typename T>
__device__ __forceinline__ Pack<uint8_t> fp8_pack(const T* src, float scale) {
  Pack<uint8_t> out;
#pragma unroll
  for (int i = 0; i < 16; i += Pack<T>::kSize) {
    const Pack<T> in = load_pack(src + i);
#pragma unroll
    for (int e = 0; e < Pack<T>::kSize; ++e) out.v[i + e] = fp8_e4m3_from_float(to_float(in.v[e]) / scale);
  }
  return out;
}

// The same into an fp8 cache: with kPacked, 16 values a thread and step (16-byte loads, one
// 16-byte store), else one.
template <typename T, bool kPacked>
__global__ void cache_write_fp8_kernel(CacheWriteParams p) {
  constexpr int kStep = kPacked ? 16 : 1;
  const int64_t token = blockIdx.x;
  const int64_t slot = token_slot(p, token);
  if (slot < 0) return;
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const T* key = static_cast<const T*>(p.key) + token * p.key_stride;
  const T* value = static_cast<const T*>(p.value) + token * p.value_stride;
  for (int64_t e = threadIdx.x * kStep; e < p.num_kv_heads * p.head_size; e += blockDim.x * kStep) {
    const int64_t h = e / p.head_size, d = e % p.head_size;
    const int64_t at = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_size + d;
    auto* key_cache = static_cast<uint8_t*>(p.key_cache);
    auto* value_cache = static_cast<uint8_t*>(p.value_cache);
    if constexpr (kPacked) {
      store_pack(key_cache + at, fp8_pack(key + e, p.k_scale));
      store_pack(value_cache + at, fp8_pack(value + e, p.v_scale));
    } else {
      key_cache[at] = fp8_e4m3_from_float(to_float(key[e]) / p.k_scale);
      value_cache[at] = fp8_e4m3_from_float(to_float(value[e]) / p.v_scale);
    }
  }
}

template <typename T>
void launch(const CacheWriteParams& p) {
  if (p.cache_dtype == DType::kFloat8E4M3) {
    // 16 values a thread where each head's row is whole packs of the input and of the cache
    const bool packed = p.head_size % 16 == 0 && packs_fit<T>(p.key, p.head_size, p.key_stride) &&
                        packs_fit<T>(p.value, p.head_size, p.value_stride) &&
                        packs_fit<uint8_t>(p.key_cache, p.head_size, 0) &&
                        packs_fit<uint8_t>(p.value_cache, p.head_size, 0);
    const int64_t per_thread = packed ? 16 : 1;
    const int64_t steps = p.num_kv_heads * p.head_size / per_thread;
    const int threads = static_cast<int>(std::min(kMaxThreads, ceil_div(steps, 32) * 32));
    if (packed) launch_kernel(cache_write_fp8_kernel<T, true>, p.num_tokens, threads, 0, p);
    else launch_kernel(cache_write_fp8_kernel<T, false>, p.num_tokens, threads, 0, p);
    check_launch("reshape_and_cache");
    return;
  }
  // A pack must not straddle two heads, whose cache rows are apart: head_size whole packs.
  const bool packed = packs_fit<T>(p.key, p.head_size, p.key_stride) &&
                      packs_fit<T>(p.value, p.head_size, p.value_stride) &&
                      packs_fit<T>(p.key_cache, p.head_size, 0) && packs_fit<T>(p.value_cache, p.head_size, 0);
  const int64_t per_thread = packed ? Pack<T>::kSize : 1;
  const int64_t packs = p.num_kv_heads * p.head_size / per_thread;
  const int threads = static_cast<int>(std::min(kMaxThreads, ceil_div(packs, 32) * 32));
  if (packed) launch_kernel(cache_write_kernel<T, true>, p.num_tokens, threads, 0, p);
  else launch_kernel(cache_write_kernel<T, false>, p.num_tokens, threads, 0, p);
  check_launch("reshape_and_cache");
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p) {
  if (p.num_tokens == 0) return;
  dispatch_float(p.dtype, "reshape_and_cache", [&](auto t) { launch<decltype(t)>(p); });
}

}  // namespace octavo::cuda
