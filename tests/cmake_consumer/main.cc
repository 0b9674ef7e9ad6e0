// Uses the installed headers and libraries; exits 0 when everything links and behaves.
#include <cmath>
#include <cstdio>
#include <vector>

#include "octavo/block_pool.h"
#include "octavo/cpu_features.h"
#include "octavo/cuda_info.h"
#include "octavo/ops.h"
#include "octavo/threading.h"
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
  // A kernel through the public op API: rows of [3, 4, 0] / rms -> unit RMS.
  std::vector<float> x = {3, 4, 0, 0, 0, 0}, w(3, 1.0f), y(6);
  octavo::TensorView xv = t, yv = t, wv = t;
  xv.data = x.data();
  yv.data = y.data();
  wv.data = w.data();
  wv.ndim = 1;
  wv.shape[0] = 3;
  wv.strides[0] = 1;
  octavo::rms_norm(yv, xv, wv, 0.0);
  const float expected = 3.0f / std::sqrt(25.0f / 3.0f);
  if (std::fabs(y[0] - expected) > 1e-5f) {
    std::printf("rms_norm gave %f, expected %f\n", y[0], expected);
    return 1;
  }
  std::printf("rms_norm ok (%d threads)\n", octavo::get_num_threads());
  std::printf("octavo consumer ok\n");
  return 0;
}
