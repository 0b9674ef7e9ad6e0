// linear: argument checks, then the CPU launcher.
#include "cpu/isa_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {

void linear(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias) {
  ops::check_cpu(out, "out");
  ops::check_cpu(input, "input");
  ops::check_cpu(weight, "weight");
  ops::check_float(input, "input");
  ops::check_same_dtype(out, "out", input, "input");
  ops::check_same_dtype(weight, "weight", input, "input");
  const ops::Rows in = ops::last_dim_rows(input, "input");
  const ops::Rows o = ops::last_dim_rows(out, "out");
  check_ndim(weight, "weight", 2);
  check_contiguous(weight, "weight");
  const int64_t n = weight.shape[0];
  check_size(weight, "weight", 1, in.cols);
  OCTAVO_CHECK(o.rows == in.rows && o.cols == n, "argument 'out' must be [" << in.rows << ", " << n << "], got "
                                                                             << o.rows << " rows of " << o.cols);
  LinearParams p{};
  if (bias != nullptr) {
    ops::check_cpu(*bias, "bias");
    ops::check_vector(*bias, "bias", input.dtype, n);
    p.bias = bias->data;
  }
  p.out = out.data;
  p.input = input.data;
  p.weight = weight.data;
  p.rows = in.rows;
  p.in_features = in.cols;
  p.out_features = n;
  p.in_stride = in.stride;
  p.out_stride = o.stride;
  p.dtype = input.dtype;
  cpu_dispatch(linear, p);
}

}  // namespace octavo
