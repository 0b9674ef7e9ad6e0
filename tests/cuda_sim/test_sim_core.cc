// The simulator itself: barriers, shuffles, votes and the tensor-core fragments against their
// definitions, and the failures it must report instead of hanging or running on.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/mma.cuh"

namespace {

__global__ void shuffle_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int x = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  const int up = __shfl_up_sync(0xffffffffu, lane * 10, 3);
  const int indexed = __shfl_sync(0xffffffffu, lane * 10, (lane * 7 + 3) % 41);  // past 31: wraps
  out[threadIdx.x * 3] = x;
  out[threadIdx.x * 3 + 1] = up;
  out[threadIdx.x * 3 + 2] = indexed;
}

TEST(CudaSim, ShufflesReadTheirSourceLanes) {
  std::vector<int> out(64 * 3);
  cuda_sim::launch(shuffle_kernel, 1, 64, 0, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    EXPECT_EQ(out[t * 3], (lane ^ 5) * 10) << t;
    EXPECT_EQ(out[t * 3 + 1], (lane >= 3 ? lane - 3 : lane) * 10) << t;
    EXPECT_EQ(out[t * 3 + 2], (lane * 7 + 3) % 41 % 32 * 10) << t;
  }
}

// Lanes vote and group by value; the last lane then reads what lane 0 wrote before a __syncwarp.
__global__ void vote_kernel(unsigned* out) {
  __shared__ unsigned seen[2];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  out[threadIdx.x * 3] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  out[threadIdx.x * 3 + 1] = __match_any_sync(0xffffffffu, lane % 4 + warp);
  if (lane == 0) seen[warp] = 100u + static_cast<unsigned>(warp);
  __syncwarp();
  out[threadIdx.x * 3 + 2] = lane == 31 ? seen[warp] : 0u;
}

TEST(CudaSim, VotesGroupLanesAndSyncwarpOrdersTheirWrites) {
  std::vector<unsigned> out(64 * 3);
  cuda_sim::launch(vote_kernel, 1, 64, 0, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    unsigned thirds = 0, same = 0;
    for (int other = 0; other < 32; ++other) {
      if (other % 3 == 0) thirds |= 1u << other;
      if (other % 4 == lane % 4) same |= 1u << other;
    }
    EXPECT_EQ(out[t * 3], thirds) << t;
    EXPECT_EQ(out[t * 3 + 1], same) << t;
    EXPECT_EQ(out[t * 3 + 2], lane == 31 ? 100u + static_cast<unsigned>(t / 32) : 0u) << t;
  }
}

TEST(CudaSim, HalfConversionsAreExact) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const __half h{static_cast<uint16_t>(bits)};
    _Float16 reference;
    std::memcpy(&reference, &h.bits, sizeof(reference));
    const float f = __half2float(h);
    if (reference != reference) {
      EXPECT_TRUE(f != f) << bits;
      continue;
    }
    ASSERT_EQ(f, static_cast<float>(reference)) << bits;
    ASSERT_EQ(__float2half_rn(f).bits, h.bits) << bits;  // and back
  }
}

// C = A·B for a 16x16 A and a 16x16 B of T in shared memory, loaded as the attention kernels load
// them: A with ldmatrix (its 4 matrices are A's fragment), B row-major [k][n] with ldmatrix.trans
// (each 8 columns of n a B fragment), then two m16n8k16 mmas.
template <typename T>
__global__ void matmul_kernel(const T* a, const T* b, float* c) {
  T* s = reinterpret_cast<T*>(octavo::cuda::dynamic_shared_memory());  // [2][16][16]
  const int lane = static_cast<int>(threadIdx.x);
  for (int i = lane; i < 256; i += 32) s[i] = a[i], s[256 + i] = b[i];
  __syncthreads();
  uint32_t fa[4], fb[4];
  octavo::cuda::load_matrix_x4<false>(fa, s + (lane % 16) * 16 + lane / 16 * 8);
  octavo::cuda::load_matrix_x4<true>(fb, s + 256 + (lane % 16) * 16 + lane / 16 * 8);
  for (int n = 0; n < 2; ++n) {
    float d[4] = {0, 0, 0, 0};
    octavo::cuda::mma_16x8x16<T>(d, fa, fb[2 * n], fb[2 * n + 1]);
    const int g = lane / 4, t = lane % 4;  // C layout: rows g, g, g + 8, g + 8; columns 2t, 2t + 1
    for (int i = 0; i < 4; ++i) c[(g + 8 * (i / 2)) * 16 + n * 8 + 2 * t + i % 2] = d[i];
  }
}

template <typename T>
void check_matmul(T (*from_float)(float)) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> small(-8, 8);  // products and sums exact in float
  std::vector<T> a(256), b(256);
  std::vector<float> fa(256), fb(256), c(256);
  for (int i = 0; i < 256; ++i) {
    fa[i] = static_cast<float>(small(gen)) / 4, fb[i] = static_cast<float>(small(gen)) / 2;
    a[i] = from_float(fa[i]), b[i] = from_float(fb[i]);
  }
  cuda_sim::launch(matmul_kernel<T>, 1, 32, 2 * 256 * sizeof(T), a.data(), b.data(), c.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float want = 0;
      for (int k = 0; k < 16; ++k) want += fa[m * 16 + k] * fb[k * 16 + n];
      ASSERT_EQ(c[m * 16 + n], want) << m << ", " << n;
    }
}

TEST(CudaSim, TensorCoreFragmentsMultiplyAsTheKernelsLoadThem) {
  check_matmul<__nv_bfloat16>(__float2bfloat16_rn);
  check_matmul<__half>(__float2half_rn);
}

__global__ void barrier_or_kernel(int* out) {
  unsigned char* s = octavo::cuda::dynamic_shared_memory();
  out[threadIdx.x] = __syncthreads_or(threadIdx.x == 77) + 2 * __syncthreads_or(0) + 4 * (s[threadIdx.x] == 0xff);
}

TEST(CudaSim, BarrierOrAndPoisonedSharedMemory) {
  std::vector<int> out(96);
  cuda_sim::launch(barrier_or_kernel, 1, 96, 96, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int v : out) EXPECT_EQ(v, 1 + 4);
}

// The launch fails, and cudaGetErrorString names what went wrong.
void expect_failure(cudaError_t expected, const std::string& message) {
  const cudaError_t error = cudaGetLastError();
  EXPECT_EQ(error, expected);
  EXPECT_NE(std::string(cudaGetErrorString(error)).find(message), std::string::npos) << cudaGetErrorString(error);
}

__global__ void exits_before_shuffle_kernel(int* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void barrier_against_shuffle_kernel(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void trap_kernel() {
  if (blockIdx.x == 2 && threadIdx.x == 5) __trap();
}
__global__ void ldmatrix_from_global_kernel(const uint16_t* p) {
  uint32_t r[4];
  octavo::cuda::load_matrix_x4<false>(r, p + threadIdx.x * 8);
}

TEST(CudaSim, ReportsWhatAGpuWouldHangOnOrLeaveUndefined) {
  std::vector<int> out(32);
  cuda_sim::launch(exits_before_shuffle_kernel, 1, 32, 0, out.data());
  expect_failure(cudaErrorLaunchFailure, "waits for lane 3, which has exited");
  cuda_sim::launch(barrier_against_shuffle_kernel, 1, 32, 0, out.data());
  expect_failure(cudaErrorLaunchFailure, "deadlocks: threads 0-15: __syncthreads; threads 16-31: __shfl_xor_sync;");
  cuda_sim::launch(trap_kernel, 4, 32, 0);
  expect_failure(cudaErrorLaunchFailure, "block (2,0,0) thread (5,0,0): __trap() called");
  std::vector<uint16_t> global(32 * 8);
  cuda_sim::launch(ldmatrix_from_global_kernel, 1, 32, 0, global.data());
  expect_failure(cudaErrorLaunchFailure, "ldmatrix reads a row outside dynamic shared memory");
  cuda_sim::launch(trap_kernel, 1, 1025, 0);
  expect_failure(cudaErrorInvalidConfiguration, "a block of 1025x1x1 threads");
}

__global__ void large_shared_kernel(int* out) {
  if (threadIdx.x == 0) out[0] = octavo::cuda::dynamic_shared_memory()[100000];
}

TEST(CudaSim, SharedMemoryPast48KiBNeedsTheOptIn) {
  int out = 0;
  cuda_sim::launch(large_shared_kernel, 1, 32, 100001, &out);
  expect_failure(cudaErrorInvalidConfiguration, "100001 bytes of dynamic shared memory, past the kernel's 49152");
  ASSERT_EQ(cudaFuncSetAttribute(large_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100001), cudaSuccess);
  cuda_sim::launch(large_shared_kernel, 1, 32, 100001, &out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out, 0xff);
  EXPECT_EQ(cudaFuncSetAttribute(large_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 300000),
            cudaErrorInvalidValue);  // past the device's 227 KiB
}

// Devices of other shapes: their own attributes, and opt-ins that hold on the device that made
// them, as on a GPU.
TEST(CudaSim, AddedDevicesHaveTheirOwnPropertiesAndOptIns) {
  struct BackToDevice0 {
    ~BackToDevice0() { cudaSetDevice(0); }  // even when an assertion ends the test early
  } restore;
  const int rtx = cuda_sim::add_device({82, 101376});  // an RTX 3090's SMs and opt-in limit
  const int h100 = cuda_sim::add_device({});
  int value = 0, count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, h100 + 1);
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, rtx), cudaSuccess);
  EXPECT_EQ(value, 82);
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, rtx), cudaSuccess);
  EXPECT_EQ(value, 101376);
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(value, 132);
  EXPECT_EQ(cudaSetDevice(count), cudaErrorInvalidDevice);

  ASSERT_EQ(cudaSetDevice(rtx), cudaSuccess);
  int device = -1;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, rtx);
  EXPECT_EQ(cudaFuncSetAttribute(large_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 101377),
            cudaErrorInvalidValue);  // past this device's 99 KiB
  ASSERT_EQ(cudaFuncSetAttribute(large_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100001), cudaSuccess);
  int out = 0;
  cuda_sim::launch(large_shared_kernel, 1, 32, 100001, &out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out, 0xff);

  ASSERT_EQ(cudaSetDevice(h100), cudaSuccess);  // the opt-in above was the RTX's alone
  cuda_sim::launch(large_shared_kernel, 1, 32, 100001, &out);
  expect_failure(cudaErrorInvalidConfiguration, "past the kernel's 49152");
}
}  // namespace
