// apply_token_bitmask: argument checks, then the CPU or CUDA launcher. For CPU tensors the row
// indices are validated here; the CUDA kernel cannot read them on the host and skips a row index
// outside the batch.
#include <vector>

#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {

void apply_token_bitmask(const TensorView& logits, const TensorView& bitmask, const TensorView* indices) {
  check_dtype(logits, "logits", DType::kFloat32);
  check_ndim(logits, "logits", 2);
  const ops::Rows rows = ops::as_rows(logits, "logits");
  ops::check_same_device(bitmask, "bitmask", logits, "logits");
  check_dtype(bitmask, "bitmask", DType::kInt32);
  check_ndim(bitmask, "bitmask", 2);
  check_contiguous(bitmask, "bitmask");
  const int64_t words = (rows.cols + 31) / 32;
  OCTAVO_CHECK(bitmask.shape[1] == words, "argument 'bitmask' must have " << words << " words per row for a "
                                              << "vocabulary of " << rows.cols << ", got " << bitmask.shape[1]);
  TokenBitmaskParams p{};
  p.logits = logits.data_as<float>();
  p.batch_rows = rows.rows;
  p.vocab_size = rows.cols;
  p.logits_stride = rows.stride;
  p.bitmask = bitmask.data_as<int32_t>();
  p.num_rows = bitmask.shape[0];
  p.words = words;
  if (indices) {
    ops::check_vector(*indices, "indices", DType::kInt32, p.num_rows, logits, "logits");
    p.indices = indices->data_as<int32_t>();
  } else {
    OCTAVO_CHECK(p.num_rows == rows.rows, "argument 'bitmask' must have one row per row of 'logits' ("
                                              << rows.rows << ") when no 'indices' are given, got " << p.num_rows);
  }
  if (p.num_rows == 0 || p.vocab_size == 0) return;
  if (ops::runs_on_cuda(logits, "logits")) {
    cuda::apply_token_bitmask(p);
    return;
  }
  if (p.indices) {
    std::vector<bool> seen(static_cast<size_t>(rows.rows), false);
    for (int64_t i = 0; i < p.num_rows; ++i) {
      const int32_t r = p.indices[i];
      OCTAVO_CHECK(r >= 0 && r < rows.rows, "indices[" << i << "] = " << r << " is not a row of 'logits' ("
                                                       << rows.rows << " rows)");
      OCTAVO_CHECK(!seen[r], "indices lists row " << r << " twice");
      seen[r] = true;
    }
  }
  cpu_dispatch(apply_token_bitmask, p);
}

}  // namespace octavo
