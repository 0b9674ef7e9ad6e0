// rms_norm and fused_add_rms_norm: argument checks, then the CPU or CUDA launcher.
#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

RmsNormParams norm_params(const TensorView& out, const char* out_arg, const TensorView& input,
                          const TensorView& weight, double eps, bool weight_offset) {
  const auto [in, o] = ops::float_in_out(out, out_arg, input);
  ops::check_same_device(weight, "weight", input, "input");
  ops::check_same_dtype(weight, "weight", input, "input");
  OCTAVO_CHECK(o.rows == in.rows && o.cols == in.cols,
               "argument '" << out_arg << "' must have the shape of 'input' (" << in.rows << " rows of " << in.cols
                            << "), got " << o.rows << " rows of " << o.cols);
  check_ndim(weight, "weight", 1);
  check_size(weight, "weight", 0, in.cols);
  check_contiguous(weight, "weight");
  OCTAVO_CHECK(eps >= 0, "eps must be >= 0, got " << eps);
  RmsNormParams p{};
  p.out = out.data;
  p.input = input.data;
  p.weight = weight.data;
  p.rows = in.rows;
  p.hidden = in.cols;
  p.in_stride = in.stride;
  p.out_stride = o.stride;
  p.dtype = input.dtype;
  p.eps = static_cast<float>(eps);
  p.weight_offset = weight_offset;
  return p;
}

// An input [tokens, heads, head_size] whose heads are adjacent but whose tokens are further apart
// than heads * head_size (q or k inside a fused QKV output, normalized per head) is read as rows in
// groups of `heads`: returns it as if its tokens were adjacent, for the usual checks, and sets the
// groups in p. Any other input is returned as it is.
TensorView head_groups(const TensorView& input, RmsNormParams& p) {
  if (input.ndim != 3 || input.shape[0] <= 1 || input.shape[1] <= 1 || input.shape[2] <= 1 ||
      input.strides[0] == input.shape[1] * input.strides[1])
    return input;
  OCTAVO_CHECK(input.strides[1] >= input.shape[2] &&
                   input.strides[0] >= (input.shape[1] - 1) * input.strides[1] + input.shape[2],
               "argument 'input' has overlapping rows (strides " << input.strides[0] << ", " << input.strides[1]
                                                                  << ")");
  TensorView flat = input;
  flat.strides[0] = input.shape[1] * input.strides[1];
  p.in_group_rows = input.shape[1];
  p.in_group_stride = input.strides[0];
  return flat;
}

void run(const RmsNormParams& p, const TensorView& input) {
  if (ops::runs_on_cuda(input, "input")) cuda::rms_norm(p);
  else cpu_dispatch(rms_norm, p);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& input, const TensorView& weight, double eps,
              bool weight_offset) {
  RmsNormParams groups{};
  const TensorView rows = head_groups(input, groups);
  RmsNormParams p = norm_params(out, "out", rows, weight, eps, weight_offset);
  p.in_group_rows = groups.in_group_rows;
  p.in_group_stride = groups.in_group_stride;
  run(p, input);
}

void fused_add_rms_norm(const TensorView& input, const TensorView& residual, const TensorView& weight, double eps,
                        bool weight_offset) {
  RmsNormParams p = norm_params(input, "input", input, weight, eps, weight_offset);
  ops::check_same_device(residual, "residual", input, "input");
  ops::check_same_dtype(residual, "residual", input, "input");
  const ops::Rows r = ops::last_dim_rows(residual, "residual");
  OCTAVO_CHECK(r.rows == p.rows && r.cols == p.hidden, "argument 'residual' must have the shape of 'input' ("
                                                           << p.rows << " rows of " << p.hidden << "), got " << r.rows
                                                           << " rows of " << r.cols);
  p.residual = residual.data;
  p.residual_stride = r.stride;
  run(p, input);
}

}  // namespace octavo
