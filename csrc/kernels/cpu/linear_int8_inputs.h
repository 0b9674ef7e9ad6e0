// linear for weight format int4_a8 (W4A8), included by linear.cc in every ISA level.
//
// Each input row is first rounded to int8 with one scale per weight group: a = rint(x * 127 / m)
// (in double, ties to even), m the group's largest |x|, d = m / 127 rounded to float32. Then out[i][n] = sum over groups g of
// s[n][g] * d[i][g] * sum over k in g of (q[n][k] - z[n][g]) * a[i][k]. The inner sums are exact
// integers: four products per 32-bit lane in one instruction (vpdpbusd where the level has
// AVX512-VNNI, vpmaddubsw + vpmaddwd before it; the nibbles are unsigned, a signed), and the zero
// point comes off each lane as z times that lane's sum of a. Each group's lanes are then scaled in
// float32 and accumulated, and the lanes added once at the end of the row. So a 32-weight block
// costs one or two integer instructions per weight row instead of the float path's two
// multiply-adds per input row, and the only rounding after the inputs' is float32's on the
// per-group terms. Rows with a non-finite input in a group give NaN.
//
// The rounding of the inputs is plain scalar code: it is O(rows * K), the weights O(N * K).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace octavo::cpu::OCTAVO_ISA {
namespace int8_inputs {

constexpr int kTileRows = 4;  // weight rows that share each load of the inputs

#if defined(__AVX512BW__)
constexpr int kLanes = 16;  // 32-bit lanes per integer vector; each sums 4 products
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
// 64 weights: the 32 bytes of two blocks, whose low nibbles are weights 0-15 and high nibbles
// 16-31 of each, as bytes in weight order.
inline IVec load_weights(const uint8_t* q) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), low4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo0 lo1 hi0 hi1
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));           // lo0 hi0 lo1 hi1
}
// 32 weights (one block) in the low half, zeros above.
inline IVec load_weights_half(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  return _mm512_inserti32x4(_mm512_zextsi128_si512(lo), hi, 1);
}
inline IVec load_inputs(const int8_t* a) { return _mm512_loadu_si512(a); }
inline IVec load_inputs_half(const int8_t* a) {
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
}
inline IVec dot_add(IVec acc, IVec q, IVec a) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, q, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, a), _mm512_set1_epi16(1)));
#endif
}
// acc + float(sums - z * lane_sums) * scale, lane by lane.
inline __m512 add_group(__m512 acc, IVec sums, int32_t z, const int32_t* lane_sums, float scale) {
  const __m512i exact = _mm512_sub_epi32(sums, _mm512_mullo_epi32(_mm512_set1_epi32(z), _mm512_loadu_si512(lane_sums)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(scale), acc);
}
inline __m512 fzero() { return _mm512_setzero_ps(); }
inline float lanes_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
constexpr int kLanes = 8;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
// 32 weights (one block): a vector of 32 is one block here, so there is no half load.
inline IVec load_weights(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
}
inline IVec load_inputs(const int8_t* a) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)); }
inline IVec dot_add(IVec acc, IVec q, IVec a) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1)));
}
inline __m256 add_group(__m256 acc, IVec sums, int32_t z, const int32_t* lane_sums, float scale) {
  const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_sums));
  const __m256i exact = _mm256_sub_epi32(sums, _mm256_mullo_epi32(_mm256_set1_epi32(z), stored));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(scale), acc);
}
inline __m256 fzero() { return _mm256_setzero_ps(); }
inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int kLanes = 1;
#endif
constexpr int kVectorInputs = 4 * kLanes;  // inputs per integer vector (a chunk)

// The input rows rounded to int8: a [rows, K], d [rows, groups] and, per row and group, each
// lane's sum of a (lane l of a chunk holds its inputs 4l .. 4l + 3; a group's last, shorter
// chunk fills the low lanes).
struct RoundedInputs {
  std::vector<int8_t> a;
  std::vector<float> d;
  std::vector<int32_t> lane_sums;  // [rows, groups, kLanes]
};

// One group's inputs rounded: the products run in double, where 127 / m is finite for every
// positive float m (tiny subnormal groups included), so every level rounds alike.
template <typename T>
void round_group(const T* x, int64_t size, int8_t* a, float& d, int32_t* lane_sums) {
  float m = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < size; ++k) {
    const float v = to_float(x[k]);
    finite = finite && std::isfinite(v);
    m = std::fmax(m, std::fabs(v));
  }
  for (int l = 0; l < kLanes; ++l) lane_sums[l] = 0;
  if (!finite) {  // a = 0 and d = NaN: the group's term, and so the row's output, is NaN
    std::fill(a, a + size, int8_t{0});
    d = NAN;
    return;
  }
  const double inv = m > 0.0f ? 127.0 / m : 0.0;
  d = static_cast<float>(m / 127.0);
  for (int64_t k = 0; k < size; ++k) {
    const double r = std::nearbyint(static_cast<double>(to_float(x[k])) * inv);  // |r| <= 127
    a[k] = static_cast<int8_t>(std::fmin(127.0, std::fmax(-127.0, r)));
    lane_sums[k % kVectorInputs / 4] += a[k];
  }
}

template <typename T>
void round_inputs(const LinearParams& p, RoundedInputs& r) {
  const int64_t K = p.in_features, G = p.group_size, groups = K / G;
  r.a.resize(p.rows * K);
  r.d.resize(p.rows * groups);
  r.lane_sums.resize(p.rows * groups * kLanes);
  const T* input = static_cast<const T*>(p.input);
  for (int64_t i = 0; i < p.rows; ++i)
    for (int64_t g = 0; g < groups; ++g)
      round_group(input + i * p.in_stride + g * G, G, r.a.data() + i * K + g * G, r.d[i * groups + g],
                  r.lane_sums.data() + (i * groups + g) * kLanes);
}

// out[0, nr) = the weight rows n.. n + nr - 1 (rows past nr repeat row n) against input row i.
inline void dot_rows(const LinearParams& p, const RoundedInputs& r, int64_t i, int64_t n, int nr,
                     float out[kTileRows]) {
  const int64_t K = p.in_features, G = p.group_size, groups = K / G, row_bytes = K / 2;
  const int8_t* a = r.a.data() + i * K;
  const float* d = r.d.data() + i * groups;
  const int32_t* lanes = r.lane_sums.data() + i * groups * kLanes;
  const uint8_t* q[kTileRows];
  for (int t = 0; t < kTileRows; ++t) q[t] = static_cast<const uint8_t*>(p.weight) + (n + (t < nr ? t : 0)) * row_bytes;
  const auto scale = [&](int t, int64_t g) { return p.scales[(n + (t < nr ? t : 0)) * groups + g] * d[g]; };
  const auto zero = [&](int t, int64_t g) { return static_cast<int32_t>(p.zeros[(n + (t < nr ? t : 0)) * groups + g]); };
#if defined(__AVX2__)
  auto acc = fzero();
  decltype(acc) accs[kTileRows] = {acc, acc, acc, acc};
  for (int64_t g = 0; g < groups; ++g) {
    IVec sums[kTileRows] = {izero(), izero(), izero(), izero()};
    int64_t k = g * G;
    for (; k + kVectorInputs <= (g + 1) * G; k += kVectorInputs) {
      const IVec x = load_inputs(a + k);
      for (int t = 0; t < kTileRows; ++t) sums[t] = dot_add(sums[t], load_weights(q[t] + k / 2), x);
    }
#if defined(__AVX512BW__)
    if (k < (g + 1) * G) {  // groups of an odd number of blocks end with one
      const IVec x = load_inputs_half(a + k);
      for (int t = 0; t < kTileRows; ++t) sums[t] = dot_add(sums[t], load_weights_half(q[t] + k / 2), x);
    }
#endif
    for (int t = 0; t < kTileRows; ++t) accs[t] = add_group(accs[t], sums[t], zero(t, g), lanes + g * kLanes, scale(t, g));
  }
  for (int t = 0; t < kTileRows; ++t) out[t] = lanes_sum(accs[t]);
#else
  for (int t = 0; t < kTileRows; ++t) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        const uint8_t byte = q[t][k / 32 * 16 + k % 16];
        sum += (k % 32 < 16 ? byte & 0x0F : byte >> 4) * a[k];
      }
      acc += static_cast<float>(sum - zero(t, g) * lanes[g]) * scale(t, g);
    }
    out[t] = acc;
  }
#endif
}

template <typename T>
void linear(const LinearParams& p) {
  RoundedInputs r;
  round_inputs<T>(p, r);
  const int64_t tiles = (p.out_features + kTileRows - 1) / kTileRows;
  // About one contiguous run of weight rows per thread; small weights on the calling thread.
  const int64_t weight_bytes = p.out_features * p.in_features / 2, threads = get_num_threads();
  const int64_t grain = weight_bytes < (int64_t{1} << 18) ? tiles : (tiles + threads - 1) / threads;
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kTileRows;
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, p.out_features - n));
      for (int64_t i = 0; i < p.rows; ++i) {
        float y[kTileRows];
        dot_rows(p, r, i, n, nr, y);
        T* out = static_cast<T*>(p.out) + i * p.out_stride + n;
        for (int t = 0; t < nr; ++t)
          out[t] = from_float<T>(p.bias != nullptr ? y[t] + to_float(static_cast<const T*>(p.bias)[n + t]) : y[t]);
      }
    }
  });
}

}  // namespace int8_inputs
}  // namespace octavo::cpu::OCTAVO_ISA
