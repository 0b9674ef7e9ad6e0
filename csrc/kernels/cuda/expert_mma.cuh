// fused_moe's projections on tensor cores, for 16-bit activations and batches that give each
// expert tens of rows (prefill): a grouped GEMM over moe_align's blocks of kMmaPairs pairs, each
// block one expert's, so a CUDA block multiplies kMmaPairs gathered input rows by a tile of its
// expert's weight rows with m16n8k16 mma.
//
// Tiles: kMmaPairs (64) rows × kMmaRows (64) weight rows, 4 warps in a 2 × 2 grid, each 32 rows ×
// 32 weight rows (2 m-tiles × 4 n-tiles of C fragments), K in steps of 32 (a weight block). Each
// step's input rows and dense weight rows are copied with cp.async into one of two buffers while
// the other is multiplied; quantized weight rows are decoded by linear's row decoders into the
// buffer as 16-bit values (the floats `dequantize` writes, rounded to the activations' type).
//
// The gated pass lays each warp's 32 weight rows out as 16 gate rows and the 16 up rows of the
// same features, so the thread that holds gate[f] in its C fragments also holds up[f]: it stores
// silu(gate) * up, rounded to the activations' type (the down pass multiplies 16-bit values).
#pragma once

#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "weight_rows.cuh"

namespace octavo::cuda {

constexpr int kMmaPairs = 64;    // rows (pairs) per block of moe_align and per CUDA block
constexpr int kMmaRows = 64;     // weight rows per CUDA block
constexpr int kMmaThreads = 128;
constexpr int kMmaLd = kBlockWeights + 8;  // shared row stride in elements: 80 bytes, ldmatrix conflict-free
constexpr int kMmaTile = (kMmaPairs + kMmaRows) * kMmaLd;  // one buffer: input rows, then weight rows
constexpr size_t kMmaSharedBytes = 2 * kMmaTile * 2;       // two buffers of 16-bit elements

// The weight row that row j of a tile (0..63) holds, clamped into the expert (rows past it are
// computed, never stored). Gated: warp column wn = j / 32 holds gate rows for features n0 + 16 wn
// + (0..15), then the up rows of the same features; else row n0 + j.
template <bool kGated>
__device__ __forceinline__ int64_t tile_weight_row(int64_t n0, int j, int64_t features) {
  if (!kGated) return min64(n0 + j, features - 1);
  const int64_t f = min64(n0 + 16 * (j / 32) + j % 16, features - 1);
  return j % 32 < 16 ? f : features + f;
}

// Copies (or decodes) step `blk`'s 32 columns of the block's input rows and weight rows into
// `tile`. Thread i takes chunks i and i + kMmaThreads of each: (row, 8 columns) of the inputs,
// (row, part) of the weights.
template <typename T, typename Row>
__device__ __forceinline__ void load_mma_step(const T* const (&x)[2], const bool (&x_real)[2], const Row (&w)[2],
                                              const T* const (&w_dense)[2], int64_t blk, T* tile) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int chunk = threadIdx.x + h * kMmaThreads, r = chunk / 4, part = chunk % 4;
    copy_async_16(tile + r * kMmaLd + 8 * part, x[h] + blk * kBlockWeights + 8 * part, !x_real[h]);
    T* w_row = tile + (kMmaPairs + r) * kMmaLd;
    if constexpr (std::is_same_v<Row, DenseRow<T>>) {
      copy_async_16(w_row + 8 * part, w_dense[h] + blk * kBlockWeights + 8 * part, false);
    } else {
      float v[8];
      w[h].decode(blk, part, v);  // weights 4 part + (0..3) and 16 + 4 part + (0..3)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(w_row + 16 * half + 4 * part);
        dst[0] = pack_pair<T>(v[4 * half], v[4 * half + 1]);
        dst[1] = pack_pair<T>(v[4 * half + 2], v[4 * half + 3]);
      }
    }
  }
}

// One 32-column step of the warp's 32 × 32 product: c[i][n] is m-tile i (rows 16 i..) and n-tile n
// (weight rows 8 n..) of the warp's part.
template <typename T>
__device__ __forceinline__ void multiply_mma_step(const T* tile, int wm, int wn, int lane, float (&c)[2][4][4]) {
  const T* a_rows = tile + 32 * wm * kMmaLd;
  const T* b_rows = tile + (kMmaPairs + 32 * wn) * kMmaLd;
#pragma unroll
  for (int k = 0; k < kBlockWeights; k += 16) {
    uint32_t a[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      load_matrix_x4<false>(a[i], a_rows + (16 * i + lane % 16) * kMmaLd + k + (lane / 16) * 8);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      uint32_t b[4];
      load_matrix_x4<false>(b, b_rows + (16 * u + (lane / 16) * 8 + lane % 8) * kMmaLd + k + (lane / 8 % 2) * 8);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mma_16x8x16<T>(c[i][2 * u], a[i], b[0], b[1]);
        mma_16x8x16<T>(c[i][2 * u + 1], a[i], b[2], b[3]);
      }
    }
  }
}

}  // namespace octavo::cuda
