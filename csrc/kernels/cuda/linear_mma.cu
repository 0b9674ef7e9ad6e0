// linear on tensor cores (WeightQuant::tensor_cores): bfloat16 / float16 input rows times a weight
// in any format CUDA reads, up to 16 input rows per read of the weight. The design is Marlin's
// (Frantar et al., 2024): at decode batch sizes a GEMV's time grows with M because every weight
// it decodes is multiplied on the FP32 units once per input row, while an m16n8k16 mma multiplies
// 16 rows for the price of one; the weight is decoded once, in registers, straight into the B
// fragments, and the kernel stays bound by the weight's bytes up to M = 16.
//
// Work split: a CUDA block computes kTileRows (8, the mma's N) output features for 16 input rows
// (the mma's M; rows past M are zeros, computed and not stored). Its kWarps warps split K: each
// walks runs of kUnroll consecutive blocks of 32 weights, the block's warps side by side, so that
// a row's bytes are read contiguously kWarps * kUnroll blocks at a time. Lane (g, t) = (lane / 4,
// lane % 4) decodes part t of weight row n0 + g with the formats' row decoders (weight_rows.cuh):
// weights 4t..4t+3 and 16+4t..16+4t+3 of each block, which are B's elements for its 16-wide K
// slices once K is renumbered within a slice (logical 2t + j <-> stored 4t + j, logical 8 + 2t + j
// <-> stored 4t + 2 + j). A's elements take the same renumbering, which makes them two 4-element
// loads of each input row. A dot product does not depend on the order of its terms' indices, only
// of its sums, so the product is that of the weight as stored.
//
// The decoded floats are rounded to the inputs' type before they are multiplied: the result is
// that of the weights `dequantize` writes in that type, as torch's GEMM on them gives above
// layers/linear.py's kernel row limit, not linear_kernel's float32 products. The warps' sums are
// added in a fixed order, so a row's output does not depend on M.
#include <type_traits>

#include "common.cuh"
#include "cuda_kernels.h"
#include "mma.cuh"
#include "weight_rows.cuh"

namespace octavo::cuda {
namespace {

constexpr int kWarps = 4;     // K is split over a block's warps
constexpr int kUnroll = 4;    // blocks of 32 weights a warp decodes per step, their loads in flight together
constexpr int kTileRows = 8;  // output features per CUDA block: the mma's N
constexpr int kTileInputs = 16;  // input rows per CUDA block: the mma's M

// Elements 4t..4t+3 of an input row (two A registers' pairs), or zeros for a row past M.
template <typename T>
__device__ __forceinline__ uint2 input_quad(const T* row, int64_t k) {
  return row != nullptr ? *reinterpret_cast<const uint2*>(row + k) : make_uint2(0u, 0u);
}

// c += the product of kSteps consecutive blocks from `blk` on: all of their loads first, then the
// mma of each 16-wide slice.
template <typename T, typename Row, int kSteps>
__device__ __forceinline__ void multiply_blocks(const Row& w, const T* x_lo, const T* x_hi, int64_t blk, int t,
                                                float (&c)[4]) {
  float v[kSteps][8];
  uint2 lo[kSteps][2], hi[kSteps][2];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    w.decode(blk + s, t, v[s]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t k = (blk + s) * kBlockWeights + 16 * h + 4 * t;
      lo[s][h] = input_quad(x_lo, k);
      hi[s][h] = input_quad(x_hi, k);
    }
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t a[4] = {lo[s][h].x, hi[s][h].x, lo[s][h].y, hi[s][h].y};
      mma_16x8x16<T>(c, a, pack_pair<T>(v[s][4 * h], v[s][4 * h + 1]), pack_pair<T>(v[s][4 * h + 2], v[s][4 * h + 3]));
    }
}

// Blocks are numbered input-row tile fastest, as linear_kernel's: above 16 rows the tiles of one
// weight tile run at about the same time, and the weight comes from memory about once.
template <typename T, typename Row>
__global__ void __launch_bounds__(kWarps * 32) mma_linear_kernel(LinearParams p) {
  __shared__ float partial[kWarps][32][4];
  const int64_t tiles = ceil_div(p.rows, kTileInputs);
  const int64_t m0 = blockIdx.x % tiles * kTileInputs, n0 = blockIdx.x / tiles * kTileRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const Row w(p, min64(n0 + g, p.out_features - 1));  // rows past N repeat the last: not stored
  const T* input = static_cast<const T*>(p.input);
  const T* x_lo = m0 + g < p.rows ? input + (m0 + g) * p.in_stride : nullptr;
  const T* x_hi = m0 + g + 8 < p.rows ? input + (m0 + g + 8) * p.in_stride : nullptr;
  float c[4] = {};
  constexpr int kRun = kWarps * kUnroll;
  const int64_t blocks = p.in_features / kBlockWeights, whole = blocks / kRun * kRun;
  for (int64_t blk = warp * kUnroll; blk < whole; blk += kRun) multiply_blocks<T, Row, kUnroll>(w, x_lo, x_hi, blk, t, c);
  for (int64_t blk = whole + warp; blk < blocks; blk += kWarps) multiply_blocks<T, Row, 1>(w, x_lo, x_hi, blk, t, c);
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = c[i];
  __syncthreads();
  if (warp != 0) return;
  // C fragment: c[i] is input row g (i < 2) or g + 8, feature 2t + i % 2.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + g + 8 * (i / 2), n = n0 + 2 * t + i % 2;
    if (m >= p.rows || n >= p.out_features) continue;
    float sum = partial[0][lane][i];
    for (int j = 1; j < kWarps; ++j) sum += partial[j][lane][i];
    if (p.bias != nullptr) sum += to_float(static_cast<const T*>(p.bias)[n]);
    static_cast<T*>(p.out)[m * p.out_stride + n] = from_float<T>(sum);
  }
}

template <typename T, typename Row>
void launch_mma_linear(const LinearParams& p) {
  OCTAVO_CHECK(aligned(p.weight, Row::kAlign), "linear on CUDA: the weight must start at a " << Row::kAlign
                                                   << "-byte boundary");
  OCTAVO_CHECK(aligned(p.input, 4 * sizeof(T)) && p.in_stride % 4 == 0,
               "linear on CUDA: input rows must start at 4-element boundaries (a contiguous input does)");
  const int64_t blocks = ceil_div(p.rows, kTileInputs) * ceil_div(p.out_features, kTileRows);
  OCTAVO_CHECK(blocks < (int64_t{1} << 31), "linear on CUDA: " << p.rows << " x " << p.out_features
                                                                 << " outputs are more than one launch covers");
  launch_kernel(mma_linear_kernel<T, Row>, dim3(static_cast<unsigned>(blocks)), kWarps * 32, 0, p);
  check_launch("linear");
}

}  // namespace

void linear_mma(const LinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  OCTAVO_CHECK(p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16,
               "linear on tensor cores multiplies bfloat16 or float16 inputs, got " << dtype_name(p.dtype));
  OCTAVO_CHECK(p.in_features % kBlockWeights == 0,
               "linear on CUDA reads weights in rows of 32 inputs; got in_features " << p.in_features);
  dispatch_float(p.dtype, "linear", [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, float>) {
      OCTAVO_CHECK(dispatch_rows<T>(p.weight_format, [&](auto* row) {
                     launch_mma_linear<T, std::remove_pointer_t<decltype(row)>>(p);
                   }),
                   "linear on CUDA: weight format " << weight_format_name(p.weight_format) << " is not read on CUDA");
    }
  });
}

}  // namespace octavo::cuda
