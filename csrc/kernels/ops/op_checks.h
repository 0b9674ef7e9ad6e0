// Argument checks shared by the op adapters (csrc/kernels/ops/*.cc). Each throws an octavo::Error
// that names the argument and says what was expected.
#pragma once

#include <cstdint>

#include "octavo/ops.h"
#include "octavo/tensor_view.h"

namespace octavo {
struct LinearParams;
}

namespace octavo::ops {

// A tensor as a matrix of rows: the first dimension indexes rows (any stride), the others are
// flattened into one contiguous row. A 1-D tensor is one row.
struct Rows {
  int64_t rows;
  int64_t cols;
  int64_t stride;  // elements between consecutive rows
};
Rows as_rows(const TensorView& t, const char* arg);
// A tensor as rows of its last dimension: [..., cols] with the leading dimensions flattened
// (they must collapse into one row stride, as for any view torch could .view(-1, cols)).
Rows last_dim_rows(const TensorView& t, const char* arg);

void check_float(const TensorView& t, const char* arg);  // float32, bfloat16 or float16

// An op's float input and its output, as rows of their last dimension: same device, same dtype.
struct InOutRows {
  Rows in;
  Rows out;
};
InOutRows float_in_out(const TensorView& out, const char* out_arg, const TensorView& input);
void check_same_dtype(const TensorView& t, const char* arg, const TensorView& ref, const char* ref_arg);
void check_index_dtype(const TensorView& t, const char* arg);  // int32 or int64
// CPU memory, for arrays the host reads (the attention plan's inputs).
void check_cpu(const TensorView& t, const char* arg);
// On the same device (type and index) as ref.
void check_same_device(const TensorView& t, const char* arg, const TensorView& ref, const char* ref_arg);
inline bool is_cuda(const TensorView& t) { return t.device.type == DeviceType::kCUDA; }
// Whether the op runs its CUDA kernel: t is a CUDA tensor, on the device this thread launches
// on (kernels launch on the current device; another one would fault).
bool runs_on_cuda(const TensorView& t, const char* arg);
// 1-D, contiguous, `dtype`, `size` elements (size < 0: any); in CPU memory, or on ref's device.
void check_vector(const TensorView& t, const char* arg, DType dtype, int64_t size);
void check_vector(const TensorView& t, const char* arg, DType dtype, int64_t size, const TensorView& ref,
                  const char* ref_arg);

// A paged KV cache [num_blocks, num_kv_heads, block_size, head_size]: contiguous, on the device
// of ref; on the CPU of any float dtype or fp8 (float8_e4m3fn), on CUDA of ref's dtype or fp8.
void check_kv_cache(const TensorView& cache, const char* arg, const TensorView& ref, const char* ref_arg);
// An fp8 cache's scales (what it holds = value / scale): positive and finite; 1 for other caches.
void check_kv_scales(const TensorView& cache, double k_scale, double v_scale);

// A `linear` weight standing for `k` inputs per row in `format`, and its scales / zero points, on
// ref's device (ops/linear.cc); fills p's weight fields and returns the number of rows (output
// features).
int64_t check_weight(const TensorView& weight, WeightFormat format, const WeightQuant& quant, const TensorView& ref,
                     const char* ref_arg, int64_t k, LinearParams& p);

}  // namespace octavo::ops
