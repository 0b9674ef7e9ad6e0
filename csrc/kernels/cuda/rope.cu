// rotary_embedding: one block per token; its threads take runs of N rotated pairs of all query
// and key heads. Where the layout allows, a run is one 16-byte pack of each of its two halves
// (N = 8 in 16 bits, 4 in float32), so every access to the heads is 16 bytes wide; else N = 1.
// A position outside the cos/sin cache leaves the token as it is (see cuda_kernels.h).
#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {
namespace {

constexpr int64_t kMaxThreads = 512;

// N consecutive floats of the cos/sin cache, in 16-byte packs where N is a multiple of 4 (the
// cache row and i are then 16-byte aligned, see packed()).
template <int N>
__device__ __forceinline__ void load_angles(const float* p, float (&out)[N]) {
  constexpr int kStep = N % Pack<float>::kSize == 0 ? Pack<float>::kSize : 1;
#pragma unroll
  for (int j = 0; j < N; j += kStep) {
    const Elements<float, kStep> e = load_elements<kStep>(p + j);
#pragma unroll
    for (int m = 0; m < kStep; ++m) out[j + m] = e.v[m];
  }
}

// Rotates the run of N pairs starting at pair i of the head at x. NeoX / Llama pairs (i, i + half)
// read as x[i, i + N) and x[half + i, ...); GPT-J pairs (2i, 2i + 1) read as the 2N elements
// x[2i, 2i + 2N), in two halves of N. Pair j of the run turns by angle i + j either way.
template <typename T, int N, bool kNeox>
__device__ __forceinline__ void rotate_run(T* x, int64_t i, int64_t half, const float* cos, const float* sin) {
  T* lo_at = kNeox ? x + i : x + 2 * i;
  T* hi_at = kNeox ? x + half + i : x + 2 * i + N;
  Elements<T, N> lo = load_elements<N>(lo_at), hi = load_elements<N>(hi_at);
  float c[N], s[N];
  load_angles<N>(cos + i, c);
  load_angles<N>(sin + i, s);
  // Element e of the run as (lo | hi) concatenated, for GPT-J's pairs; e is a constant once the
  // loop is unrolled, so the run stays in registers.
  auto at = [&](int e) -> T& { return e < N ? lo.v[e] : hi.v[e - N]; };
#pragma unroll
  for (int j = 0; j < N; ++j) {
    T& ta = kNeox ? lo.v[j] : at(2 * j);
    T& tb = kNeox ? hi.v[j] : at(2 * j + 1);
    const float a = to_float(ta), b = to_float(tb);
    ta = from_float<T>(a * c[j] - b * s[j]);
    tb = from_float<T>(b * c[j] + a * s[j]);
  }
  store_elements(lo_at, lo);
  store_elements(hi_at, hi);
}

template <typename T, int N, bool kNeox>
__global__ void rotary_kernel(RotaryParams p) {
  const int64_t token = blockIdx.x;
  const int64_t pos = p.positions_dtype == DType::kInt32 ? static_cast<const int32_t*>(p.positions)[token]
                                                        : static_cast<const int64_t*>(p.positions)[token];
  if (pos < 0 || pos >= p.max_position) return;
  const int64_t half = p.rot_dim / 2, runs = half / N;
  const float* cos = p.cos_sin_cache + pos * p.rot_dim;
  const float* sin = cos + half;
  const int64_t heads = p.num_heads + (p.key ? p.num_kv_heads : 0);
  for (int64_t k = threadIdx.x; k < heads * runs; k += blockDim.x) {
    const int64_t h = k / runs, i = k % runs * N;
    T* x = h < p.num_heads ? static_cast<T*>(p.query) + token * p.query_stride + h * p.head_size
                           : static_cast<T*>(p.key) + token * p.key_stride + (h - p.num_heads) * p.head_size;
    rotate_run<T, N, kNeox>(x, i, half, cos, sin);
  }
}

// Whether every run can be a 16-byte pack: heads start 16-byte aligned, half is a whole number of
// packs (so are the GPT-J runs' 2N elements), and the cache rows and halves are float4-aligned.
template <typename T>
bool packed(const RotaryParams& p) {
  constexpr int64_t n = Pack<T>::kSize;
  const int64_t half = p.rot_dim / 2;
  const bool key_fits = !p.key || packs_fit<T>(p.key, p.head_size, p.key_stride);
  return packs_fit<T>(p.query, p.head_size, p.query_stride) && key_fits && half % n == 0 &&
         reinterpret_cast<uintptr_t>(p.cos_sin_cache) % 16 == 0;
}

}  // namespace

void rotary_embedding(const RotaryParams& p) {
  if (p.num_tokens == 0) return;
  dispatch_float(p.dtype, "rotary_embedding", [&](auto t) {
    using T = decltype(t);
    constexpr int kPack = Pack<T>::kSize;
    const bool vector = packed<T>(p);
    const int64_t runs = (p.num_heads + (p.key ? p.num_kv_heads : 0)) * (p.rot_dim / 2 / (vector ? kPack : 1));
    const int threads = static_cast<int>(std::min(kMaxThreads, ceil_div(runs, 32) * 32));
    const auto kernel = vector ? (p.is_neox ? rotary_kernel<T, kPack, true> : rotary_kernel<T, kPack, false>)
                               : (p.is_neox ? rotary_kernel<T, 1, true> : rotary_kernel<T, 1, false>);
    launch_kernel(kernel, p.num_tokens, threads, 0, p);
  });
  check_launch("rotary_embedding");
}

}  // namespace octavo::cuda
