// Shared by the .cu files: the current stream, launch checks, the shared-memory opt-in, float
// conversions for the three activation dtypes, 16-byte packs and block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "cuda_kernels.h"  // kMaxDevices, current_device
#include "fp8_e4m3.h"
#include "octavo/status.h"
#include "octavo/tensor_view.h"

namespace octavo::cuda {

cudaStream_t current_stream();

// A scratch buffer of at least `bytes` on the current device, one per slot, kept between calls and
// zero-filled (in stream order) when allocated. Growing allocates, which a CUDA graph capture
// cannot do, and frees the outgrown buffer after a device sync, unless a captured graph holds it
// (then it stays allocated). reserve_cuda_workspaces sizes every slot once, so an engine never
// grows one. One buffer per slot and device, so one host thread at a time may launch a device's
// kernels: another thread's growth could free a buffer this one was handed and not yet used.
enum class WorkspaceSlot { kAttentionSplits, kAttentionTiles, kSampleWeights, kSampleCounts, kMoe, kCount };
void* device_workspace(WorkspaceSlot slot, size_t bytes, const char* op);
// Throws octavo::Error naming `what` if the last launch (or an earlier asynchronous error) failed.
void check_launch(const char* what);

// Lets `kernel` take `bytes` of dynamic shared memory, past the 48 KiB a launch gets without
// asking, on the current device. The limit is per device and kernel, so each kernel keeps its own
// `opted_in` table and asks once per device.
template <typename Kernel>
void set_shared_memory_limit(Kernel kernel, size_t bytes, int device, const char* what) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) == cudaSuccess)
    return;
  cudaGetLastError();  // the refusal is answered here; left set, the next launch check would report it
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, false,
                    what << ": the kernel's " << bytes << " bytes of shared memory are not available (CUDA device "
                         << device << " allows " << shared_memory_optin() << " per block, its static shared "
                         << "memory included)");
}

template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes, std::atomic<bool> (&opted_in)[kMaxDevices], const char* what) {
  const int device = current_device();
  if (opted_in[device].load()) return;
  set_shared_memory_limit(kernel, bytes, device, what);
  opted_in[device].store(true);
}

// The same for a kernel whose dynamic shared memory varies by call: its limit is raised when a call
// needs more than the 48 KiB every launch gets and than any call before. (Asking once for the
// device's whole opt-in fails where the kernel has static shared memory: that counts too.)
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes, std::atomic<size_t> (&allowed)[kMaxDevices], const char* what) {
  constexpr size_t kWithoutAsking = 48 * 1024;
  const int device = current_device();
  if (bytes <= kWithoutAsking || bytes <= allowed[device].load()) return;
  set_shared_memory_limit(kernel, bytes, device, what);
  allowed[device].store(bytes);
}

// kernel<<<grid, block, shared_bytes, current_stream()>>>(args...): the one place that spells a
// launch, so that tests/cuda_sim can run the same kernels on the CPU (OCTAVO_CUDA_SIM).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, Args&&... args) {
#ifdef OCTAVO_CUDA_SIM
  cuda_sim::launch(kernel, grid, block, shared_bytes, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, shared_bytes, current_stream()>>>(std::forward<Args>(args)...);
#endif
}

// The block's dynamic shared memory (the launch's shared_bytes), 128-byte aligned.
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
#ifdef OCTAVO_CUDA_SIM
  return cuda_sim::dynamic_shared_memory();
#else
  extern __shared__ __align__(128) unsigned char octavo_dynamic_shared[];
  return octavo_dynamic_shared;
#endif
}

using bf16 = __nv_bfloat16;
using f16 = __half;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(f16 x) { return __half2float(x); }

// An fp8 KV cache's element (E4M3, kv_cache_dtype="fp8"): raw bits, a type of its own so that
// templates tell it apart; fp8_e4m3.h converts as the CPU kernels do.
struct fp8e4m3 {
  uint8_t bits;
};
__device__ __forceinline__ float to_float(fp8e4m3 x) { return fp8_e4m3_to_float(x.bits); }

// Round to nearest even, as the CPU kernels (and torch) round.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) { return __float2half_rn(x); }

// 16 bytes of T, loaded and stored with one instruction (the address must be 16-byte aligned).
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__device__ __forceinline__ Pack<T> zero_pack() {
  Pack<T> pack;
  *reinterpret_cast<uint4*>(&pack) = make_uint4(0, 0, 0, 0);  // T's own constructor may leave bits unset
  return pack;
}

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}
template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& pack) {
  *reinterpret_cast<Pack<T>*>(p) = pack;
}

// N consecutive elements of T, read and written with one 16-byte access when N is a whole pack
// (the address must then be 16-byte aligned), else one by one.
template <typename T, int N>
struct alignas(N == Pack<T>::kSize ? 16 : alignof(T)) Elements {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Elements<T, N> load_elements(const T* p) {
  if constexpr (N == Pack<T>::kSize) {
    return *reinterpret_cast<const Elements<T, N>*>(p);
  } else {
    Elements<T, N> e;
#pragma unroll
    for (int j = 0; j < N; ++j) e.v[j] = p[j];
    return e;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_elements(T* p, const Elements<T, N>& e) {
  if constexpr (N == Pack<T>::kSize) {
    *reinterpret_cast<Elements<T, N>*>(p) = e;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = e.v[j];
  }
}

// Whether rows of `cols` elements starting at `ptr` with row stride `stride` can all be read in
// 16-byte packs.
template <typename T>
inline bool packs_fit(const void* ptr, int64_t cols, int64_t stride) {
  constexpr int64_t n = Pack<T>::kSize;
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && cols % n == 0 && stride % n == 0;
}

// Copies 16 bytes from global to shared memory without a stop in registers (cp.async, sm_80 and
// up), or writes 16 zero bytes when `zero`; the source address must be valid either way. Copies
// issued since the last commit form one group; wait<N> returns once at most N groups are pending.
__device__ __forceinline__ void copy_async_16(void* shared, const void* global, bool zero) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const int src_bytes = zero ? 0 : 16;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global), "r"(src_bytes));
#elif defined(OCTAVO_CUDA_SIM)
  cuda_sim::copy_async_16(shared, global, zero);
#else
  *static_cast<uint4*>(shared) = zero ? make_uint4(0, 0, 0, 0) : *static_cast<const uint4*>(global);
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#elif defined(OCTAVO_CUDA_SIM)
  cuda_sim::copy_async_commit();
#endif
}
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#elif defined(OCTAVO_CUDA_SIM)
  cuda_sim::copy_async_wait(N);
#endif
}

// op(...) of `v` over the block, for an associative and commutative op; every thread gets the
// result. blockDim.x a multiple of 32, at most 1024; `scratch` holds 32 Ts of shared memory;
// `identity` (op(x, identity) = x) stands in for the warps a smaller block lacks.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : identity;
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // scratch may be reused right after
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, [](float a, float b) { return a + b; }, 0.0f, scratch);
}

// Calls fn(T{}) with T the CUDA type of a float dtype (float, bf16 or f16).
template <typename Fn>
void dispatch_float(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(bf16{});
    case DType::kFloat16: return fn(f16{});
    default: OCTAVO_CHECK(false, op << ": unsupported dtype " << dtype_name(dtype));
  }
}

// The last b in [0, n) with a[b] <= x, for a non-decreasing a with a[0] <= x: the sequence that
// owns query token x (a = query_start_loc) or prefill tile x (a = tile offsets).
__device__ inline int last_at_most(const int32_t* a, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace octavo::cuda
