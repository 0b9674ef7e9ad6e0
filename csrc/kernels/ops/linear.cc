// linear and dequantize: argument checks, then the CPU launchers.
#include <cstring>

#include "cpu/isa_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {

namespace {

constexpr int64_t kBlockWeights = 32;  // weights per GGUF block, in every format here

// Checks a weight of `n` rows standing for `k` inputs each in `format`; returns n.
int64_t check_weight(const TensorView& weight, WeightFormat format, const TensorView& input, int64_t k) {
  ops::check_cpu(weight, "weight");
  check_ndim(weight, "weight", 2);
  check_contiguous(weight, "weight");
  if (format == WeightFormat::kDense) {
    ops::check_same_dtype(weight, "weight", input, "input");
    check_size(weight, "weight", 1, k);
    return weight.shape[0];
  }
  OCTAVO_CHECK(weight.dtype == DType::kUInt8, "argument 'weight' in format " << weight_format_name(format)
                                                  << " must be uint8 blocks, got " << dtype_name(weight.dtype));
  OCTAVO_CHECK(k % kBlockWeights == 0, "weight format " << weight_format_name(format) << " needs in_features "
                                           << "divisible by 32, got " << k);
  check_size(weight, "weight", 1, k / kBlockWeights * weight_block_bytes(format));
  return weight.shape[0];
}

}  // namespace

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kDense: return "dense";
    case WeightFormat::kQ8_0: return "q8_0";
    case WeightFormat::kQ4_0: return "q4_0";
    case WeightFormat::kQ4_1: return "q4_1";
  }
  return "?";
}

WeightFormat parse_weight_format(const char* name) {
  for (WeightFormat f : {WeightFormat::kDense, WeightFormat::kQ8_0, WeightFormat::kQ4_0, WeightFormat::kQ4_1})
    if (std::strcmp(name, weight_format_name(f)) == 0) return f;
  OCTAVO_CHECK(false, "unknown weight format '" << name << "' (expected dense, q8_0, q4_0 or q4_1)");
  return WeightFormat::kDense;
}

int64_t weight_block_bytes(WeightFormat format) {
  switch (format) {
    case WeightFormat::kQ8_0: return 2 + 32;      // float16 scale, 32 int8
    case WeightFormat::kQ4_0: return 2 + 16;      // float16 scale, 32 nibbles
    case WeightFormat::kQ4_1: return 2 + 2 + 16;  // float16 scale and minimum, 32 nibbles
    default: return 0;
  }
}

void linear(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
            WeightFormat format) {
  ops::check_cpu(out, "out");
  ops::check_cpu(input, "input");
  ops::check_float(input, "input");
  ops::check_same_dtype(out, "out", input, "input");
  const ops::Rows in = ops::last_dim_rows(input, "input");
  const ops::Rows o = ops::last_dim_rows(out, "out");
  const int64_t n = check_weight(weight, format, input, in.cols);
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
  p.weight_format = format;
  cpu_dispatch(linear, p);
}

void dequantize(const TensorView& out, const TensorView& weight, WeightFormat format) {
  OCTAVO_CHECK(format != WeightFormat::kDense, "dequantize needs a quantized weight format, got dense");
  ops::check_cpu(out, "out");
  check_ndim(out, "out", 2);
  check_contiguous(out, "out");
  OCTAVO_CHECK(out.dtype == DType::kFloat32, "argument 'out' must be float32, got " << dtype_name(out.dtype));
  const int64_t n = check_weight(weight, format, out, out.shape[1]);
  check_size(out, "out", 0, n);
  DequantizeParams p{static_cast<float*>(out.data), static_cast<const uint8_t*>(weight.data), n, out.shape[1],
                     format};
  cpu_dispatch(dequantize, p);
}

}  // namespace octavo
