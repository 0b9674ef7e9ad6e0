// Uses the installed headers and libraries; exits 0 when everything links and behaves.
#include <cstdio>
#include <vector>

#include "octavo/block_pool.h"
#include "octavo/cpu_features.h"
#include "octavo/cuda_info.h"
#include "octavo/tensor_view.h"

int main() {
  std::vector<float> data(6);
  octavo::TensorView t;
  t.data = data.data();
  t.dtype = octavo::DType::kFloat32;
  t.ndim = 2;
  t.shape[0] = 2;
  t.shape[1] = 3;
  t.strides[0] = 3;
  t.strides[1] = 1;
  octavo::check_contiguous(t, "t");
  octavo::check_dtype(t, "t", octavo::DType::kFloat32);

  const octavo::CpuFeatures& f = octavo::cpu_features();
  std::printf("cpu: avx2=%d fma=%d avx512f=%d avx512_bf16=%d amx_bf16=%d\n", f.avx2, f.fma, f.avx512f,
              f.avx512_bf16, f.amx_bf16);
  std::printf("cuda: compiled=%d devices=%d\n", octavo::cuda_compiled(), octavo::cuda_device_count());

  octavo::BlockPool pool(/*num_blocks=*/8, /*block_size=*/16, /*enable_caching=*/true);
  std::printf("block pool: %d free blocks\n", pool.num_free_blocks());
  std::printf("octavo consumer ok\n");
  return 0;
}
