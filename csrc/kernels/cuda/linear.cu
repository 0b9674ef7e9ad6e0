// linear and dequantize on CUDA, for every WeightFormat.
//
// linear is for the small row counts of decode steps, where a projection is a matrix-vector
// product: each weight byte is used once per step, so the kernel only has to stream the weight
// at memory speed while decoding it in registers. (Larger M goes to torch's GEMM on the weights
// `dequantize` writes; python/octavo/layers/linear.py picks.) Dense bfloat16 / float16 weights
// have a kernel of their own, dense_gemv_kernel, with nothing to decode; what follows is
// linear_kernel, which takes the quantized formats and dense float32.
//
// Work split: a CUDA block computes kRows output features for up to kCols input rows. Its
// threads walk the rows' blocks of 32 weights, kParts threads per block: part q decodes weights
// 4q..4q+3 and 16+4q..16+4q+3 of the block (in the 4-bit formats, the four bytes whose low and
// high nibbles hold them) for each of the kRows rows and multiplies them with the same 8 inputs
// of each input row. Adjacent threads read adjacent bytes, so a warp reads one contiguous span
// of each weight row. K is split over all of the block's threads rather than one warp per row,
// so that a 4096-row projection still has enough warps per SM, each with loads in flight, to
// keep the memory busy. The partial sums are reduced in a fixed order (a butterfly in each warp,
// then the warps in order) that does not depend on M: a row's output is the same bits whatever
// the batch. The formats' row decoders are in weight_rows.cuh.
#include <type_traits>

#include "common.cuh"
#include "cuda_kernels.h"
#include "weight_rows.cuh"

namespace octavo::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 4;  // output features per CUDA block
constexpr int kCols = 4;  // input rows per CUDA block, at most

// ---- linear --------------------------------------------------------------------------------

// Blocks are numbered input-row chunk fastest: the chunks of one weight tile run at about the
// same time, so at M > kCols the weight comes from memory once and from L2 for the others.
template <typename T, typename Row, int kC>
__global__ void __launch_bounds__(kThreads) linear_kernel(LinearParams p) {
  __shared__ float partial[kThreads / 32][kRows][kC];
  const int64_t chunks = (p.rows + kC - 1) / kC;
  const int64_t m0 = blockIdx.x % chunks * kC, n0 = blockIdx.x / chunks * kRows;
  const T* x[kC];  // rows past M repeat the last one, and rows past N the last row: not stored
#pragma unroll
  for (int c = 0; c < kC; ++c) x[c] = static_cast<const T*>(p.input) + min64(m0 + c, p.rows - 1) * p.in_stride;
  static_assert(kRows == 4, "w's initializer lists the rows");
  const Row w[kRows] = {Row(p, min64(n0, p.out_features - 1)), Row(p, min64(n0 + 1, p.out_features - 1)),
                        Row(p, min64(n0 + 2, p.out_features - 1)), Row(p, min64(n0 + 3, p.out_features - 1))};
  dot_rows<kThreads>(w, x, p.in_features, partial);
  if (threadIdx.x >= kRows * kC) return;
  const int r = threadIdx.x / kC, c = threadIdx.x % kC;
  const int64_t n = n0 + r, m = m0 + c;
  if (n >= p.out_features || m >= p.rows) return;
  float sum = sum_partial(partial, r, c);
  if (p.bias != nullptr) sum += to_float(static_cast<const T*>(p.bias)[n]);
  static_cast<T*>(p.out)[m * p.out_stride + n] = from_float<T>(sum);
}

// ---- dense 16-bit weights ------------------------------------------------------------------

// 16 bytes of T, read with one load.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
  T v[kSize];
};

// Measured on an H200 against 4 / 8 warps, 4 / 8 loads and 1 / 2 rows per warp (bench/RESULTS.md):
// within 5% of each other at M = 1, this the best of them.
constexpr int kGemvWarps = 4;   // output features per CUDA block, a warp each
constexpr int kGemvUnroll = 8;  // 16-byte weight loads in flight per lane

// A dense bfloat16 / float16 weight at decode-sized M: the bytes are all the work, so each warp
// streams one weight row in 16-byte loads, kGemvUnroll of them in flight per lane, against up to
// kC input rows (read through L1: every warp of the block reads the same ones). A lane sums the
// products of its packs in k order, then a butterfly sums the lanes: the same order for every M,
// so a row's output is the same bits whatever the batch. Blocks are numbered input-row chunk
// fastest, as linear_kernel's, so that at M > kC the weight comes from memory about once.
template <typename T, int kC>
__global__ void __launch_bounds__(kGemvWarps * 32) dense_gemv_kernel(LinearParams p) {
  constexpr int kVec = Pack<T>::kSize, kStep = 32 * kVec;
  const int64_t chunks = (p.rows + kC - 1) / kC;
  const int lane = threadIdx.x % 32;
  const int64_t n = blockIdx.x / chunks * kGemvWarps + threadIdx.x / 32, m0 = blockIdx.x % chunks * kC;
  if (n >= p.out_features) return;  // a whole warp: nothing below waits for the block
  const T* w = static_cast<const T*>(p.weight) + n * p.in_features;
  const T* x[kC];  // rows past M repeat the last one, not stored
#pragma unroll
  for (int c = 0; c < kC; ++c) x[c] = static_cast<const T*>(p.input) + min64(m0 + c, p.rows - 1) * p.in_stride;
  float acc[kC] = {};
  const auto fold = [&](const Pack<T>& wp, int64_t k) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const Pack<T> xp = *reinterpret_cast<const Pack<T>*>(x[c] + k);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[c] = fmaf(to_float(wp.v[j]), to_float(xp.v[j]), acc[c]);
    }
  };
  int64_t k = lane * kVec;
  for (; k + (kGemvUnroll - 1) * kStep < p.in_features; k += kGemvUnroll * kStep) {
    Pack<T> wp[kGemvUnroll];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) wp[u] = *reinterpret_cast<const Pack<T>*>(w + k + u * kStep);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) fold(wp[u], k + u * kStep);
  }
  for (; k < p.in_features; k += kStep) fold(*reinterpret_cast<const Pack<T>*>(w + k), k);
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    float v = acc[c];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    acc[c] = v;
  }
  if (lane != 0) return;
  const float bias = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[n]) : 0.0f;
#pragma unroll
  for (int c = 0; c < kC; ++c)
    if (m0 + c < p.rows) static_cast<T*>(p.out)[(m0 + c) * p.out_stride + n] = from_float<T>(acc[c] + bias);
}

// Whether dense_gemv_kernel can read p's weight and input rows in 16-byte packs.
template <typename T>
bool gemv_packs_fit(const LinearParams& p) {
  constexpr int kVec = Pack<T>::kSize;
  return aligned(p.weight, 16) && aligned(p.input, 16) && p.in_features % kVec == 0 && p.in_stride % kVec == 0;
}

template <typename T>
void launch_dense_gemv(const LinearParams& p) {
  const int64_t cols = p.rows >= kCols ? kCols : p.rows >= 2 ? 2 : 1;  // M = 3 computes one row twice
  const int64_t blocks = ceil_div(p.rows, cols) * ceil_div(p.out_features, kGemvWarps);
  OCTAVO_CHECK(blocks < (int64_t{1} << 31), "linear on CUDA: " << p.rows << " x " << p.out_features
                                                                 << " outputs are more than one launch covers");
  const dim3 grid(static_cast<unsigned>(blocks));
  if (cols == 1) launch_kernel(dense_gemv_kernel<T, 1>, grid, kGemvWarps * 32, 0, p);
  else if (cols == 2) launch_kernel(dense_gemv_kernel<T, 2>, grid, kGemvWarps * 32, 0, p);
  else launch_kernel(dense_gemv_kernel<T, kCols>, grid, kGemvWarps * 32, 0, p);
  check_launch("linear");
}

template <typename T, typename Row>
void launch_linear(const LinearParams& p) {
  OCTAVO_CHECK(aligned(p.weight, Row::kAlign), "linear on CUDA: the weight must start at a " << Row::kAlign
                                                   << "-byte boundary");
  OCTAVO_CHECK(aligned(p.input, 4 * sizeof(T)) && p.in_stride % 4 == 0,
               "linear on CUDA: input rows must start at 4-element boundaries (a contiguous input does)");
  const int64_t cols = p.rows >= kCols ? kCols : p.rows >= 2 ? 2 : 1;  // M = 3 computes one row twice
  const int64_t blocks = ceil_div(p.rows, cols) * ceil_div(p.out_features, kRows);
  OCTAVO_CHECK(blocks < (int64_t{1} << 31), "linear on CUDA: " << p.rows << " x " << p.out_features
                                                                 << " outputs are more than one launch covers");
  const dim3 grid(static_cast<unsigned>(blocks));
  if (cols == 1) launch_kernel(linear_kernel<T, Row, 1>, grid, kThreads, 0, p);
  else if (cols == 2) launch_kernel(linear_kernel<T, Row, 2>, grid, kThreads, 0, p);
  else launch_kernel(linear_kernel<T, Row, kCols>, grid, kThreads, 0, p);
  check_launch("linear");
}

// Calls fn(Row*) with the row decoder of p's quantized format.
template <typename Fn>
void dispatch_quantized(const LinearParams& p, Fn&& fn) {
  // int4_a8 and int8_a8: linear refuses them on CUDA (ops/linear.cc), dequantize reads their weights
  const WeightFormat format = p.weight_format == WeightFormat::kInt8A8   ? WeightFormat::kInt8
                              : p.weight_format == WeightFormat::kInt4A8 ? WeightFormat::kInt4
                                                                         : p.weight_format;
  // bf16_tiles: refused before launch (ops/linear.cc), CPU only
  OCTAVO_CHECK(format != WeightFormat::kDense && dispatch_rows<float>(format, fn),
               "not a quantized weight format on CUDA");
}

template <typename T>
void run_linear(const LinearParams& p) {
  if (p.weight_format == WeightFormat::kDense) {
    OCTAVO_CHECK(p.in_features % kBlockWeights == 0,
                 "linear on CUDA reads dense weights in rows of 32 inputs; got in_features " << p.in_features
                     << " (torch.nn.functional.linear takes any)");
    // float32 keeps linear_kernel, whose sums are the quantized formats' (a quantized weight gives
    // exactly what its dequantized float32 weights give).
    if constexpr (!std::is_same_v<T, float>) {
      if (gemv_packs_fit<T>(p)) return launch_dense_gemv<T>(p);
    }
    return launch_linear<T, DenseRow<T>>(p);
  }
  dispatch_quantized(p, [&](auto* row) { launch_linear<T, std::remove_pointer_t<decltype(row)>>(p); });
}

// ---- dequantize ----------------------------------------------------------------------------

// One thread per part of a block: out[n, blk * 32 + ...] for its 8 weights, rounded to TOut.
// 32-bit indices (the launcher checks they fit): a 64-bit division is a long instruction sequence.
template <typename TOut, typename Row>
__global__ void __launch_bounds__(256) dequantize_kernel(LinearParams p) {
  const uint32_t blocks = static_cast<uint32_t>(p.in_features / kBlockWeights);
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= static_cast<uint32_t>(p.out_features) * blocks * kParts) return;
  const int q = static_cast<int>(i % kParts);
  const uint32_t blk = i / kParts % blocks, n = i / kParts / blocks;
  float w[8];
  Row(p, n).decode(blk, q, w);
  TOut* out = static_cast<TOut*>(p.out) + n * p.in_features + blk * kBlockWeights + 4 * q;
  store4(out, w);
  store4(out + 16, w + 4);
}

template <typename TOut, typename Row>
void launch_dequantize(const LinearParams& p) {
  OCTAVO_CHECK(aligned(p.weight, Row::kAlign), "dequantize on CUDA: the weight must start at a " << Row::kAlign
                                                   << "-byte boundary");
  OCTAVO_CHECK(aligned(p.out, 4 * sizeof(TOut)), "dequantize on CUDA: out must start at a 4-element boundary");
  constexpr int kBlockThreads = 256;
  const int64_t threads = p.out_features * (p.in_features / kBlockWeights) * kParts;
  OCTAVO_CHECK(threads < (int64_t{1} << 32) - kBlockThreads,
               "dequantize on CUDA: " << p.out_features << " x " << p.in_features << " weights are more than one "
                                      << "launch covers; dequantize slabs of rows");
  launch_kernel(dequantize_kernel<TOut, Row>, dim3(static_cast<unsigned>(ceil_div(threads, kBlockThreads))),
                kBlockThreads, 0, p);
  check_launch("dequantize");
}

}  // namespace

void linear(const LinearParams& p) {
  if (p.tensor_cores) return linear_mma(p);
  if (p.rows == 0 || p.out_features == 0) return;
  dispatch_float(p.dtype, "linear", [&](auto t) { run_linear<decltype(t)>(p); });
}

void dequantize(const LinearParams& p) {
  if (p.out_features == 0 || p.in_features == 0) return;
  dispatch_float(p.dtype, "dequantize", [&](auto t) {
    dispatch_quantized(p, [&](auto* row) { launch_dequantize<decltype(t), std::remove_pointer_t<decltype(row)>>(p); });
  });
}

}  // namespace octavo::cuda
