// linear and dequantize: argument checks, then the CPU or CUDA launcher.
#include <cstring>
#include <tuple>

#include "bf16_tiles.h"
#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {

namespace ops {

// llama.cpp's block formats (the ones int8_inputs applies to).
bool is_gguf_format(WeightFormat format) {
  switch (format) {
    case WeightFormat::kQ8_0:
    case WeightFormat::kQ4_0:
    case WeightFormat::kQ4_1:
    case WeightFormat::kQ5_0:
    case WeightFormat::kQ5_1:
    case WeightFormat::kIQ4_NL:
    case WeightFormat::kQ3_K:
    case WeightFormat::kQ4_K:
    case WeightFormat::kQ5_K:
    case WeightFormat::kQ6_K: return true;
    default: return false;
  }
}

int64_t check_weight(const TensorView& weight, WeightFormat format, const WeightQuant& quant, const TensorView& ref,
                     const char* ref_arg, int64_t k, LinearParams& p) {
  ops::check_same_device(weight, "weight", ref, ref_arg);
  check_ndim(weight, "weight", 2);
  check_contiguous(weight, "weight");
  p.weight = weight.data;
  p.weight_format = format;
  p.int8_inputs = quant.int8_inputs;
  p.tensor_cores = quant.tensor_cores;
  OCTAVO_CHECK(!quant.int8_inputs || is_gguf_format(format),
               "int8_inputs needs a GGUF block format, got " << weight_format_name(format));
  const int64_t n = weight.shape[0];
  if (format == WeightFormat::kDense) {
    ops::check_same_dtype(weight, "weight", ref, ref_arg);
    check_size(weight, "weight", 1, k);
    return n;
  }
  const bool int8 = format == WeightFormat::kInt8 || format == WeightFormat::kInt8A8;
  const bool grouped = format == WeightFormat::kInt4 || format == WeightFormat::kInt4A8 || format == WeightFormat::kFp8;
  const DType stored = int8 ? DType::kInt8 : format == WeightFormat::kFp8 ? DType::kFloat8E4M3 : DType::kUInt8;
  OCTAVO_CHECK(weight.dtype == stored, "argument 'weight' in format " << weight_format_name(format) << " must be "
                                           << dtype_name(stored) << ", got " << dtype_name(weight.dtype));
  const int64_t block_weights = weight_block_weights(format);
  OCTAVO_CHECK(k % block_weights == 0, "weight format " << weight_format_name(format) << " needs in_features "
                                           << "divisible by " << block_weights << ", got " << k);
  check_size(weight, "weight", 1, k / block_weights * weight_block_bytes(format));
  OCTAVO_CHECK(format != WeightFormat::kBf16Tiles || n % bf16_tiles::kPanelRows == 0,
               "weight format bf16_tiles needs out_features divisible by 32, got " << n);
  if (int8) {
    OCTAVO_CHECK(quant.scales != nullptr, "weight format " << weight_format_name(format) << " needs scales");
    ops::check_vector(*quant.scales, "scales", DType::kFloat32, n, ref, ref_arg);
    p.scales = static_cast<const float*>(quant.scales->data);
    // int8_a8's products are exact int32 sums of |q| <= 128 times |a| <= 127 (cpu/linear_int8_a8.h).
    OCTAVO_CHECK(format != WeightFormat::kInt8A8 || k <= (int64_t{1} << 17),
                 "weight format int8_a8 takes at most 131072 inputs, got " << k);
  } else if (grouped) {
    const int64_t g = quant.group_size;
    const char* name = weight_format_name(format);
    const bool zeros = format != WeightFormat::kFp8;
    OCTAVO_CHECK(g > 0 && g % block_weights == 0 && k % g == 0,
                 "weight format " << name << " needs a group_size that is a multiple of 32 and divides " << k
                                  << ", got " << g);
    OCTAVO_CHECK(quant.scales != nullptr && (quant.zeros != nullptr || !zeros),
                 "weight format " << name << " needs scales" << (zeros ? " and zeros" : ""));
    // The kernel finds a block's group by multiplying (cpu/linear.cc, GroupScales): exact below this.
    const int64_t blocks_per_group = g / block_weights;
    OCTAVO_CHECK(k / block_weights < (int64_t{1} << 32) / (blocks_per_group * blocks_per_group),
                 "weight format " << name << ": " << k << " inputs in groups of " << g
                                  << " is more than the kernel indexes");
    for (const auto& [t, name, dtype] : {std::tuple{quant.scales, "scales", DType::kFloat32},
                                         std::tuple{quant.zeros, "zeros", DType::kUInt8}}) {
      if (t == quant.zeros && !zeros) continue;
      ops::check_same_device(*t, name, ref, ref_arg);
      OCTAVO_CHECK(t->dtype == dtype, "argument '" << name << "' must be " << dtype_name(dtype) << ", got "
                                                    << dtype_name(t->dtype));
      check_ndim(*t, name, 2);
      check_contiguous(*t, name);
      check_size(*t, name, 0, n);
      check_size(*t, name, 1, k / g);
    }
    p.scales = static_cast<const float*>(quant.scales->data);
    p.zeros = zeros ? static_cast<const uint8_t*>(quant.zeros->data) : nullptr;
    p.group_size = g;
  }
  return n;
}

}  // namespace ops

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kDense: return "dense";
    case WeightFormat::kQ8_0: return "q8_0";
    case WeightFormat::kQ4_0: return "q4_0";
    case WeightFormat::kQ4_1: return "q4_1";
    case WeightFormat::kInt8: return "int8";
    case WeightFormat::kInt4: return "int4";
    case WeightFormat::kBf16Tiles: return "bf16_tiles";
    case WeightFormat::kInt4A8: return "int4_a8";
    case WeightFormat::kInt8A8: return "int8_a8";
    case WeightFormat::kQ5_0: return "q5_0";
    case WeightFormat::kQ5_1: return "q5_1";
    case WeightFormat::kIQ4_NL: return "iq4_nl";
    case WeightFormat::kQ3_K: return "q3_k";
    case WeightFormat::kQ4_K: return "q4_k";
    case WeightFormat::kQ5_K: return "q5_k";
    case WeightFormat::kQ6_K: return "q6_k";
    case WeightFormat::kFp8: return "fp8";
  }
  return "?";
}

WeightFormat parse_weight_format(const char* name) {
  for (int i = 0; i <= static_cast<int>(WeightFormat::kFp8); ++i)
    if (std::strcmp(name, weight_format_name(static_cast<WeightFormat>(i))) == 0) return static_cast<WeightFormat>(i);
  OCTAVO_CHECK(false, "unknown weight format '" << name << "' (expected dense, q8_0, q4_0, q4_1, q5_0, q5_1, "
                                                << "iq4_nl, q3_k, q4_k, q5_k, q6_k, int8, int4, int4_a8, int8_a8, "
                                                << "fp8 or bf16_tiles)");
  return WeightFormat::kDense;
}

int64_t weight_block_weights(WeightFormat format) {
  switch (format) {
    case WeightFormat::kQ3_K:
    case WeightFormat::kQ4_K:
    case WeightFormat::kQ5_K:
    case WeightFormat::kQ6_K: return 256;
    default: return 32;
  }
}

int64_t weight_block_bytes(WeightFormat format) {
  switch (format) {
    case WeightFormat::kQ8_0: return 2 + 32;      // float16 scale, 32 int8
    case WeightFormat::kQ4_0: return 2 + 16;      // float16 scale, 32 nibbles
    case WeightFormat::kQ4_1: return 2 + 2 + 16;  // float16 scale and minimum, 32 nibbles
    case WeightFormat::kInt8:
    case WeightFormat::kInt8A8:
    case WeightFormat::kFp8: return 32;           // scales kept apart
    case WeightFormat::kInt4:
    case WeightFormat::kInt4A8: return 16;        // scales and zero points kept apart
    case WeightFormat::kBf16Tiles: return 64;     // 32 bfloat16, reordered
    case WeightFormat::kQ5_0: return 2 + 4 + 16;  // float16 scale, 32 fifth bits, 32 nibbles
    case WeightFormat::kQ5_1: return 2 + 2 + 4 + 16;
    case WeightFormat::kIQ4_NL: return 2 + 16;    // float16 scale, 32 indices into a table of 16
    // Super-blocks of 256 weights in 8 (Q3_K, Q6_K: 16) parts with their own scales.
    case WeightFormat::kQ3_K: return 32 + 64 + 12 + 2;      // high bits, 2-bit quants, 6-bit scales, d
    case WeightFormat::kQ4_K: return 2 + 2 + 12 + 128;      // d, dmin, 6-bit scales and minimums, nibbles
    case WeightFormat::kQ5_K: return 2 + 2 + 12 + 32 + 128; // as Q4_K, plus the fifth bits
    case WeightFormat::kQ6_K: return 128 + 64 + 16 + 2;     // low nibbles, high 2 bits, int8 scales, d
    default: return 0;
  }
}

void linear(const TensorView& out, const TensorView& input, const TensorView& weight, const TensorView* bias,
            WeightFormat format, const WeightQuant& quant) {
  const auto [in, o] = ops::float_in_out(out, "out", input);
  LinearParams p{};
  const int64_t n = ops::check_weight(weight, format, quant, input, "input", in.cols, p);
  OCTAVO_CHECK(o.rows == in.rows && o.cols == n, "argument 'out' must be [" << in.rows << ", " << n << "], got "
                                                                             << o.rows << " rows of " << o.cols);
  if (bias != nullptr) {
    ops::check_vector(*bias, "bias", input.dtype, n, input, "input");
    p.bias = bias->data;
  }
  p.out = out.data;
  p.input = input.data;
  p.rows = in.rows;
  p.in_features = in.cols;
  p.out_features = n;
  p.in_stride = in.stride;
  p.out_stride = o.stride;
  p.dtype = input.dtype;
  const bool cuda = ops::runs_on_cuda(input, "input");
  OCTAVO_CHECK(!cuda || format != WeightFormat::kBf16Tiles, "weight format bf16_tiles is for the CPU only");
  OCTAVO_CHECK(!cuda || format != WeightFormat::kInt4A8,
               "weight format int4_a8 (int8 inputs) is for the CPU only; CUDA multiplies int4");
  OCTAVO_CHECK(!cuda || !quant.int8_inputs, "int8_inputs (int8 activations) is for the CPU only");
  OCTAVO_CHECK(!cuda || format != WeightFormat::kInt8A8,
               "weight format int8_a8 (int8 inputs) is for the CPU only; CUDA multiplies int8");
  OCTAVO_CHECK(cuda || !quant.tensor_cores, "tensor_cores (linear on tensor cores) is for CUDA only");
  if (cuda) cuda::linear(p);
  else cpu_dispatch(linear, p);
}

void dequantize(const TensorView& out, const TensorView& weight, WeightFormat format, const WeightQuant& quant) {
  OCTAVO_CHECK(format != WeightFormat::kDense, "dequantize needs a quantized weight format, got dense");
  check_ndim(out, "out", 2);
  check_contiguous(out, "out");
  OCTAVO_CHECK(out.dtype == DType::kFloat32 || out.dtype == DType::kBFloat16 || out.dtype == DType::kFloat16,
               "argument 'out' must be float32, bfloat16 or float16, got " << dtype_name(out.dtype));
  LinearParams p{};
  const int64_t n = ops::check_weight(weight, format, quant, out, "out", out.shape[1], p);
  check_size(out, "out", 0, n);
  p.out = out.data;
  p.out_features = n;
  p.in_features = out.shape[1];
  p.dtype = out.dtype;
  const bool cuda = ops::runs_on_cuda(out, "out");
  OCTAVO_CHECK(!cuda || format != WeightFormat::kBf16Tiles, "weight format bf16_tiles is for the CPU only");
  if (cuda) cuda::dequantize(p);
  else cpu_dispatch(dequantize, p);
}

void pack_bf16_tiles(const TensorView& out, const TensorView& weight) {
  check_ndim(weight, "weight", 2);
  check_contiguous(weight, "weight");
  OCTAVO_CHECK(weight.dtype == DType::kBFloat16, "argument 'weight' must be bfloat16, got " << dtype_name(weight.dtype));
  OCTAVO_CHECK(!ops::runs_on_cuda(weight, "weight"), "pack_bf16_tiles runs on the CPU only");
  const int64_t n = weight.shape[0], k = weight.shape[1];
  OCTAVO_CHECK(n % bf16_tiles::kPanelRows == 0 && k % bf16_tiles::kTileK == 0,
               "pack_bf16_tiles needs a weight whose both sides are multiples of 32, got [" << n << ", " << k << "]");
  ops::check_same_device(out, "out", weight, "weight");
  OCTAVO_CHECK(out.dtype == DType::kUInt8, "argument 'out' must be uint8, got " << dtype_name(out.dtype));
  check_ndim(out, "out", 2);
  check_contiguous(out, "out");
  check_size(out, "out", 0, n);
  check_size(out, "out", 1, k * 2);
  // A load-time copy, a few dwords per cache line: row pairs move as one 32-bit word.
  const auto* src = static_cast<const uint32_t*>(weight.data);
  auto* dst = static_cast<uint32_t*>(out.data);
  for (int64_t row = 0; row < n; ++row)
    for (int64_t pair = 0; pair < k / 2; ++pair) dst[bf16_tiles::element_index(row, 2 * pair, k) / 2] = src[row * k / 2 + pair];
}

}  // namespace octavo
