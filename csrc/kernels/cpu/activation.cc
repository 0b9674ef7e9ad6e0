// silu_and_mul and gelu_and_mul: out = act(gate) * up with gate = input[..., :d] and
// up = input[..., d:], in float32, one pass. Work is cut into blocks of columns of each row, so
// a single long row (a decode step's MLP) still spreads over the thread pool.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

constexpr int64_t kColBlock = 4096;  // columns per work item (a multiple of every kW)
// Jobs below kSerialElems outputs run on the calling thread: waking the pool would cost about as
// much as it saves. Larger ones are cut into chunks of at least kMinChunkElems outputs.
constexpr int64_t kSerialElems = 32768;
constexpr int64_t kMinChunkElems = 8192;

// x * sigmoid(x)
struct Silu {
  VecF operator()(VecF x) const { return x / (VecF::set1(1.0f) + exp(VecF::zero() - x)); }
};

// 0.5 x (1 + erf(x / sqrt(2)))
struct GeluErf {
  VecF operator()(VecF x) const {
    const VecF half_x = VecF::set1(0.5f) * x;
    return fma(half_x, erf(x * VecF::set1(0.70710678118654752f)), half_x);
  }
};

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
struct GeluTanh {
  VecF operator()(VecF x) const {
    const VecF x2 = x * x;
    const VecF inner = x * fma(VecF::set1(0.7978845608028654f * 0.044715f), x2, VecF::set1(0.7978845608028654f));
    const VecF half_x = VecF::set1(0.5f) * x;
    return fma(half_x, tanh(inner), half_x);
  }
};

// out[i] = act(gate[i]) * up[i] for i in [0, n).
template <typename T, typename Act>
void gated_block(T* out, const T* gate, const T* up, int64_t n, Act act) {
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {  // two vectors in flight: exp and divide have long latency
    const VecF g0 = VecF::load(gate + i), g1 = VecF::load(gate + i + kW);
    (act(g0) * VecF::load(up + i)).store(out + i);
    (act(g1) * VecF::load(up + i + kW)).store(out + i + kW);
  }
  for (; i + kW <= n; i += kW) (act(VecF::load(gate + i)) * VecF::load(up + i)).store(out + i);
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_partial(act(load_partial(gate + i, m)) * load_partial(up + i, m), out + i, m);
  }
}

template <typename T, typename Act>
void run_gated(const GatedActivationParams& p, Act act) {
  const int64_t blocks = (p.d + kColBlock - 1) / kColBlock;  // per row
  const int64_t block_elems = p.d < kColBlock ? p.d : kColBlock;
  const int64_t items = p.rows * blocks;
  const int64_t grain = p.rows * p.d < kSerialElems ? items : (kMinChunkElems + block_elems - 1) / block_elems;
  parallel_for(items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks, c = (item % blocks) * kColBlock;
      const int64_t n = p.d - c < kColBlock ? p.d - c : kColBlock;
      const T* in = static_cast<const T*>(p.input) + r * p.in_stride + c;
      gated_block(static_cast<T*>(p.out) + r * p.out_stride + c, in, in + p.d, n, act);
    }
  });
}

template <typename Act>
void dispatch_gated(const GatedActivationParams& p, Act act, const char* name) {
  if (p.rows == 0 || p.d == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return run_gated<float>(p, act);
    case DType::kBFloat16: return run_gated<bf16>(p, act);
    case DType::kFloat16: return run_gated<f16>(p, act);
    default: OCTAVO_CHECK(false, name << ": unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace

void silu_and_mul(const GatedActivationParams& p) { dispatch_gated(p, Silu{}, "silu_and_mul"); }

void gelu_and_mul(const GatedActivationParams& p, GeluApproximation approximate) {
  if (approximate == GeluApproximation::kTanh) dispatch_gated(p, GeluTanh{}, "gelu_and_mul");
  else dispatch_gated(p, GeluErf{}, "gelu_and_mul");
}

}  // namespace octavo::cpu::OCTAVO_ISA
