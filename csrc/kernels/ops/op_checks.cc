#include "op_checks.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "cuda/cuda_kernels.h"
#include "octavo/cuda_info.h"
#include "octavo/status.h"

namespace octavo::ops {

Rows as_rows(const TensorView& t, const char* arg) {
  OCTAVO_CHECK(t.ndim >= 1, "argument '" << arg << "' must have at least 1 dimension, got a scalar");
  Rows r{t.ndim == 1 ? 1 : t.shape[0], 1, 0};
  const int first = t.ndim == 1 ? 0 : 1;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= first; --i) {
    OCTAVO_CHECK(t.shape[i] == 1 || t.strides[i] == expected,
                 "argument '" << arg << "' must be contiguous in every dimension but the first "
                              << "(dimension " << i << " has stride " << t.strides[i] << ", expected " << expected
                              << "); call .contiguous() first");
    expected *= t.shape[i];
  }
  r.cols = expected;
  r.stride = t.ndim == 1 ? expected : t.strides[0];
  OCTAVO_CHECK(r.rows <= 1 || r.stride >= r.cols,
               "argument '" << arg << "' has overlapping rows (row stride " << r.stride << " < row length " << r.cols
                            << ")");
  return r;
}

Rows last_dim_rows(const TensorView& t, const char* arg) {
  OCTAVO_CHECK(t.ndim >= 1, "argument '" << arg << "' must have at least 1 dimension, got a scalar");
  const int last = t.ndim - 1;
  Rows r{1, t.shape[last], t.shape[last]};
  OCTAVO_CHECK(r.cols <= 1 || t.strides[last] == 1,
               "argument '" << arg << "' must be contiguous in its last dimension; call .contiguous() first");
  // Walk the leading dimensions from the innermost out; each must step over the one inside it.
  bool have_stride = false;
  int64_t inner_stride = 0, inner_size = 1;
  for (int i = last - 1; i >= 0; --i) {
    r.rows *= t.shape[i];
    if (t.shape[i] == 1) continue;
    if (!have_stride) {
      r.stride = t.strides[i];
      have_stride = true;
    } else {
      OCTAVO_CHECK(t.strides[i] == inner_stride * inner_size,
                   "argument '" << arg << "' has leading dimensions that do not flatten into rows (dimension " << i
                                << " has stride " << t.strides[i] << "); call .contiguous() first");
    }
    inner_stride = t.strides[i];
    inner_size = t.shape[i];
  }
  OCTAVO_CHECK(r.rows <= 1 || r.stride >= r.cols,
               "argument '" << arg << "' has overlapping rows (row stride " << r.stride << " < row length " << r.cols
                            << ")");
  return r;
}

void check_float(const TensorView& t, const char* arg) {
  OCTAVO_CHECK_TYPE(t.dtype == DType::kFloat32 || t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16,
                    "argument '" << arg << "' must be float32, bfloat16 or float16, got " << dtype_name(t.dtype));
}

void check_same_dtype(const TensorView& t, const char* arg, const TensorView& ref, const char* ref_arg) {
  OCTAVO_CHECK_TYPE(t.dtype == ref.dtype, "argument '" << arg << "' must have the dtype of '" << ref_arg << "' ("
                                                       << dtype_name(ref.dtype) << "), got " << dtype_name(t.dtype));
}

void check_index_dtype(const TensorView& t, const char* arg) {
  OCTAVO_CHECK_TYPE(t.dtype == DType::kInt32 || t.dtype == DType::kInt64,
                    "argument '" << arg << "' must be int32 or int64, got " << dtype_name(t.dtype));
}

void check_cpu(const TensorView& t, const char* arg) {
  OCTAVO_CHECK(t.device.type == DeviceType::kCPU,
               "argument '" << arg << "' is a " << device_name(t.device.type)
                            << " tensor; it must be in CPU memory (the host reads it)");
}

void check_same_device(const TensorView& t, const char* arg, const TensorView& ref, const char* ref_arg) {
  OCTAVO_CHECK(t.device.type == ref.device.type && t.device.index == ref.device.index,
               "argument '" << arg << "' is on " << device_name(t.device.type) << ":" << t.device.index << " but '"
                            << ref_arg << "' is on " << device_name(ref.device.type) << ":" << ref.device.index);
}

InOutRows float_in_out(const TensorView& out, const char* out_arg, const TensorView& input) {
  check_same_device(out, out_arg, input, "input");
  check_float(input, "input");
  check_same_dtype(out, out_arg, input, "input");
  return {last_dim_rows(input, "input"), last_dim_rows(out, out_arg)};
}

bool runs_on_cuda(const TensorView& t, const char* arg) {
  if (!is_cuda(t)) return false;
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cuda_compiled(),
                    "argument '" << arg << "' is a CUDA tensor, but this build of Octavo has no CUDA kernels (it was "
                                    "configured without nvcc); rebuild with the CUDA toolkit, or move the tensors to "
                                    "the CPU");
  const int current = cuda::current_device();
  OCTAVO_CHECK(t.device.index == current, "argument '" << arg << "' is on cuda:" << t.device.index
                                                       << " but this thread's current CUDA device is " << current
                                                       << "; call torch.cuda.set_device(" << t.device.index
                                                       << ") first");
  return true;
}

void check_vector(const TensorView& t, const char* arg, DType dtype, int64_t size) {
  check_cpu(t, arg);
  check_vector(t, arg, dtype, size, t, arg);
}

void check_vector(const TensorView& t, const char* arg, DType dtype, int64_t size, const TensorView& ref,
                  const char* ref_arg) {
  check_same_device(t, arg, ref, ref_arg);
  check_dtype(t, arg, dtype);
  check_ndim(t, arg, 1);
  if (size >= 0) check_size(t, arg, 0, size);
  check_contiguous(t, arg);
}

void check_kv_cache(const TensorView& cache, const char* arg, const TensorView& ref, const char* ref_arg) {
  check_same_device(cache, arg, ref, ref_arg);
  // The CUDA kernels move cache rows in 16-byte packs.
  OCTAVO_CHECK(!is_cuda(cache) || reinterpret_cast<uintptr_t>(cache.data) % 16 == 0,
               "argument '" << arg << "' must start on a 16-byte boundary on CUDA (a view with an odd offset?)");
  // The CPU kernels convert between the query's dtype and a cache of any float dtype (an engine's
  // kv_cache_dtype); the CUDA ones read caches of the query's dtype. Both read fp8 caches.
  const bool fp8 = cache.dtype == DType::kFloat8E4M3;
  if (is_cuda(cache) && !fp8) {
    OCTAVO_CHECK_TYPE(cache.dtype == ref.dtype, "argument '" << arg << "' must have the dtype of '" << ref_arg
                                                             << "' (" << dtype_name(ref.dtype)
                                                             << ") or be float8_e4m3fn on CUDA, got "
                                                             << dtype_name(cache.dtype));
  } else if (!fp8) {
    check_float(cache, arg);
  }
  OCTAVO_CHECK(cache.ndim == 4, "argument '" << arg << "' must be [num_blocks, num_kv_heads, block_size, head_size], got "
                                             << cache.ndim << " dimension(s)");
  check_contiguous(cache, arg);
}

void check_kv_scales(const TensorView& cache, double k_scale, double v_scale) {
  if (cache.dtype == DType::kFloat8E4M3) {
    // The kernels hold scales as float32: a double that rounds to 0 or inf there is refused too.
    for (const auto& [name, scale] : {std::pair{"k_scale", k_scale}, std::pair{"v_scale", v_scale}}) {
      const auto f = static_cast<float>(scale);
      OCTAVO_CHECK(std::isfinite(f) && f > 0, name << " must be positive and finite (as a float32), got " << scale);
    }
  } else {
    OCTAVO_CHECK(k_scale == 1.0 && v_scale == 1.0, "k_scale and v_scale scale an fp8 cache; a "
                                                       << dtype_name(cache.dtype) << " cache takes 1.0, got "
                                                       << k_scale << " and " << v_scale);
  }
}

}  // namespace octavo::ops
