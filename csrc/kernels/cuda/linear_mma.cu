// linear on tensor cores (WeightQuant::tensor_cores): bfloat16 / float16 input rows times a weight
// in any format CUDA reads, up to 16 input rows per read of the weight. The design is Marlin's
// (Frantar et al., 2024): at decode batch sizes a GEMV's time grows with M because every weight
// it decodes is multiplied on the FP32 units once per input row, while an m16n8k16 mma multiplies
// 16 rows for the price of one; the weight is decoded once, in registers, straight into the B
// fragments, and the kernel stays bound by the weight's bytes up to M = 16.
//
// Work split: a CUDA block computes kBlockRows output features (kTiles n-tiles of 8, the mma's
// N) for 16 input rows (the mma's M; rows past M are zeros, computed and not stored). Its kWarps
// warps split K: a warp's step takes 4 consecutive blocks of 32 weights, the warps' steps side by
// side, so the block reads a run of 4 * kWarps blocks of each row at a time.
//
// Lane (g, t) = (lane / 4, lane % 4) decodes block `step + t` of rows n0 + 8j + g (n-tile j)
// whole (decode_block: one 16-byte load for int4, two for int8 / fp8), so the four lanes of a row
// read 64 (int4) or 128 contiguous bytes. The mma does not need a lane's B elements to be the
// K indices the PTX layout names: lane t's elements of logical columns 2t, 2t + 1, 2t + 8, 2t + 9
// of k-slice i are weights 4i .. 4i + 3 of its own block, and A's elements of the same logical
// columns are the same weights' inputs: the lane reads its block's 32 inputs of rows g and g + 8
// (four 16-byte loads each) and has every k-slice's A registers. (A dot product does not depend
// on how its terms are numbered, only on the order of its sums.) Each A fragment serves the
// kTiles n-tiles, each B fragment the 16 input rows.
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

// Not yet measured on a GPU: kWarps and kTiles are the knobs (ptxas: 134-180 registers a thread
// for the 4-bit and 8-bit formats at sm_90, so one 256-thread block per SM, each lane with 4
// weight loads of 16 bytes and 8 input loads in flight).
constexpr int kWarps = 8;        // K is split over a block's warps
constexpr int kTiles = 4;        // n-tiles of 8 output features per CUDA block, each A fragment used once per tile
constexpr int kBlockRows = 8 * kTiles;
constexpr int kTileInputs = 16;  // input rows per CUDA block: the mma's M
constexpr int kStepBlocks = 4;   // blocks of 32 weights in a warp's step: one per lane of a quad

// The 32 inputs of block blk of an input row as 16 pairs (pair i: inputs 2i, 2i + 1), from four
// 16-byte loads; zeros for a row past M or a block past K.
template <typename T>
__device__ __forceinline__ void load_inputs(const T* row, int64_t blk, bool real, uint32_t (&pairs)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = real ? reinterpret_cast<const uint4*>(row + blk * kBlockWeights)[i] : make_uint4(0u, 0u, 0u, 0u);
    pairs[4 * i] = v.x, pairs[4 * i + 1] = v.y, pairs[4 * i + 2] = v.z, pairs[4 * i + 3] = v.w;
  }
}

// c[j] += the products of the lane's block `blk` (its quad's step) for n-tile j: every row's
// block decoded first, so that all of the lane's loads are in flight together, then 8 k-slices
// of 4 weights each.
template <typename T, typename Row>
__device__ __forceinline__ void multiply_step(const Row (&w)[kTiles], const T* x_lo, const T* x_hi, int64_t blk,
                                              bool real, float (&c)[kTiles][4]) {
  uint32_t b[kTiles][16];  // pair i of row j's block: weights 2i, 2i + 1 in T
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    float v[kBlockWeights] = {};
    if (real) decode_block(w[j], blk, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) b[j][i] = pack_pair<T>(v[2 * i], v[2 * i + 1]);
  }
  uint32_t lo[16], hi[16];
  load_inputs(x_lo, blk, real && x_lo != nullptr, lo);
  load_inputs(x_hi, blk, real && x_hi != nullptr, hi);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t a[4] = {lo[2 * i], hi[2 * i], lo[2 * i + 1], hi[2 * i + 1]};
#pragma unroll
    for (int j = 0; j < kTiles; ++j) mma_16x8x16<T>(c[j], a, b[j][2 * i], b[j][2 * i + 1]);
  }
}

// Blocks are numbered input-row tile fastest, as linear_kernel's: above 16 rows the tiles of one
// weight tile run at about the same time, and the weight comes from memory about once.
template <typename T, typename Row>
__global__ void __launch_bounds__(kWarps * 32) mma_linear_kernel(LinearParams p) {
  __shared__ float partial[kWarps][kTiles][32][4];
  const int64_t tiles = ceil_div(p.rows, kTileInputs);
  const int64_t m0 = blockIdx.x % tiles * kTileInputs, n0 = blockIdx.x / tiles * kBlockRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  static_assert(kTiles == 4, "w's initializer lists the tiles");
  const Row w[kTiles] = {Row(p, min64(n0 + g, p.out_features - 1)), Row(p, min64(n0 + 8 + g, p.out_features - 1)),
                         Row(p, min64(n0 + 16 + g, p.out_features - 1)),
                         Row(p, min64(n0 + 24 + g, p.out_features - 1))};  // rows past N repeat the last: not stored
  const T* input = static_cast<const T*>(p.input);
  const T* x_lo = m0 + g < p.rows ? input + (m0 + g) * p.in_stride : nullptr;
  const T* x_hi = m0 + g + 8 < p.rows ? input + (m0 + g + 8) * p.in_stride : nullptr;
  float c[kTiles][4] = {};
  const int64_t blocks = p.in_features / kBlockWeights;
  for (int64_t step = warp * kStepBlocks; step < blocks; step += kWarps * kStepBlocks)
    multiply_step<T, Row>(w, x_lo, x_hi, step + t, step + t < blocks, c);
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][j][lane][i] = c[j][i];
  __syncthreads();
  if (warp >= kTiles) return;
  // Warp j stores n-tile j. C fragment: element i is input row g (i < 2) or g + 8, feature 2t + i % 2.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + g + 8 * (i / 2), n = n0 + 8 * warp + 2 * t + i % 2;
    if (m >= p.rows || n >= p.out_features) continue;
    float sum = partial[0][warp][lane][i];
    for (int k = 1; k < kWarps; ++k) sum += partial[k][warp][lane][i];
    if (p.bias != nullptr) sum += to_float(static_cast<const T*>(p.bias)[n]);
    static_cast<T*>(p.out)[m * p.out_stride + n] = from_float<T>(sum);
  }
}

template <typename T, typename Row>
void launch_mma_linear(const LinearParams& p) {
  constexpr int kAlign = block_align<Row>();
  OCTAVO_CHECK(aligned(p.weight, kAlign), "linear on tensor cores: the weight must start at a " << kAlign
                                              << "-byte boundary");
  OCTAVO_CHECK(aligned(p.input, 16) && p.in_stride % (16 / sizeof(T)) == 0,
               "linear on tensor cores: input rows must start at 16-byte boundaries (a contiguous input does)");
  const int64_t blocks = ceil_div(p.rows, kTileInputs) * ceil_div(p.out_features, kBlockRows);
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
