// linear for weight format int8_a8 (W8A8) on the vector levels; included by linear.cc in every ISA
// level, after linear_int8_inputs.h (the amx level runs it below linear_int8_tiles.h's
// tiles_from_rows).
//
// Each input row is rounded to int8 with one scale for the whole row (dynamic per token, as vLLM's
// W8A8): a = rint(x * 127 / m) in double, m the row's largest |x|, d = m / 127 in float32, which is
// linear_int8_inputs.h's group_scale and round_values with the row as the one group. Then
//   out[i][n] = fma(float(sum over k of q[n][k] * a[i][k]), s[n] * d[i], 0) (+ bias[n]).
// The sum is an exact int32 (|q| <= 128, |a| <= 127, K <= 2^17 as ops/linear.cc checks), so it
// does not depend on the order of the additions: every level, row count, thread count and tile
// layout (the amx level's linear_int8_tiles.h) gives the same bits. A row with a non-finite input gives NaN outputs.
//
// The products: weights and inputs widened to int16, and vpmaddwd (vpdpwssd with AVX512-VNNI)
// sums pairs into int32 lanes. vpdpbusd would take the bytes as they are, but its first operand is
// unsigned: the inputs would need an offset of 128 and a correction by the weights' row sums. At
// decode the weight bytes bound the time, and prefill runs on AMX tiles where the CPU has them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "linear_int8_inputs.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace int8_a8 {

constexpr int kTileRows = 4;  // weight rows that share each load of the inputs
#if defined(__AVX512BW__)
constexpr int kInputRows = 4;  // 16 accumulators of 32 registers
constexpr int kStep = 32;      // inputs per vector
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec load_weights(const int8_t* q) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}
inline IVec load_inputs(const int16_t* a) { return _mm512_loadu_si512(a); }
inline IVec dot_add(IVec acc, IVec w, IVec a) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}
inline int32_t reduce(IVec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
constexpr int kInputRows = 2;  // 8 accumulators of 16 registers
constexpr int kStep = 16;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec load_weights(const int8_t* q) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}
inline IVec load_inputs(const int16_t* a) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)); }
inline IVec dot_add(IVec acc, IVec w, IVec a) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a)); }
inline int32_t reduce(IVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#else
constexpr int kInputRows = 1;
#endif

// The inputs rounded: a [rows, K] int16 (int8 values), d [rows].
struct RoundedRows {
  std::vector<int16_t> a;
  std::vector<float> d;
};

// Row x's inputs rounded into a (int8 values, widened) and its scale into d.
template <typename T>
void round_row(const T* x, int64_t K, int8_t* bytes, int16_t* a, float& d) {
  int8_inputs::round_into(x, K, d, bytes);  // a non-finite input: d is NaN, so is every output
  for (int64_t k = 0; k < K; ++k) a[k] = bytes[k];
}

template <typename T>
RoundedRows round_rows(const LinearParams& p) {
  const int64_t K = p.in_features;
  RoundedRows r{std::vector<int16_t>(p.rows * K), std::vector<float>(p.rows)};
  parallel_for(p.rows, int8_inputs::rounding_grain(p), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> bytes(K);
    for (int64_t i = begin; i < end; ++i)
      round_row(static_cast<const T*>(p.input) + i * p.in_stride, K, bytes.data(), r.a.data() + i * K, r.d[i]);
  });
  return r;
}

// sums[t][c] = weight row w[t] against rounded input row a + c * K, for c < M.
template <int M>
void dot_tile(const int8_t* const (&w)[kTileRows], const int16_t* a, int64_t K, int32_t sums[kTileRows][kInputRows]) {
#if defined(__AVX2__)
  IVec acc[kTileRows][M];
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) acc[t][c] = izero();
  for (int64_t k = 0; k < K; k += kStep) {
    IVec x[M];
    for (int c = 0; c < M; ++c) x[c] = load_inputs(a + c * K + k);
    for (int t = 0; t < kTileRows; ++t) {
      // Two tiles ahead, as linear.cc's kernels prefetch (once per cache line).
      if (k % 64 == 0) __builtin_prefetch(w[t] + k + 2 * kTileRows * K);
      const IVec q = load_weights(w[t] + k);
      for (int c = 0; c < M; ++c) acc[t][c] = dot_add(acc[t][c], q, x[c]);
    }
  }
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) sums[t][c] = reduce(acc[t][c]);
#else
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += w[t][k] * a[c * K + k];
      sums[t][c] = sum;
    }
#endif
}

// out[i][n] from the exact sum, as the header says (the tiles' epilogue is the same vfmadd).
inline float scaled(int32_t sum, float s, float d) { return std::fma(static_cast<float>(sum), s * d, 0.0f); }

template <typename T>
void linear(const LinearParams& p) {
  const int64_t K = p.in_features;
  const RoundedRows r = round_rows<T>(p);
  const int64_t tiles = (p.out_features + kTileRows - 1) / kTileRows;
  // About one contiguous run of weight rows per thread; small weights on the calling thread.
  const int64_t threads = get_num_threads();
  const int64_t grain = p.out_features * K < (int64_t{1} << 18) ? tiles : (tiles + threads - 1) / threads;
  const T* bias = static_cast<const T*>(p.bias);
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    int32_t sums[kTileRows][kInputRows];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kTileRows;
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, p.out_features - n));
      const int8_t* w[kTileRows];  // rows past nr repeat row n (their results are dropped)
      for (int t = 0; t < kTileRows; ++t) w[t] = static_cast<const int8_t*>(p.weight) + (n + (t < nr ? t : 0)) * K;
      const auto store = [&](int64_t i, int count) {
        for (int c = 0; c < count; ++c) {
          T* out = static_cast<T*>(p.out) + (i + c) * p.out_stride + n;
          for (int t = 0; t < nr; ++t) {
            const float y = scaled(sums[t][c], p.scales[n + t], r.d[i + c]);
            out[t] = from_float<T>(bias != nullptr ? y + to_float(bias[n + t]) : y);
          }
        }
      };
      int64_t i = 0;
      for (; i + kInputRows <= p.rows; i += kInputRows) {
        dot_tile<kInputRows>(w, r.a.data() + i * K, K, sums);
        store(i, kInputRows);
      }
      for (; i < p.rows; ++i) {  // the rest one at a time: a row's sums do not depend on its neighbours
        dot_tile<1>(w, r.a.data() + i * K, K, sums);
        store(i, 1);
      }
    }
  });
}

}  // namespace int8_a8
}  // namespace octavo::cpu::OCTAVO_ISA
