// The public ops on device memory from C++ (no torch), against the same ops on the CPU: what a
// native consumer of octavo::kernels does. Skipped where no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "octavo/cuda_info.h"
#include "octavo/ops.h"
#include "octavo/tensor_view.h"

namespace {

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (octavo::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
  }

  // A float32 tensor view of `values` on the device, shaped [rows, cols].
  octavo::TensorView on_device(const std::vector<float>& values, int64_t rows, int64_t cols) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, values.size() * sizeof(float)), cudaSuccess);
    allocations_.push_back(p);
    cudaMemcpy(p, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice);
    return view(p, rows, cols, octavo::DeviceType::kCUDA);
  }
  static octavo::TensorView view(void* data, int64_t rows, int64_t cols, octavo::DeviceType device) {
    octavo::TensorView t;  // rows == 0: a 1-D tensor of cols elements
    t.data = data;
    t.dtype = octavo::DType::kFloat32;
    t.device.type = device;
    t.ndim = rows > 0 ? 2 : 1;
    if (rows > 0) {
      t.shape[0] = rows;
      t.shape[1] = cols;
      t.strides[0] = cols;
      t.strides[1] = 1;
    } else {
      t.shape[0] = cols;
      t.strides[0] = 1;
    }
    return t;
  }
  static std::vector<float> to_host(const octavo::TensorView& t) {
    std::vector<float> out(static_cast<size_t>(t.numel()));
    cudaMemcpy(out.data(), t.data, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
    return out;
  }

 private:
  std::vector<void*> allocations_;
};

std::vector<float> random_values(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen);
  return v;
}

TEST_F(CudaOps, RmsNormMatchesTheCpu) {
  const int64_t rows = 7, hidden = 1000;
  std::vector<float> x = random_values(rows * hidden, 1), w = random_values(hidden, 2), cpu(rows * hidden);
  octavo::rms_norm(view(cpu.data(), rows, hidden, octavo::DeviceType::kCPU),
                   view(x.data(), rows, hidden, octavo::DeviceType::kCPU),
                   view(w.data(), 0, hidden, octavo::DeviceType::kCPU), 1e-6);
  const octavo::TensorView gx = on_device(x, rows, hidden), gw = on_device(w, 0, hidden);
  const octavo::TensorView gout = on_device(std::vector<float>(rows * hidden), rows, hidden);
  octavo::rms_norm(gout, gx, gw, 1e-6);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> gpu = to_host(gout);
  for (size_t i = 0; i < gpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-5f * (1 + std::fabs(cpu[i]))) << i;
}

TEST_F(CudaOps, SiluAndMulMatchesTheCpu) {
  const int64_t rows = 5, d = 333;
  std::vector<float> x = random_values(rows * 2 * d, 3), cpu(rows * d);
  octavo::silu_and_mul(view(cpu.data(), rows, d, octavo::DeviceType::kCPU),
                       view(x.data(), rows, 2 * d, octavo::DeviceType::kCPU));
  const octavo::TensorView gout = on_device(std::vector<float>(rows * d), rows, d);
  octavo::silu_and_mul(gout, on_device(x, rows, 2 * d));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> gpu = to_host(gout);
  for (size_t i = 0; i < gpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-5f * (1 + std::fabs(cpu[i]))) << i;
}

TEST_F(CudaOps, MixedDevicesAreRefused) {
  std::vector<float> x = random_values(64, 4), w(64, 1.0f);
  const octavo::TensorView gx = on_device(x, 1, 64);
  EXPECT_THROW(octavo::rms_norm(gx, gx, view(w.data(), 0, 64, octavo::DeviceType::kCPU), 1e-6), std::exception);
}

}  // namespace
