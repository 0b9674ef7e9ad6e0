// linear: out = input · weightᵀ (+ bias) for the small row counts of decode steps.
//
// At M = 1 a projection is a matrix-vector product: each weight byte is used once, so the kernel
// only has to stream the weight at memory speed. It walks tiles of kRows weight rows; for each
// group of up to kCols input rows it keeps kRows x kCols vector accumulators live across the K
// loop (the weight tile stays in L1 while the input groups of a larger M pass over it), and
// reduces each accumulator once at the end. Threads split the output features, so every thread
// streams its own contiguous slab of the weight. Each output element is the same sum in the same
// order whatever M is and whichever thread computes it (batch invariant).
#include "isa_kernels.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

constexpr int kRows = 4;  // weight rows per tile
constexpr int kCols = 4;  // input rows per accumulator group: kRows * kCols accumulators
// Weight rows are software-prefetched this far ahead (two tiles), as insurance for the many
// short row streams of a decode step's small matrices; on the development machine it measured
// neutral within the bandwidth drift, and it costs one instruction per cache line.
constexpr int64_t kPrefetchRows = 2 * kRows;
// Below this many weight elements the job runs on the calling thread (waking the pool costs
// more than it saves for the tiny matrices of tests).
constexpr int64_t kSerialWeightElems = 1 << 16;

// acc[r][c] = dot(w[r], x[c]) over K, for nr <= kRows weight rows and NC input rows.
template <int NC, typename T>
void dot_tile(const T* w, int64_t K, int nr, const T* x, int64_t x_stride, float acc_out[kRows][kCols]) {
  VecF acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = VecF::zero();
  const T* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (r < nr ? r : 0) * K;  // missing rows repeat row 0
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    VecF xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = VecF::load(x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      if ((k * sizeof(T)) % 64 == 0) __builtin_prefetch(wr[r] + k + kPrefetchRows * K);
      const VecF wv = VecF::load(wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = fma(wv, xv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const int m = static_cast<int>(K - k);
    VecF xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = load_partial(x + c * x_stride + k, m);
    for (int r = 0; r < kRows; ++r) {
      const VecF wv = load_partial(wr[r] + k, m);
      for (int c = 0; c < NC; ++c) acc[r][c] = fma(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc_out[r][c] = reduce_add(acc[r][c]);
}

#if defined(__AVX512BF16__)
// bfloat16 on CPUs with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs and adds them pairwise
// into 16 float32 lanes, so one instruction consumes a whole cache line of each operand and no
// conversions are needed. (It flushes denormal inputs to zero; their products lie far below the
// float32 sums' resolution, so results match the FMA path within rounding.)
template <int NC>
void dot_tile(const bf16* w, int64_t K, int nr, const bf16* x, int64_t x_stride, float acc_out[kRows][kCols]) {
  __m512 acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const bf16* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (r < nr ? r : 0) * K;
  int64_t k = 0;
  // Plain loads in the main loop and the masked tail written out apart: with one masked loop
  // body GCC stores every accumulator to the stack on each iteration.
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = (__m512bh)_mm512_loadu_si512(x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      __builtin_prefetch(wr[r] + k + kPrefetchRows * K);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);
    }
  }
  if (k < K) {  // masked-off lanes load zeros, which add nothing
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc_out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

template <typename T>
void dot_tile_any(int nc, const T* w, int64_t K, int nr, const T* x, int64_t x_stride, float acc[kRows][kCols]) {
  switch (nc) {
    case 1: return dot_tile<1>(w, K, nr, x, x_stride, acc);
    case 2: return dot_tile<2>(w, K, nr, x, x_stride, acc);
    case 3: return dot_tile<3>(w, K, nr, x, x_stride, acc);
    default: return dot_tile<4>(w, K, nr, x, x_stride, acc);
  }
}

// Output features [n_begin, n_end) of every row.
template <typename T>
void linear_slab(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  const T* weight = static_cast<const T*>(p.weight);
  const T* input = static_cast<const T*>(p.input);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const int64_t K = p.in_features;
  float acc[kRows][kCols];
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int nr = static_cast<int>(n_end - n < kRows ? n_end - n : kRows);
    for (int64_t m = 0; m < p.rows; m += kCols) {
      const int nc = static_cast<int>(p.rows - m < kCols ? p.rows - m : kCols);
      dot_tile_any(nc, weight + n * K, K, nr, input + m * p.in_stride, p.in_stride, acc);
      for (int c = 0; c < nc; ++c)
        for (int r = 0; r < nr; ++r) {
          const float b = bias != nullptr ? to_float(bias[n + r]) : 0.0f;
          out[(m + c) * p.out_stride + n + r] = from_float<T>(acc[r][c] + b);
        }
    }
  }
}

template <typename T>
void run_linear(const LinearParams& p) {
  const int64_t tiles = (p.out_features + kRows - 1) / kRows;
  const int threads = get_num_threads();
  // One contiguous slab per thread: each streams its part of the weight front to back.
  const int64_t grain = p.out_features * p.in_features < kSerialWeightElems ? tiles : (tiles + threads - 1) / threads;
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    const int64_t n_end = end * kRows < p.out_features ? end * kRows : p.out_features;
    linear_slab<T>(p, begin * kRows, n_end);
  });
}

}  // namespace

void linear(const LinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return run_linear<float>(p);
    case DType::kBFloat16: return run_linear<bf16>(p);
    case DType::kFloat16: return run_linear<f16>(p);
    default: OCTAVO_CHECK(false, "linear: unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
