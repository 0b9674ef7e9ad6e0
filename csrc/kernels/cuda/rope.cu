// rotary_embedding: one block per token; its threads take the rotated pairs of all query and key
// heads. A position outside the cos/sin cache leaves the token as it is (see cuda_kernels.h).
#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {
namespace {

constexpr int64_t kMaxThreads = 512;

template <typename T>
__global__ void rotary_kernel(RotaryParams p) {
  const int64_t token = blockIdx.x;
  const int64_t pos = p.positions_dtype == DType::kInt32 ? static_cast<const int32_t*>(p.positions)[token]
                                                        : static_cast<const int64_t*>(p.positions)[token];
  if (pos < 0 || pos >= p.max_position) return;
  const int64_t half = p.rot_dim / 2;
  const float* cos = p.cos_sin_cache + pos * p.rot_dim;
  const float* sin = cos + half;
  const int64_t heads = p.num_heads + (p.key ? p.num_kv_heads : 0);
  for (int64_t k = threadIdx.x; k < heads * half; k += blockDim.x) {
    const int64_t h = k / half, i = k % half;
    T* x = h < p.num_heads ? static_cast<T*>(p.query) + token * p.query_stride + h * p.head_size
                           : static_cast<T*>(p.key) + token * p.key_stride + (h - p.num_heads) * p.head_size;
    // NeoX / Llama pairs (i, i + rot_dim/2); GPT-J pairs (2i, 2i + 1). Both rotate by angle i.
    const int64_t ia = p.is_neox ? i : 2 * i, ib = p.is_neox ? i + half : 2 * i + 1;
    const float a = to_float(x[ia]), b = to_float(x[ib]), c = cos[i], s = sin[i];
    x[ia] = from_float<T>(a * c - b * s);
    x[ib] = from_float<T>(b * c + a * s);
  }
}

}  // namespace

void rotary_embedding(const RotaryParams& p) {
  if (p.num_tokens == 0) return;
  const int64_t pairs = (p.num_heads + (p.key ? p.num_kv_heads : 0)) * (p.rot_dim / 2);
  const int threads = static_cast<int>(std::min(kMaxThreads, ceil_div(pairs, 32) * 32));
  dispatch_float(p.dtype, "rotary_embedding", [&](auto t) {
    launch_kernel(rotary_kernel<decltype(t)>, p.num_tokens, threads, 0, p);
  });
  check_launch("rotary_embedding");
}

}  // namespace octavo::cuda
