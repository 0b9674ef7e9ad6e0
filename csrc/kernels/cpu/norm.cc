// rms_norm and fused_add_rms_norm: one row at a time, two passes over the row (sum of squares,
// then scale), float32 accumulation; rows are spread over the thread pool.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// Below this many elements a call stays on the calling thread; above, chunks of at least
// kMinChunkElems (see grain_for).
constexpr int64_t kSerialElems = 65536;
constexpr int64_t kMinChunkElems = 16384;

// sum(x[i]^2) in float32. Four accumulators hide the FMA latency.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  VecF a0 = VecF::zero(), a1 = VecF::zero(), a2 = VecF::zero(), a3 = VecF::zero();
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    const VecF v0 = VecF::load(x + i), v1 = VecF::load(x + i + kW);
    const VecF v2 = VecF::load(x + i + 2 * kW), v3 = VecF::load(x + i + 3 * kW);
    a0 = fma(v0, v0, a0);
    a1 = fma(v1, v1, a1);
    a2 = fma(v2, v2, a2);
    a3 = fma(v3, v3, a3);
  }
  for (; i + kW <= n; i += kW) {
    const VecF v = VecF::load(x + i);
    a0 = fma(v, v, a0);
  }
  if (i < n) {
    const VecF v = load_partial(x + i, static_cast<int>(n - i));
    a1 = fma(v, v, a1);
  }
  return reduce_add((a0 + a1) + (a2 + a3));
}

// residual = residual + input, rounded to T; returns the sum of squares of the rounded sums
// (vLLM normalizes the residual as stored, not its float32 value).
template <typename T>
float add_residual(const T* input, T* residual, int64_t n) {
  VecF a0 = VecF::zero(), a1 = VecF::zero();
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    (VecF::load(input + i) + VecF::load(residual + i)).store(residual + i);
    (VecF::load(input + i + kW) + VecF::load(residual + i + kW)).store(residual + i + kW);
    const VecF r0 = VecF::load(residual + i), r1 = VecF::load(residual + i + kW);  // rounded
    a0 = fma(r0, r0, a0);
    a1 = fma(r1, r1, a1);
  }
  for (; i + kW <= n; i += kW) {
    (VecF::load(input + i) + VecF::load(residual + i)).store(residual + i);
    const VecF r = VecF::load(residual + i);
    a0 = fma(r, r, a0);
  }
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial(load_partial(input + i, m) + load_partial(residual + i, m), residual + i, m);
    const VecF r = load_partial(residual + i, m);
    a1 = fma(r, r, a1);
  }
  return reduce_add(a0 + a1);
}

// out = x * scale * w, with w already in float32 (and offset by 1 for Gemma).
template <typename T>
void scale_row(T* out, const T* x, const float* w, float scale, int64_t n) {
  const VecF s = VecF::set1(scale);
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    (VecF::load(x + i) * s * VecF::load(w + i)).store(out + i);
    (VecF::load(x + i + kW) * s * VecF::load(w + i + kW)).store(out + i + kW);
  }
  for (; i + kW <= n; i += kW) (VecF::load(x + i) * s * VecF::load(w + i)).store(out + i);
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial(load_partial(x + i, m) * s * load_partial(w + i, m), out + i, m);
  }
}

// weight (+ 1) as float32 in per-thread scratch, converted once per chunk of rows.
template <typename T>
const float* float_weight(const T* weight, int64_t n, bool offset) {
  float* w = static_cast<float*>(thread_scratch(0, static_cast<size_t>(n) * sizeof(float)));
  const VecF add = VecF::set1(offset ? 1.0f : 0.0f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) (VecF::load(weight + i) + add).store(w + i);
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial(load_partial(weight + i, m) + add, w + i, m);
  }
  return w;
}

template <typename T>
void rms_norm_rows(const RmsNormParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.hidden;
  const float* w = float_weight(static_cast<const T*>(p.weight), n, p.weight_offset);
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(p.input) + input_row(p, r);
    T* out = static_cast<T*>(p.out) + r * p.out_stride;
    float ss;
    if (p.residual) {
      T* res = static_cast<T*>(p.residual) + r * p.residual_stride;
      ss = add_residual(x, res, n);
      x = res;  // the normalized row is the updated residual
    } else {
      ss = sum_squares(x, n);
    }
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + p.eps);
    scale_row(out, x, w, scale, n);
  }
}

template <typename T>
void run_rms_norm(const RmsNormParams& p) {
  parallel_for(p.rows, grain_for(p.rows, p.hidden, kSerialElems, kMinChunkElems),
               [&](int64_t begin, int64_t end) { rms_norm_rows<T>(p, begin, end); });
}

}  // namespace

void rms_norm(const RmsNormParams& p) {
  if (p.rows == 0 || p.hidden == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return run_rms_norm<float>(p);
    case DType::kBFloat16: return run_rms_norm<bf16>(p);
    case DType::kFloat16: return run_rms_norm<f16>(p);
    default: OCTAVO_CHECK(false, "rms_norm: unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
