// linear for weight format int4_a8 (W4A8), included by linear.cc in every ISA level.
//
// Each input row is first rounded to int8 with one scale per weight group: a = rint(x * 127 / m)
// (in double, ties to even), m the group's largest |x|, and d = m / 127 rounded to float32. Then
// out[i][n] = sum over groups g of s[n][g] * d[i][g] * sum over k in g of (q[n][k] - z[n][g]) * a[i][k].
// The inner sums are exact integers: four products per 32-bit lane in one instruction (vpdpbusd
// where the level has AVX512-VNNI, vpmaddubsw + vpmaddwd before it; nibbles unsigned, a signed).
// At the end of a group the four weight rows of a tile have their lanes folded and packed into one
// vector (pack_rows), the zero points come off as z times the inputs' sums over the same lanes,
// and one float32 multiply-add per group scales and accumulates all four. So a block of 32
// weights costs one or two integer instructions per weight row and input row, against the float
// path's decode and two multiply-adds, and the only rounding after the inputs' is float32's on
// the per-group terms. A group with a non-finite input makes its row's outputs NaN.
//
// The rounding of the inputs is O(rows * K), the weights O(N * K); it runs 8-16 inputs per
// vector in double (round_values), the same operations as the scalar code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// The rounded inputs are stored per chunk of kChunkBlocks blocks of 32 as two vectors: the
// block's inputs 0-15 ("low"), then 16-31 ("high"), kChunkBlocks blocks side by side in each.
// Nibbles load the same way: one load of kChunkBlocks blocks' 16 bytes, masked, and shifted for
// the high nibbles, with no shuffle. A group's last chunk may hold fewer blocks (zeros after).
#if defined(__AVX512BW__)
constexpr int kChunkBlocks = 4;
constexpr int kLanes = 16;     // 32-bit lanes per integer vector; each sums 4 products
constexpr int kInputRows = 4;  // input rows per pass over a tile: 16 + 4 accumulators of 32 registers
using IVec = __m512i;
using FVec = __m512;
inline IVec izero() { return _mm512_setzero_si512(); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline IVec load_inputs(const int8_t* a) { return _mm512_loadu_si512(a); }
// The low and high nibbles of `blocks` (1-4) blocks at q, zero past them.
inline void load_nibbles(const uint8_t* q, int blocks, IVec& lo, IVec& hi) {
  const __m512i v = blocks == kChunkBlocks ? _mm512_loadu_si512(q)
                                           : _mm512_maskz_loadu_epi8((__mmask64{1} << (16 * blocks)) - 1, q);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
}
inline IVec dot_add(IVec acc, IVec q, IVec a) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, q, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, a), _mm512_set1_epi16(1)));
#endif
}
inline IVec load_ints(const int32_t* p) { return _mm512_loadu_si512(p); }
inline IVec broadcast4(const int32_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline FVec broadcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
inline IVec unpacklo32(IVec a, IVec b) { return _mm512_unpacklo_epi32(a, b); }
inline IVec unpackhi32(IVec a, IVec b) { return _mm512_unpackhi_epi32(a, b); }
inline IVec unpacklo64(IVec a, IVec b) { return _mm512_unpacklo_epi64(a, b); }
inline IVec unpackhi64(IVec a, IVec b) { return _mm512_unpackhi_epi64(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec isub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec imul(IVec a, IVec b) { return _mm512_mullo_epi32(a, b); }
inline FVec to_floats(IVec a) { return _mm512_cvtepi32_ps(a); }
inline FVec fmul(FVec a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
// The sum of the four 128-bit quarters.
inline __m128 quarters_sum(FVec v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#elif defined(__AVX2__)
constexpr int kChunkBlocks = 2;
constexpr int kLanes = 8;
constexpr int kInputRows = 1;  // 4 + 4 accumulators of 16 registers
using IVec = __m256i;
using FVec = __m256;
inline IVec izero() { return _mm256_setzero_si256(); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline IVec load_inputs(const int8_t* a) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)); }
inline void load_nibbles(const uint8_t* q, int blocks, IVec& lo, IVec& hi) {
  const __m256i v = blocks == kChunkBlocks ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                                           : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}
inline IVec dot_add(IVec acc, IVec q, IVec a) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1)));
}
inline IVec load_ints(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec broadcast4(const int32_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline FVec broadcast4(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
inline IVec unpacklo32(IVec a, IVec b) { return _mm256_unpacklo_epi32(a, b); }
inline IVec unpackhi32(IVec a, IVec b) { return _mm256_unpackhi_epi32(a, b); }
inline IVec unpacklo64(IVec a, IVec b) { return _mm256_unpacklo_epi64(a, b); }
inline IVec unpackhi64(IVec a, IVec b) { return _mm256_unpackhi_epi64(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec isub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec imul(IVec a, IVec b) { return _mm256_mullo_epi32(a, b); }
inline FVec to_floats(IVec a) { return _mm256_cvtepi32_ps(a); }
inline FVec fmul(FVec a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
inline FVec fmadd(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m128 quarters_sum(FVec v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
#else
constexpr int kChunkBlocks = 1;
constexpr int kLanes = 1;  // one sum per group
constexpr int kInputRows = 1;
#endif
constexpr int kHalfBytes = 16 * kChunkBlocks;  // the low (or high) inputs of a chunk
static_assert(kTileRows == 4, "a group's sums pack the tile's 4 rows into each 128-bit quarter");

#if defined(__AVX2__)
// The 4 rows' sums of a group, packed: quarter j of the result holds [row 0, row 1, row 2, row 3]
// each summed over the 4 lanes of quarter j of its vector. Each quarter covers one block slot of
// the chunks (16 low and 16 high inputs), whose sum of a round_group stored for it.
inline IVec pack_rows(const IVec s[kTileRows]) {
  const IVec a = iadd(unpacklo32(s[0], s[1]), unpackhi32(s[0], s[1]));  // r0 r1 r0 r1 per quarter
  const IVec b = iadd(unpacklo32(s[2], s[3]), unpackhi32(s[2], s[3]));  // r2 r3 r2 r3
  return iadd(unpacklo64(a, b), unpackhi64(a, b));                      // r0 r1 r2 r3
}
#endif

// The input rows rounded to int8 in chunks (above); d [rows, groups]; per row and group, kLanes
// sums of a laid out as pack_rows packs the weights' sums: quarter j (4 copies) the sum over block
// slot j of the group's chunks. (Scalar: one sum.)
struct RoundedInputs {
  int64_t chunks;  // per group
  std::vector<int8_t> a;
  std::vector<float> d;
  std::vector<int32_t> slot_sums;  // [rows, groups, kLanes]
  int64_t group_bytes() const { return chunks * 2 * kHalfBytes; }
};

// A group's scale: d = m / 127 (float32) and the factor 127 / m (double, finite for every positive
// float m, tiny subnormal groups included), so that every level and layout rounds alike; false
// where an input is not finite.
template <typename T>
bool group_scale(const T* x, int64_t size, float& d, double& inv) {
  int64_t k = 0;
  VecF top = VecF::zero(), spread = VecF::zero();  // spread: x - x summed, NaN once one x is not finite
  for (; k + kW <= size; k += kW) {
    const VecF v = VecF::load(x + k);
    top = max(top, abs(v));
    spread = spread + (v - v);
  }
  float m = reduce_max(top);
  bool finite = reduce_add(spread) == 0.0f;
  for (; k < size; ++k) {
    const float v = to_float(x[k]);
    finite = finite && std::isfinite(v);
    m = std::fmax(m, std::fabs(v));
  }
  if (!finite) {  // inputs 0 and d = NaN: the group's term, and so the row's output, is NaN
    d = NAN;
    return false;
  }
  inv = m > 0.0f ? 127.0 / m : 0.0;
  d = static_cast<float>(m / 127.0);
  return true;
}

// One input rounded with its group's factor: rint(x * inv) in double, |result| <= 127.
inline int8_t round_input(float x, double inv) {
  const double r = std::nearbyint(static_cast<double>(x) * inv);
  return static_cast<int8_t>(std::fmin(127.0, std::fmax(-127.0, r)));
}

#if defined(__AVX512F__)
// 16 inputs rounded as round_input does: rint(v * f) in double, clamped to +-127, as bytes.
inline __m128i round16(__m512 v, __m512d f) {
  const __m256 v1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256i r0 = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), f));
  const __m256i r1 = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(v1), f));
  const __m512i r = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
  return _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(r, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127)));
}
#endif

// x[0, n) rounded as round_input does, into a: the vector levels convert to double, multiply and
// round to nearest even (the default rounding mode, as nearbyint) 8 or 16 at a time, the same
// operations, so every level writes the same bytes (the scalar rounding took a third of a
// 64-row prefill product's time).
template <typename T>
void round_values(const T* x, int64_t n, double inv, int8_t* a) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512d f = _mm512_set1_pd(inv);
  for (; k + 16 <= n; k += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + k), round16(VecF::load(x + k).v, f));
#elif defined(__AVX2__)
  const __m256d f = _mm256_set1_pd(inv);
  const __m128i lo = _mm_set1_epi32(-127), hi = _mm_set1_epi32(127);
  for (; k + 8 <= n; k += 8) {
    const __m256 v = VecF::load(x + k).v;
    const __m128i r0 = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), f));
    const __m128i r1 = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), f));
    const __m128i words = _mm_packs_epi32(_mm_min_epi32(_mm_max_epi32(r0, lo), hi), _mm_min_epi32(_mm_max_epi32(r1, lo), hi));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(a + k), _mm_packs_epi16(words, words));
  }
#endif
  for (; k < n; ++k) a[k] = round_input(to_float(x[k]), inv);
}

// x[0, size) rounded into a with one scale d (group_scale, round_values), as every layout of the
// int8-input kernels rounds a group; zeros (and d = NaN) where an input is not finite.
template <typename T>
void round_into(const T* x, int64_t size, float& d, int8_t* a) {
  double inv = 0.0;
  if (group_scale(x, size, d, inv)) round_values(x, size, inv, a);
  else std::memset(a, 0, static_cast<size_t>(size));
}

// One group's inputs rounded into the chunked layout, with their slot sums.
template <typename T>
void round_group(const T* x, int64_t size, int8_t* a, float& d, int32_t* slot_sums) {
  for (int l = 0; l < kLanes; ++l) slot_sums[l] = 0;
  double inv = 0.0;
  if (!group_scale(x, size, d, inv)) return;
  for (int64_t block = 0; block < size / 32; ++block) {
    int8_t v[32];
    round_values(x + block * 32, 32, inv, v);
    int8_t* chunk = a + block / kChunkBlocks * 2 * kHalfBytes + block % kChunkBlocks * 16;
    std::memcpy(chunk, v, 16);
    std::memcpy(chunk + kHalfBytes, v + 16, 16);
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += v[j];
    const int slot = static_cast<int>(block % kChunkBlocks), copies = kLanes / kChunkBlocks;
    for (int copy = 0; copy < copies; ++copy) slot_sums[slot * copies + copy] += sum;
  }
}

// Rows per job of the rounding: a decode step's few rows on the calling thread, a prefill's
// split over the threads (on one thread it was a third of a 64-row product's time on tiles).
inline int64_t rounding_grain(const LinearParams& p) { return grain_for(p.rows, p.in_features, 1 << 16, 1 << 14); }

template <typename T>
void round_inputs(const LinearParams& p, RoundedInputs& r) {
  const int64_t G = p.group_size, groups = p.in_features / G;
  r.chunks = (G / 32 + kChunkBlocks - 1) / kChunkBlocks;
  r.a.assign(p.rows * groups * r.group_bytes(), 0);
  r.d.resize(p.rows * groups);
  r.slot_sums.resize(p.rows * groups * kLanes);
  const T* input = static_cast<const T*>(p.input);
  parallel_for(p.rows, rounding_grain(p), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < groups; ++g)
        round_group(input + i * p.in_stride + g * G, G, r.a.data() + (i * groups + g) * r.group_bytes(),
                    r.d[i * groups + g], r.slot_sums.data() + (i * groups + g) * kLanes);
  });
}

// The tile's scales and zero points group by group, the 4 rows side by side (for broadcast4).
struct TileQuant {
  std::vector<float> scales;
  std::vector<int32_t> zeros;
  void load(const LinearParams& p, const int64_t (&rows)[kTileRows]) {
    const int64_t groups = p.in_features / p.group_size;
    scales.resize(groups * kTileRows);
    zeros.resize(groups * kTileRows);
    for (int64_t g = 0; g < groups; ++g)
      for (int t = 0; t < kTileRows; ++t) {
        scales[g * kTileRows + t] = p.scales[rows[t] * groups + g];
        zeros[g * kTileRows + t] = p.zeros[rows[t] * groups + g];
      }
  }
};

// out[t][c] = weight row rows[t] against input row i + c, for c < M.
template <int M>
void dot_tile(const LinearParams& p, const RoundedInputs& r, const TileQuant& tq, int64_t i,
              const int64_t (&rows)[kTileRows], float out[kTileRows][kInputRows]) {
  const int64_t G = p.group_size, groups = p.in_features / G, blocks = G / 32, row_bytes = p.in_features / 2;
  const auto weights = [&](int t) { return static_cast<const uint8_t*>(p.weight) + rows[t] * row_bytes; };
  const auto inputs = [&](int c, int64_t g) { return r.a.data() + ((i + c) * groups + g) * r.group_bytes(); };
  const auto slot_sums = [&](int c, int64_t g) { return r.slot_sums.data() + ((i + c) * groups + g) * kLanes; };
#if defined(__AVX2__)
  FVec acc[M];  // the 4 rows packed (pack_rows), per input row
  for (int c = 0; c < M; ++c) acc[c] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    IVec sums[M][kTileRows];
    for (int c = 0; c < M; ++c)
      for (int t = 0; t < kTileRows; ++t) sums[c][t] = izero();
    for (int64_t chunk = 0; chunk < r.chunks; ++chunk) {
      const int count = static_cast<int>(std::min<int64_t>(kChunkBlocks, blocks - chunk * kChunkBlocks));
      IVec lo_in[M], hi_in[M];
      for (int c = 0; c < M; ++c) {
        lo_in[c] = load_inputs(inputs(c, g) + chunk * 2 * kHalfBytes);
        hi_in[c] = load_inputs(inputs(c, g) + chunk * 2 * kHalfBytes + kHalfBytes);
      }
      const int64_t offset = (g * blocks + chunk * kChunkBlocks) * 16;
      for (int t = 0; t < kTileRows; ++t) {
        // Two tiles ahead, as linear.cc's kernels prefetch (OLMoE-sized w4a8 decode end to end:
        // 16.3 tok/s without, 19.5 with).
        __builtin_prefetch(weights(t) + offset + 2 * kTileRows * row_bytes);
        IVec lo, hi;
        load_nibbles(weights(t) + offset, count, lo, hi);
        for (int c = 0; c < M; ++c) sums[c][t] = dot_add(dot_add(sums[c][t], lo, lo_in[c]), hi, hi_in[c]);
      }
    }
    const IVec zeros = broadcast4(tq.zeros.data() + g * kTileRows);
    const FVec scales = broadcast4(tq.scales.data() + g * kTileRows);
    for (int c = 0; c < M; ++c) {
      const IVec exact = isub(pack_rows(sums[c]), imul(zeros, load_ints(slot_sums(c, g))));
      acc[c] = fmadd(to_floats(exact), fmul(scales, r.d[(i + c) * groups + g]), acc[c]);
    }
  }
  for (int c = 0; c < M; ++c) {
    float y[4];
    _mm_storeu_ps(y, quarters_sum(acc[c]));
    for (int t = 0; t < kTileRows; ++t) out[t][c] = y[t];
  }
#else
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t b = 0; b < blocks; ++b) {  // a chunk is a block here
          const uint8_t* q = weights(t) + (g * blocks + b) * 16;
          const int8_t* a = inputs(c, g) + b * 2 * kHalfBytes;
          for (int j = 0; j < 16; ++j) sum += (q[j] & 0x0F) * a[j] + (q[j] >> 4) * a[kHalfBytes + j];
        }
        const float scale = tq.scales[g * kTileRows + t] * r.d[(i + c) * groups + g];
        acc += static_cast<float>(sum - tq.zeros[g * kTileRows + t] * *slot_sums(c, g)) * scale;
      }
      out[t][c] = acc;
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
  const auto store = [&](int64_t i, int64_t n, int nr, const float (&y)[kTileRows][kInputRows], int c) {
    T* out = static_cast<T*>(p.out) + i * p.out_stride + n;
    for (int t = 0; t < nr; ++t)
      out[t] = from_float<T>(p.bias != nullptr ? y[t][c] + to_float(static_cast<const T*>(p.bias)[n + t]) : y[t][c]);
  };
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    TileQuant tq;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kTileRows;
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, p.out_features - n));
      int64_t rows[kTileRows];  // rows past nr repeat row n (their results are dropped)
      for (int t = 0; t < kTileRows; ++t) rows[t] = n + (t < nr ? t : 0);
      tq.load(p, rows);
      float y[kTileRows][kInputRows] = {};
      int64_t i = 0;
      for (; i + kInputRows <= p.rows; i += kInputRows) {
        dot_tile<kInputRows>(p, r, tq, i, rows, y);
        for (int c = 0; c < kInputRows; ++c) store(i + c, n, nr, y, c);
      }
      // The rest two and one at a time: a row's sums do not depend on the rows it ran with.
      if constexpr (kInputRows > 2) {
        for (; i + 2 <= p.rows; i += 2) {
          dot_tile<2>(p, r, tq, i, rows, y);
          for (int c = 0; c < 2; ++c) store(i + c, n, nr, y, c);
        }
      }
      for (; i < p.rows; ++i) {
        dot_tile<1>(p, r, tq, i, rows, y);
        store(i, n, nr, y, 0);
      }
    }
  });
}

}  // namespace int8_inputs
}  // namespace octavo::cpu::OCTAVO_ISA
