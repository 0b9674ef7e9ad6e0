// reshape_and_cache: argument checks (for CPU tensors slots are range-checked here; the CUDA
// kernel skips out-of-range ones, see cuda_kernels.h), then the CPU or CUDA launcher.
#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

template <typename Index>
void check_slots(const TensorView& slot_mapping, int64_t num_slots) {
  const Index* s = slot_mapping.data_as<Index>();
  for (int64_t i = 0; i < slot_mapping.shape[0]; ++i) {
    OCTAVO_CHECK(s[i] >= -1 && s[i] < num_slots, "slot_mapping[" << i << "] = " << s[i]
                                                                  << " is outside the cache (slots 0.." << num_slots - 1
                                                                  << ", or -1 to skip)");
  }
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, double k_scale,
                       double v_scale) {
  ops::check_float(key, "key");
  check_ndim(key, "key", 3);
  const ops::Rows k = ops::as_rows(key, "key");
  ops::check_same_device(value, "value", key, "key");
  ops::check_same_dtype(value, "value", key, "key");
  check_ndim(value, "value", 3);
  const ops::Rows v = ops::as_rows(value, "value");
  for (int d = 0; d < 3; ++d) check_size(value, "value", d, key.shape[d]);
  ops::check_kv_cache(key_cache, "key_cache", key, "key");
  ops::check_kv_cache(value_cache, "value_cache", key, "key");
  ops::check_same_dtype(value_cache, "value_cache", key_cache, "key_cache");
  ops::check_kv_scales(key_cache, k_scale, v_scale);
  for (int d = 0; d < 4; ++d) check_size(value_cache, "value_cache", d, key_cache.shape[d]);
  check_size(key_cache, "key_cache", 1, key.shape[1]);
  check_size(key_cache, "key_cache", 3, key.shape[2]);
  ops::check_same_device(slot_mapping, "slot_mapping", key, "key");
  ops::check_index_dtype(slot_mapping, "slot_mapping");
  check_ndim(slot_mapping, "slot_mapping", 1);
  check_size(slot_mapping, "slot_mapping", 0, key.shape[0]);
  check_contiguous(slot_mapping, "slot_mapping");

  CacheWriteParams p{};
  p.num_tokens = key.shape[0];
  p.num_kv_heads = key.shape[1];
  p.head_size = key.shape[2];
  p.num_blocks = key_cache.shape[0];
  p.block_size = key_cache.shape[2];
  if (!ops::is_cuda(key)) {
    if (slot_mapping.dtype == DType::kInt32) check_slots<int32_t>(slot_mapping, p.num_blocks * p.block_size);
    else check_slots<int64_t>(slot_mapping, p.num_blocks * p.block_size);
  }
  p.key = key.data;
  p.value = value.data;
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.slot_mapping = slot_mapping.data;
  p.key_stride = k.stride;
  p.value_stride = v.stride;
  p.dtype = key.dtype;
  p.cache_dtype = key_cache.dtype;
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.slot_dtype = slot_mapping.dtype;
  if (ops::runs_on_cuda(key, "key")) cuda::reshape_and_cache(p);
  else cpu_dispatch(reshape_and_cache, p);
}

}  // namespace octavo
