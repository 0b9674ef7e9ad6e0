#include <gtest/gtest.h>

#include "octavo/cpu_features.h"
#include "octavo/cuda_info.h"

namespace {

TEST(CpuFeatures, DetectedOnceAndConsistent) {
  const octavo::CpuFeatures& f = octavo::cpu_features();
  EXPECT_EQ(&f, &octavo::cpu_features());
  // Every AVX-512 extension implies the foundation; AVX-512 implies AVX2 on every real CPU.
  if (f.avx512bw || f.avx512vl || f.avx512_bf16 || f.avx512_vnni) EXPECT_TRUE(f.avx512f);
  if (f.avx512f) EXPECT_TRUE(f.avx2);
}

TEST(CudaInfo, DeviceCountIsNeverNegative) {
  const int n = octavo::cuda_device_count();
  EXPECT_GE(n, 0);
  if (!octavo::cuda_compiled()) EXPECT_EQ(n, 0);
}

}  // namespace
