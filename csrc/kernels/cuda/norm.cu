// rms_norm and fused_add_rms_norm: one block per row. The row is read once for the sum of
// squares (and, fused, residual += input is written back rounded, since vLLM normalizes the
// residual as stored), then read again, mostly from L1/L2, to scale it. float32 accumulation;
// the same formulas as the CPU kernel: scale = 1 / sqrt(mean(x^2) + eps), out = (x * scale) * w.
#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {
namespace {

constexpr int kMaxThreads = 1024;

// kPacked: every row pointer, the weight and the hidden size allow 16-byte packs.
template <typename T, bool kPacked>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(RmsNormParams p) {
  __shared__ float scratch[32];
  constexpr int kStep = kPacked ? Pack<T>::kSize : 1;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.input) + input_row(p, row);
  T* out = static_cast<T*>(p.out) + row * p.out_stride;
  T* res = p.residual ? static_cast<T*>(p.residual) + row * p.residual_stride : nullptr;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x * kStep; i < p.hidden; i += blockDim.x * kStep) {
    Elements<T, kStep> v = load_elements<kStep>(x + i);
    if (res) {
      const Elements<T, kStep> r = load_elements<kStep>(res + i);
#pragma unroll
      for (int j = 0; j < kStep; ++j) v.v[j] = from_float<T>(to_float(v.v[j]) + to_float(r.v[j]));
      store_elements(res + i, v);
    }
#pragma unroll
    for (int j = 0; j < kStep; ++j) ss += to_float(v.v[j]) * to_float(v.v[j]);
  }
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(p.hidden) + p.eps);
  const T* src = res ? res : x;  // the normalized row is the updated residual
  const T* weight = static_cast<const T*>(p.weight);
  const float offset = p.weight_offset ? 1.0f : 0.0f;  // Gemma stores weight - 1
  for (int64_t i = threadIdx.x * kStep; i < p.hidden; i += blockDim.x * kStep) {
    Elements<T, kStep> v = load_elements<kStep>(src + i);
    const Elements<T, kStep> w = load_elements<kStep>(weight + i);
#pragma unroll
    for (int j = 0; j < kStep; ++j) v.v[j] = from_float<T>(to_float(v.v[j]) * scale * (to_float(w.v[j]) + offset));
    store_elements(out + i, v);
  }
}

template <typename T>
void launch(const RmsNormParams& p) {
  const bool packed = packs_fit<T>(p.input, p.hidden, p.in_stride) &&
                      packs_fit<T>(p.input, p.hidden, p.in_group_stride) &&
                      packs_fit<T>(p.out, p.hidden, p.out_stride) &&
                      packs_fit<T>(p.weight, p.hidden, 0) &&
                      (!p.residual || packs_fit<T>(p.residual, p.hidden, p.residual_stride));
  const int64_t per_thread = packed ? Pack<T>::kSize : 1;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, ceil_div(p.hidden / per_thread, 32) * 32));
  if (packed) launch_kernel(rms_norm_kernel<T, true>, p.rows, threads, 0, p);
  else launch_kernel(rms_norm_kernel<T, false>, p.rows, threads, 0, p);
  check_launch("rms_norm");
}

}  // namespace

void rms_norm(const RmsNormParams& p) {
  if (p.rows == 0 || p.hidden == 0) return;
  dispatch_float(p.dtype, "rms_norm", [&](auto t) { launch<decltype(t)>(p); });
}

}  // namespace octavo::cuda
