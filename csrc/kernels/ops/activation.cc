// silu_and_mul and gelu_and_mul: argument checks, then the CPU or CUDA launcher.
#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

GatedActivationParams gated_params(const TensorView& out, const TensorView& input) {
  const auto [in, o] = ops::float_in_out(out, "out", input);
  OCTAVO_CHECK(in.cols % 2 == 0, "argument 'input' must have an even last dimension (gate and up halves), got "
                                     << in.cols);
  OCTAVO_CHECK(o.rows == in.rows && o.cols * 2 == in.cols,
               "argument 'out' must be [" << in.rows << ", " << in.cols / 2 << "] for 'input' [" << in.rows << ", "
                                          << in.cols << "], got " << o.rows << " rows of " << o.cols);
  GatedActivationParams p{};
  p.out = out.data;
  p.input = input.data;
  p.rows = in.rows;
  p.d = o.cols;
  p.in_stride = in.stride;
  p.out_stride = o.stride;
  p.dtype = input.dtype;
  return p;
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& input) {
  const GatedActivationParams p = gated_params(out, input);
  if (ops::runs_on_cuda(input, "input")) cuda::silu_and_mul(p);
  else cpu_dispatch(silu_and_mul, p);
}

void gelu_and_mul(const TensorView& out, const TensorView& input, GeluApproximation approximate) {
  const GatedActivationParams p = gated_params(out, input);
  if (ops::runs_on_cuda(input, "input")) cuda::gelu_and_mul(p, approximate);
  else cpu_dispatch(gelu_and_mul, p, approximate);
}

}  // namespace octavo
