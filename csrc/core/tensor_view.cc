#include "octavo/tensor_view.h"

#include "octavo/status.h"

namespace octavo {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

const char* device_name(DeviceType type) { return type == DeviceType::kCUDA ? "cuda" : "cpu"; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // numpy gives empty arrays stride 0; there is nothing to lay out
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

void check_dtype(const TensorView& t, const char* arg, DType expected) {
  OCTAVO_CHECK_TYPE(t.dtype == expected, "argument '" << arg << "' must have dtype " << dtype_name(expected)
                                                      << ", got " << dtype_name(t.dtype));
}

void check_ndim(const TensorView& t, const char* arg, int expected) {
  OCTAVO_CHECK(t.ndim == expected,
               "argument '" << arg << "' must have " << expected << " dimension(s), got " << t.ndim);
}

void check_size(const TensorView& t, const char* arg, int dim, int64_t expected) {
  OCTAVO_CHECK(dim < t.ndim && t.shape[dim] == expected, "argument '" << arg << "' must have size " << expected
                                                                      << " in dimension " << dim << ", got "
                                                                      << (dim < t.ndim ? t.shape[dim] : -1));
}

void check_device(const TensorView& t, const char* arg, DeviceType expected) {
  OCTAVO_CHECK(t.device.type == expected, "argument '" << arg << "' must be on " << device_name(expected)
                                                       << ", got a tensor on " << device_name(t.device.type));
}

void check_contiguous(const TensorView& t, const char* arg) {
  OCTAVO_CHECK(t.is_contiguous(), "argument '" << arg << "' must be contiguous (row-major without gaps); "
                                                  "call .contiguous() first");
}

}  // namespace octavo
