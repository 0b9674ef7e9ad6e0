// cuda_sim: runs Octavo's CUDA kernels (csrc/kernels/cuda) on the CPU, so that machines without
// a GPU (CI's, most developers') execute the very source the GPU runs: host dispatch, launch
// configuration, every kernel's index arithmetic, barriers, warp shuffles and the tensor-core
// fragments. The kernel sources compile as C++ against this header, which stands in for
// cuda_runtime.h, cuda_bf16.h and cuda_fp16.h (tests/cuda_sim/include shadows them).
//
// How it runs a launch: blocks one after another; within a block every CUDA thread is a fiber
// (its own stack) on the calling thread. A fiber runs until it reaches a barrier or a warp
// collective, and the scheduler releases the barrier once every thread that must arrive has.
// So the threads of a block interleave only at synchronization points, which is all that a
// race-free kernel may rely on. Each pass runs the threads in thread order, or, with
// CUDA_SIM_SCHEDULE=shuffle, in a shuffled order per block (a missing barrier then shows). It checks what hardware would leave undefined or hang on: a
// collective some lane of its mask never reaches, lanes of one warp waiting in different
// collectives, a block barrier that can never fill, a launch beyond the device's limits
// (threads, grid, shared memory without the opt-in). Each is a failed launch with a message.
//
// Asynchronous copies (cp.async) land only when the issuing thread waits for their group, so a
// read of a tile before its wait and barrier sees stale bytes. What it does not model: timing,
// registers, caches, memory ordering between blocks (blocks run in turn) and uninitialised
// static shared memory. Dynamic shared memory starts as 0xFF bytes
// (NaN in every float type) so reads of unwritten rows show up. Device 0 is an H100 (132 SMs,
// 227 KiB of opt-in shared memory per block); tests can add devices of other shapes
// (add_device) and select them with cudaSetDevice.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- CUDA's qualifiers, as plain C++ --------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Blocks run one at a time, so a function's static storage is the running block's own.
#define __shared__ static
#define __constant__

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
// Rounded, never contracted into an FMA with a neighbour (cuda_sim's kernels build with
// -ffp-contract=off, as nvcc leaves these alone).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

// ---- bfloat16 and float16 --------------------------------------------------------------------
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2 {
  __half x, y;
};

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<uint32_t>(h.bits) << 16); }
// Nearest even; NaN stays a (quiet) NaN.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if (std::isnan(f)) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
// Exact; by bits, since the library's soft-float conversion is slow (tensor-core emulation reads
// every operand through here).
inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16, exponent = h.bits >> 10 & 0x1fu,
                 mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return __uint_as_float(sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13);
}
// Through the compiler's _Float16 (IEEE binary16): rounds to nearest even, overflows to inf.
inline __half __float2half_rn(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.bits, &v, sizeof(v));
  return h;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }

// ---- The simulator's interface ---------------------------------------------------------------
namespace cuda_sim {

const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_shared_memory();  // the running block's, as many bytes as the launch asked

// Ends the calling kernel thread and fails the launch with `why` (what __trap does).
[[noreturn]] void fail(const char* why);

// A warp collective: the calling thread waits until every lane in `mask` of its warp has called
// one of the same `kind`, then combine(in, out, mask) runs once with every lane's operand
// (in[lane], null for lanes outside the mask) and result slot.
using Combine = void (*)(const void* const* in, void* const* out, unsigned mask, int arg);
void warp_collective(const char* kind, unsigned mask, const void* in, void* out, int arg, Combine combine);
// __syncwarp: a collective that orders the memory accesses of the lanes in `mask` around it.
void warp_barrier(unsigned mask);
// __syncthreads and its _or form: waits for every thread of the block that has not exited.
int block_barrier(int predicate);

// Runs kernel(args...) on `grid` blocks of `block` threads, converting args to the kernel's
// parameter types as a launch does. On failure the launch's error is left for cudaGetLastError.
using Entry = void (*)(void* call);
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes, Entry entry, void* call);

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, Args&&... args) {
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  } call{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  // Each thread calls the kernel with its own copies of the parameters.
  const Entry entry = [](void* c) {
    Call& the = *static_cast<Call*>(c);
    std::apply(the.kernel, the.params);
  };
  run_grid(reinterpret_cast<const void*>(kernel), grid, block, shared_bytes, entry, &call);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 and mma.sync.aligned.m16n8k16.row.col with
// float accumulators, by the PTX ISA's fragment layouts (see csrc/kernels/cuda/mma.cuh).
void load_matrix_x4(uint32_t (&r)[4], const void* row, bool trans);
void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);

// cp.async: the 16 bytes are read at once but land in shared memory only when the thread's
// wait releases their group (a read before that finds the old bytes); commit closes the open
// group; wait(n) completes all but the n most recent committed groups.
void copy_async_16(void* shared, const void* global, bool zero);
void copy_async_commit();
void copy_async_wait(int n);

// A simulated device as cudaDeviceGetAttribute reports it. All devices share the host's memory.
struct DeviceProperties {
  int multiprocessors = 132;    // an H100 SXM
  int shared_optin = 232448;    // its 227 KiB of opt-in shared memory per block
};
// Adds a device and returns its number, for cudaSetDevice. Octavo's host code caches a device's
// properties on first use, as they cannot change on a GPU; a test wanting other properties
// therefore takes a device of its own.
int add_device(DeviceProperties properties);

}  // namespace cuda_sim

#define threadIdx (::cuda_sim::thread_idx())
#define blockIdx (::cuda_sim::block_idx())
#define blockDim (::cuda_sim::block_dim())
#define gridDim (::cuda_sim::grid_dim())
#define warpSize 32

// ---- Device functions --------------------------------------------------------------------------
inline void __syncthreads() { ::cuda_sim::block_barrier(0); }
inline int __syncthreads_or(int predicate) { return ::cuda_sim::block_barrier(predicate != 0); }
[[noreturn]] inline void __trap() { ::cuda_sim::fail("__trap() called"); }

namespace cuda_sim {
// The lane a shuffle reads: `src` if it lies in the caller's segment of `width` lanes and in the
// mask, else the caller itself.
inline int shuffle_source(int lane, int src, int width, unsigned mask) {
  const int base = lane & ~(width - 1);
  if (src < base || src >= base + width || !(mask >> src & 1u)) return lane;
  return src;
}
// Combines run on the scheduler, outside any fiber: in the racecheck build their reads of each
// lane's operand are not that scheduler's accesses (cuda_sim.cc, "The race check").
#if defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define CUDA_SIM_TSAN_BUILD 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(CUDA_SIM_TSAN_BUILD)
#define CUDA_SIM_UNCHECKED __attribute__((no_sanitize("thread")))
#else
#define CUDA_SIM_UNCHECKED
#endif
template <typename T>
CUDA_SIM_UNCHECKED void combine_shfl_xor(const void* const* in, void* const* out, unsigned mask, int arg) {
  const int lane_mask = arg & 0xffff, width = arg >> 16;
  for (int lane = 0; lane < 32; ++lane)
    if (mask >> lane & 1u)
      *static_cast<T*>(out[lane]) = *static_cast<const T*>(in[shuffle_source(lane, lane ^ lane_mask, width, mask)]);
}
template <typename T>
CUDA_SIM_UNCHECKED void combine_shfl_up(const void* const* in, void* const* out, unsigned mask, int arg) {
  const int delta = arg & 0xffff, width = arg >> 16;
  for (int lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    const int src = (lane & (width - 1)) >= delta ? lane - delta : lane;
    *static_cast<T*>(out[lane]) = *static_cast<const T*>(in[shuffle_source(lane, src, width, mask)]);
  }
}
// __shfl_sync's source lane is each caller's own argument: it travels with the caller's value.
template <typename T>
struct IndexedOperand {
  T value;
  int src_lane;
};
template <typename T>
CUDA_SIM_UNCHECKED void combine_shfl_idx(const void* const* in, void* const* out, unsigned mask, int width) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    const int src = (lane & ~(width - 1)) + (static_cast<const IndexedOperand<T>*>(in[lane])->src_lane & (width - 1));
    *static_cast<T*>(out[lane]) = static_cast<const IndexedOperand<T>*>(in[shuffle_source(lane, src, width, mask)])->value;
  }
}
// Every lane in the mask gets the mask's lanes whose predicate is nonzero, one bit each.
CUDA_SIM_UNCHECKED inline void combine_ballot(const void* const* in, void* const* out, unsigned mask, int) {
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane)
    if ((mask >> lane & 1u) && *static_cast<const int*>(in[lane]) != 0) bits |= 1u << lane;
  for (int lane = 0; lane < 32; ++lane)
    if (mask >> lane & 1u) *static_cast<unsigned*>(out[lane]) = bits;
}
// Every lane in the mask gets the mask's lanes whose value equals its own, one bit each.
CUDA_SIM_UNCHECKED inline void combine_match_any(const void* const* in, void* const* out, unsigned mask, int) {
  for (int lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    unsigned bits = 0;
    for (int other = 0; other < 32; ++other)
      if ((mask >> other & 1u) && *static_cast<const int*>(in[other]) == *static_cast<const int*>(in[lane]))
        bits |= 1u << other;
    *static_cast<unsigned*>(out[lane]) = bits;
  }
}
}  // namespace cuda_sim

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const ::cuda_sim::IndexedOperand<T> operand{v, src_lane};
  T result;
  ::cuda_sim::warp_collective("__shfl_sync", mask, &operand, &result, width, ::cuda_sim::combine_shfl_idx<T>);
  return result;
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  T result;
  ::cuda_sim::warp_collective("__shfl_xor_sync", mask, &v, &result, (width << 16) | lane_mask,
                              ::cuda_sim::combine_shfl_xor<T>);
  return result;
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  T result;
  ::cuda_sim::warp_collective("__shfl_up_sync", mask, &v, &result, (width << 16) | static_cast<int>(delta),
                              ::cuda_sim::combine_shfl_up<T>);
  return result;
}

// Fibers switch only at barriers and collectives, so any read-modify-write would be atomic here;
// these are atomic builtins so that the racecheck build sees atomics, not races.
template <typename T>
T atomicAdd(T* address, T value) {
  static_assert(std::is_integral_v<T>, "the kernels add integers atomically");
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
template <typename T>
T atomicExch(T* address, T value) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(__atomic_exchange_n(reinterpret_cast<unsigned*>(address), __float_as_uint(value),
                                               __ATOMIC_RELAXED));
  } else {
    static_assert(std::is_integral_v<T>, "the kernels exchange integers and floats atomically");
    return __atomic_exchange_n(address, value, __ATOMIC_RELAXED);
  }
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  static_assert(std::is_integral_v<T>, "the kernels compare and swap integers atomically");
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;  // the old value: on failure the builtin wrote it here
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  unsigned result;
  ::cuda_sim::warp_collective("__ballot_sync", mask, &predicate, &result, 0, ::cuda_sim::combine_ballot);
  return result;
}
inline unsigned __match_any_sync(unsigned mask, int value) {
  unsigned result;
  ::cuda_sim::warp_collective("__match_any_sync", mask, &value, &result, 0, ::cuda_sim::combine_match_any);
  return result;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cuda_sim::warp_barrier(mask); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __expf(float x) { return std::exp(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
using std::isfinite;
// CUDA's integer min / max overloads, for any mix of arithmetic types.
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// ---- The runtime API -------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
using cudaStream_t = struct CUstream_st*;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);
cudaError_t cudaGetLastError();
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cuda_sim_set_shared_limit(const void* kernel, int bytes);
template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return cuda_sim_set_shared_limit(reinterpret_cast<const void*>(kernel), value);
}
