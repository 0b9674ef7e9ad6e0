// rotary_embedding: argument checks (for CPU tensors positions are range-checked here; the CUDA
// kernel skips out-of-range ones, see cuda_kernels.h), then the CPU or CUDA launcher.
#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

// Rows of `t` as [tokens, heads * head_size]; returns the number of heads.
int64_t heads_of(const TensorView& t, const char* arg, const TensorView& positions, int64_t head_size,
                 int64_t* stride) {
  ops::check_same_device(t, arg, positions, "positions");
  const int64_t tokens = positions.shape[0];
  OCTAVO_CHECK(t.ndim == 2 || t.ndim == 3,
               "argument '" << arg << "' must be [tokens, heads * head_size] or [tokens, heads, head_size], got "
                            << t.ndim << " dimension(s)");
  const ops::Rows r = ops::as_rows(t, arg);
  OCTAVO_CHECK(r.rows == tokens, "argument '" << arg << "' must have " << tokens << " rows (one per position), got "
                                              << r.rows);
  OCTAVO_CHECK(r.cols % head_size == 0 && (t.ndim == 2 || t.shape[2] == head_size),
               "argument '" << arg << "' rows of " << r.cols << " elements are not whole heads of size " << head_size);
  *stride = r.stride;
  return r.cols / head_size;
}

template <typename Index>
void check_positions(const TensorView& positions, int64_t max_position) {
  const Index* pos = positions.data_as<Index>();
  for (int64_t i = 0; i < positions.shape[0]; ++i) {
    OCTAVO_CHECK(pos[i] >= 0 && pos[i] < max_position, "positions[" << i << "] = " << pos[i]
                                                                     << " is outside the cos/sin cache [0, "
                                                                     << max_position << ")");
  }
}

}  // namespace

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView* key,
                      int64_t head_size, const TensorView& cos_sin_cache, bool is_neox) {
  ops::check_index_dtype(positions, "positions");
  check_ndim(positions, "positions", 1);
  check_contiguous(positions, "positions");
  ops::check_float(query, "query");
  OCTAVO_CHECK(head_size > 0, "head_size must be positive, got " << head_size);
  ops::check_same_device(cos_sin_cache, "cos_sin_cache", positions, "positions");
  check_dtype(cos_sin_cache, "cos_sin_cache", DType::kFloat32);
  check_ndim(cos_sin_cache, "cos_sin_cache", 2);
  check_contiguous(cos_sin_cache, "cos_sin_cache");
  const int64_t rot_dim = cos_sin_cache.shape[1];
  OCTAVO_CHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_size,
               "cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= head_size (" << head_size
                                                                                                  << "), got rot_dim "
                                                                                                  << rot_dim);
  RotaryParams p{};
  p.num_tokens = positions.shape[0];
  p.head_size = head_size;
  p.rot_dim = rot_dim;
  p.max_position = cos_sin_cache.shape[0];
  p.num_heads = heads_of(query, "query", positions, head_size, &p.query_stride);
  if (key) {
    ops::check_same_dtype(*key, "key", query, "query");
    p.num_kv_heads = heads_of(*key, "key", positions, head_size, &p.key_stride);
    p.key = key->data;
  }
  if (!ops::is_cuda(positions)) {
    if (positions.dtype == DType::kInt32) check_positions<int32_t>(positions, p.max_position);
    else check_positions<int64_t>(positions, p.max_position);
  }
  p.positions = positions.data;
  p.positions_dtype = positions.dtype;
  p.query = query.data;
  p.cos_sin_cache = cos_sin_cache.data_as<float>();
  p.dtype = query.dtype;
  p.is_neox = is_neox;
  if (ops::runs_on_cuda(positions, "positions")) cuda::rotary_embedding(p);
  else cpu_dispatch(rotary_embedding, p);
}

}  // namespace octavo
