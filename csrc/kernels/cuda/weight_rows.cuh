// The weight formats as CUDA kernels read them: each format's row decoder (Row(p, n), then
// decode(blk, q, w) for part q of each block of 32 weights), shared by linear / dequantize
// (linear.cu) and the experts of fused_moe (moe.cu).
//
// A decoded weight is the float that the CPU kernel decodes and `dequantize` writes, bit for
// bit: GGUF formats with the gguf package's arithmetic (one product; Q4_1 then a separate sum,
// written as __fmul_rn / __fadd_rn so that nvcc cannot contract them into one FMA).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "params.h"

namespace octavo::cuda {

constexpr int kBlockWeights = 32;  // weights per block, in every format
constexpr int kParts = 4;          // threads per block of 32 weights, 8 weights each

inline bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// ---- loads ----------------------------------------------------------------------------------

// Four elements of T, read or written with one load / store (p aligned to 4 elements).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};
template <typename T>
__device__ __forceinline__ void load4(const T* p, float out[4]) {
  const Quad<T> q = *reinterpret_cast<const Quad<T>*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = to_float(q.v[i]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float in[4]) {
  Quad<T> q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Quad<T>*>(p) = q;
}

// Four bytes at p: one load where p is 4-byte aligned, two where it is only 2-byte aligned (the
// quants of Q8_0's 34-byte and Q4_0's 18-byte blocks).
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t load_u32_2aligned(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
}
__device__ __forceinline__ float half_at(const uint8_t* p) { return to_float(*reinterpret_cast<const f16*>(p)); }

// ---- decoding: the 8 weights of part q, w[i] = weight 4q + i, w[4 + i] = weight 16 + 4q + i ----

// u - offset, for integers u < 2^23 and offset, without an integer-to-float conversion (those
// run at a quarter of the FP32 rate or less, too slow to decode 4-bit weights at memory speed):
// the float with 2^23's exponent and u in its mantissa is 2^23 + u, and subtracting 2^23 +
// offset is exact.
__device__ __forceinline__ float minus(uint32_t u, float offset) {
  return __uint_as_float(0x4B000000u | u) - (8388608.0f + offset);
}

// Signed bytes `lo` (weights 4q..) and `hi` (16 + 4q..) times scale. Flipping each byte's top
// bit gives q + 128 unsigned.
__device__ __forceinline__ void signed_bytes(uint32_t lo, uint32_t hi, float scale, float w[8]) {
  lo ^= 0x80808080u, hi ^= 0x80808080u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = __fmul_rn(minus((lo >> (8 * i)) & 0xFFu, 128.0f), scale);
    w[4 + i] = __fmul_rn(minus((hi >> (8 * i)) & 0xFFu, 128.0f), scale);
  }
}

// Nibbles of four bytes (low: weights 4q.., high: 16 + 4q..) as (nibble - offset) * scale, then
// + min for Q4_1 (kMin).
template <bool kMin>
__device__ __forceinline__ void nibbles(uint32_t bytes, float offset, float scale, float min, float w[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t nibble = (bytes >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15u;
    const float v = __fmul_rn(minus(nibble, offset), scale);
    w[i] = kMin ? __fadd_rn(v, min) : v;
  }
}

// One row n of the weight, per format: Row(p, n), then decode(blk, q, w) for each block.
// kAlign: the byte alignment its loads need of the weight's start.
template <typename T>
struct DenseRow {
  static constexpr int kAlign = 4 * sizeof(T);
  const T* w;
  __device__ DenseRow(const LinearParams& p, int64_t n) : w(static_cast<const T*>(p.weight) + n * p.in_features) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    load4(w + blk * kBlockWeights + 4 * q, out);
    load4(w + blk * kBlockWeights + 16 + 4 * q, out + 4);
  }
};

// GGUF blocks (ggml's block_q8_0, block_q4_0, block_q4_1): float16 scale d (Q4_1 also a float16
// minimum m), then the quants; Q8_0: w = d * q; Q4_0: w = d * (q - 8); Q4_1: w = d * q + m.
template <int kBytes>
struct GgufRow {
  const uint8_t* w;
  __device__ GgufRow(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * (p.in_features / kBlockWeights * kBytes)) {}
  __device__ const uint8_t* block(int64_t blk) const { return w + blk * kBytes; }
};
struct Q8_0Row : GgufRow<34> {
  static constexpr int kAlign = 2;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    signed_bytes(load_u32_2aligned(b + 2 + 4 * q), load_u32_2aligned(b + 18 + 4 * q), half_at(b), out);
  }
};
struct Q4_0Row : GgufRow<18> {
  static constexpr int kAlign = 2;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    nibbles<false>(load_u32_2aligned(b + 2 + 4 * q), 8.0f, half_at(b), 0.0f, out);
  }
};
struct Q4_1Row : GgufRow<20> {
  static constexpr int kAlign = 4;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    nibbles<true>(load_u32(b + 4 + 4 * q), 0.0f, half_at(b), half_at(b + 2), out);
  }
};

// Octavo's load-time formats (ops.h): int8, w = q * s per row; int4, w = (q - z) * s per row and
// group of group_size inputs, nibbles ordered as GGUF's.
struct Int8Row {
  static constexpr int kAlign = 4;
  const int8_t* w;
  float scale;
  __device__ Int8Row(const LinearParams& p, int64_t n)
      : w(static_cast<const int8_t*>(p.weight) + n * p.in_features), scale(p.scales[n]) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(w + blk * kBlockWeights);
    signed_bytes(load_u32(b + 4 * q), load_u32(b + 16 + 4 * q), scale, out);
  }
};
struct Int4Row {
  static constexpr int kAlign = 4;
  const uint8_t* w;
  const float* scales;
  const uint8_t* zeros;
  int32_t blocks_per_group;
  __device__ Int4Row(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * (p.in_features / 2)),
        scales(p.scales + n * (p.in_features / p.group_size)),
        zeros(p.zeros + n * (p.in_features / p.group_size)),
        blocks_per_group(static_cast<int32_t>(p.group_size / kBlockWeights)) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const int32_t g = static_cast<int32_t>(blk) / blocks_per_group;  // 32-bit: a 64-bit divide is a long call
    nibbles<false>(load_u32(w + blk * (kBlockWeights / 2) + 4 * q), static_cast<float>(zeros[g]), scales[g], 0.0f,
                   out);
  }
};

// The kR x kC dot products of weight rows w with input rows x over in_features, as linear_kernel
// and fused_moe's expert_gemv_kernel compute them: the block's kThreads threads walk the blocks
// of 32 weights, kParts threads per block (part q decodes weights 4q.. and 16 + 4q..), and each
// warp's sums are reduced by a butterfly into partial[warp][r][c]. Returns after a barrier;
// sum_partial then adds the warps in order, so a row's sum does not depend on the others.
template <int kThreads, typename Row, typename TIn, int kR, int kC>
__device__ __forceinline__ void dot_rows(const Row (&w)[kR], const TIn* const (&x)[kC], int64_t in_features,
                                         float (&partial)[kThreads / 32][kR][kC]) {
  const int q = threadIdx.x % kParts;
  float acc[kR][kC] = {};
  const int64_t blocks = in_features / kBlockWeights;
  for (int64_t blk = threadIdx.x / kParts; blk < blocks; blk += kThreads / kParts) {
    const int64_t k = blk * kBlockWeights + 4 * q;
    float xs[kC][8];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      load4(x[c] + k, xs[c]);
      load4(x[c] + k + 16, xs[c] + 4);
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      float ws[8];
      w[r].decode(blk, q, ws);
#pragma unroll
      for (int c = 0; c < kC; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r][c] = fmaf(ws[j], xs[c][j], acc[r][c]);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      float v = acc[r][c];
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0) partial[warp][r][c] = v;
    }
  __syncthreads();
}

template <int kWarps, int kR, int kC>
__device__ __forceinline__ float sum_partial(const float (&partial)[kWarps][kR][kC], int r, int c) {
  float sum = partial[0][r][c];
  for (int i = 1; i < kWarps; ++i) sum += partial[i][r][c];
  return sum;
}

}  // namespace octavo::cuda
