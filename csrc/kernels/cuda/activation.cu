// silu_and_mul and gelu_and_mul: out = act(gate) * up, gate = input[..., :d], up = input[..., d:].
// A 2-D grid: blockIdx.x is the row, y-blocks cover its d outputs, 16-byte packs where the
// layout allows. The formulas are the CPU kernel's, in float32.
#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {
namespace {

constexpr int kThreads = 256;

struct Silu {
  __device__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};
struct GeluErf {  // 0.5 x (1 + erf(x / sqrt(2)))
  __device__ float operator()(float x) const {
    const float half_x = 0.5f * x;
    return fmaf(half_x, erff(x * 0.70710678118654752f), half_x);
  }
};
struct GeluTanh {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  __device__ float operator()(float x) const {
    const float inner = x * fmaf(0.7978845608028654f * 0.044715f, x * x, 0.7978845608028654f);
    const float half_x = 0.5f * x;
    return fmaf(half_x, tanhf(inner), half_x);
  }
};

template <typename T, bool kPacked, typename Act>
__global__ void gated_kernel(GatedActivationParams p, Act act) {
  constexpr int kStep = kPacked ? Pack<T>::kSize : 1;
  const int64_t row = blockIdx.x;
  const int64_t i = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kStep;
  if (i >= p.d) return;
  const T* gate = static_cast<const T*>(p.input) + row * p.in_stride + i;
  const T* up = gate + p.d;
  T* out = static_cast<T*>(p.out) + row * p.out_stride + i;
  Elements<T, kStep> g = load_elements<kStep>(gate);
  const Elements<T, kStep> u = load_elements<kStep>(up);
#pragma unroll
  for (int j = 0; j < kStep; ++j) g.v[j] = from_float<T>(act(to_float(g.v[j])) * to_float(u.v[j]));
  store_elements(out, g);
}

template <typename T, typename Act>
void launch(const GatedActivationParams& p, Act act, const char* name) {
  // The up half starts d elements after the gate half: d itself must be a whole number of packs.
  const bool packed = packs_fit<T>(p.input, p.d, p.in_stride) && packs_fit<T>(p.out, p.d, p.out_stride);
  const int64_t per_thread = packed ? Pack<T>::kSize : 1;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(ceil_div(ceil_div(p.d, per_thread), kThreads)));
  if (packed) launch_kernel(gated_kernel<T, true, Act>, grid, kThreads, 0, p, act);
  else launch_kernel(gated_kernel<T, false, Act>, grid, kThreads, 0, p, act);
  check_launch(name);
}

template <typename Act>
void run(const GatedActivationParams& p, Act act, const char* name) {
  if (p.rows == 0 || p.d == 0) return;
  dispatch_float(p.dtype, name, [&](auto t) { launch<decltype(t)>(p, act, name); });
}

}  // namespace

void silu_and_mul(const GatedActivationParams& p) { run(p, Silu{}, "silu_and_mul"); }

void gelu_and_mul(const GatedActivationParams& p, GeluApproximation approximate) {
  if (approximate == GeluApproximation::kTanh) run(p, GeluTanh{}, "gelu_and_mul");
  else run(p, GeluErf{}, "gelu_and_mul");
}

}  // namespace octavo::cuda
