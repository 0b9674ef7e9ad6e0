// SIMD vocabulary of the CPU kernels: one float vector type `VecF` whose width follows the ISA
// this file is compiled for (16 lanes for AVX-512, 8 for AVX2, 1 for the scalar reference), with
// loads and stores from float32 / bfloat16 / float16 memory and the math the kernels need.
//
// Included only by per-ISA kernel sources (OCTAVO_ISA is defined by the build). Everything here
// lives in namespace octavo::cpu::OCTAVO_ISA so that inline functions compiled with different
// -m flags never meet under one name at link time (the linker would keep an arbitrary copy).
// For the same reason, ISA sources use no STL containers and pass lambdas, never shared functor
// types such as std::greater, to STL algorithms.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fp8_e4m3.h"

#ifndef OCTAVO_ISA
#error "vec.h is for per-ISA kernel sources; the build defines OCTAVO_ISA"
#endif

namespace octavo::cpu::OCTAVO_ISA {

// 16-bit floats as raw bits; distinct types so that templates tell them apart.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; NaN stays NaN (quiet).
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
inline float to_float(f16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
#endif
}
inline f16 to_f16(float f) {
#if defined(__F16C__)
  return f16{_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)};
#else
  const _Float16 h = static_cast<_Float16>(f);
  f16 out;
  std::memcpy(&out.bits, &h, 2);
  return out;
#endif
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16 from_float<bf16>(float f) { return to_bf16(f); }
template <>
inline f16 from_float<f16>(float f) { return to_f16(f); }

// FP8 E4M3 as raw bits: what an fp8 KV cache holds (kv_cache_dtype="fp8"; fp8_e4m3.h).
struct fp8e4m3 {
  uint8_t bits;
};
inline float to_float(fp8e4m3 x) { return fp8_e4m3_to_float(x.bits); }
template <>
inline fp8e4m3 from_float<fp8e4m3>(float f) { return fp8e4m3{fp8_e4m3_from_float(f)}; }

// An fp8 cache's E4M3 codes as the attention kernel reads them: 2^-8 times their values (exact;
// the kernel folds the 256 into its scales), which makes a load float16 bits and one conversion.
// fp8_256 reads NaN codes as NaN; fp8_256_finite is for blocks the kernel has seen hold none, and
// loads in three integer operations where fp8_256 takes eight (VecF::load_fp8_weight's way).
struct fp8_256 {
  uint8_t bits;
};
struct fp8_256_finite {
  uint8_t bits;
};
inline float to_float(fp8_256 x) { return fp8_e4m3_to_float(x.bits) * (1.0f / 256.0f); }
inline float to_float(fp8_256_finite x) { return fp8_e4m3_to_float(x.bits) * (1.0f / 256.0f); }

// Whether any of n E4M3 codes holds NaN (magnitude 0x7f), eight bytes at a time: a byte's
// magnitude plus one reaches 0x80 at 0x7f only, with no carry into the next byte.
inline bool holds_nan_code(const uint8_t* p, int64_t n) {
  constexpr uint64_t kMagnitudes = 0x7f7f7f7f7f7f7f7full, kOnes = 0x0101010101010101ull;
  uint64_t hits = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    hits |= (w & kMagnitudes) + kOnes;
  }
  for (; i < n; ++i)
    if ((p[i] & 0x7f) == 0x7f) return true;
  return (hits & 0x8080808080808080ull) != 0;
}

// 2^-8 times an E4M3 weight, NaN codes read as +-1.875 (+-480 / 256): VecF::load_fp8_weight's
// scalar form.
inline float fp8_weight_over_256(uint8_t b) {
  const float v = (b & 0x7f) == 0x7f ? 480.0f : std::fabs(fp8_e4m3_to_float(b));
  return (b & 0x80 ? -v : v) * (1.0f / 256.0f);
}

#if defined(__AVX2__)
// E4M3 bytes widened to 16-bit lanes -> the float16 bits of 2^-8 times their values: exponent and
// mantissa move up 7 bits (float16's exponent bias is 8 more than E4M3's, and subnormals line up
// the same way), the sign to bit 15, and NaN (magnitude 0x7f) to a float16 NaN.
inline __m256i fp8_half_bits(__m256i b) {
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7c00));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  return _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16(mag, 7), sign), nan);
}
inline __m128i fp8_half_bits(__m128i b) {
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  return _mm_or_si128(_mm_or_si128(_mm_slli_epi16(mag, 7), sign), nan);
}
#endif

#if defined(__AVX512F__)

struct VecF {
  static constexpr int kWidth = 16;
  __m512 v;

  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static VecF load(const f16* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static VecF load(const fp8_256* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtph_ps(fp8_half_bits(b))};
  }
  static VecF load(const fp8_256_finite* p) { return load_fp8_weight(reinterpret_cast<const uint8_t*>(p)); }
  // kWidth FP8 weights times 2^-8 (the caller's scale carries the 256), NaN codes read as +-480 / 256
  // (weights hold none: the loaders refuse them). Three integer operations where load takes eight:
  // the bytes sign-extended to 16 bits and shifted up 7 put the sign at bit 15 and exponent and
  // mantissa at float16's place (bit 14, a copy of the sign, is masked off).
  static VecF load_fp8_weight(const uint8_t* p) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(int16_t(0xBF80))))};
  }
  // kWidth signed bytes as floats (quantized weights).
  static VecF load_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // The low (shift 0) or high (shift 4) nibbles of kWidth bytes as floats in [0, 15].
  static VecF load_u4(const uint8_t* p, int shift) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, _mm512_set1_epi32(shift)), _mm512_set1_epi32(15)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {
#if defined(__AVX512BF16__)
    // vcvtneps2bf16 rounds to nearest even and keeps NaN a NaN, in one instruction.
    const __m256bh packed = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(packed));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  void store(f16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }

  friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b + c
  friend VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend VecF abs(VecF a) { return {_mm512_abs_ps(a.v)}; }
  friend float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }
  friend float reduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
  // Lanes where x < limit get `value` instead of a's lane.
  friend VecF select_below(VecF x, float limit, VecF a, float value) {
    const __mmask16 m = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_LT_OQ);
    return {_mm512_mask_blend_ps(m, a.v, _mm512_set1_ps(value))};
  }
  // Lanes where x >= limit keep a's lane, the others (NaN x included) get `value`.
  friend VecF select_at_least(VecF x, float limit, VecF a, float value) {
    const __mmask16 m = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_GE_OQ);
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(value), a.v)};
  }
  // Lane i keeps a where bit i of `bits` is set, else takes value.
  friend VecF select_by_bits(uint32_t bits, VecF a, float value) {
    return {_mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(value), a.v)};
  }
  // x * 2^n for integral-valued n in [-126, 127]: one scalef, where AVX2 needs four instructions.
  static VecF ldexp(VecF x, VecF n) { return {_mm512_scalef_ps(x.v, n.v)}; }
  static VecF round(VecF x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
};

// 16 x 16 dwords: out[j] = column j of in[0..15] (unpack dwords, then qwords, then 128-bit lanes
// twice).
inline void transpose_16x16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  // u[4g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c.
  for (int g = 0; g < 4; ++g) {
    const __m512i* s = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);       // lane 0 of each group: column c
    out[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);   // lane 1: column 4 + c
    out[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);   // lane 2
    out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);  // lane 3
  }
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for a kW x kW block of floats.
inline void transpose_square(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512i rows[16], cols[16];
  for (int i = 0; i < 16; ++i) rows[i] = _mm512_loadu_si512(src + i * src_stride);
  transpose_16x16(rows, cols);
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * dst_stride, cols[j]);
}

#elif defined(__AVX2__)

struct VecF {
  static constexpr int kWidth = 8;
  __m256 v;

  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static VecF load(const f16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static VecF load(const fp8_256* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(fp8_half_bits(b))};
  }
  static VecF load(const fp8_256_finite* p) { return load_fp8_weight(reinterpret_cast<const uint8_t*>(p)); }
  static VecF load_fp8_weight(const uint8_t* p) {  // as the AVX-512 level's
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(int16_t(0xBF80))))};
  }
  static VecF load_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  static VecF load_u4(const uint8_t* p, int shift) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, _mm256_set1_epi32(shift)), _mm256_set1_epi32(15)))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
    // packus works within 128-bit lanes: [a0..3 b0..3 | a4..7 b4..7] -> fix the order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  void store(f16* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }

  friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
  friend VecF abs(VecF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
  friend float reduce_add(VecF a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend float reduce_max(VecF a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend VecF select_below(VecF x, float limit, VecF a, float value) {
    const __m256 m = _mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_LT_OQ);
    return {_mm256_blendv_ps(a.v, _mm256_set1_ps(value), m)};
  }
  friend VecF select_at_least(VecF x, float limit, VecF a, float value) {
    const __m256 m = _mm256_cmp_ps(x.v, _mm256_set1_ps(limit), _CMP_GE_OQ);
    return {_mm256_blendv_ps(_mm256_set1_ps(value), a.v, m)};
  }
  friend VecF select_by_bits(uint32_t bits, VecF a, float value) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit);
    const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, _mm256_setzero_si256()));
    return {_mm256_blendv_ps(a.v, _mm256_set1_ps(value), drop)};
  }
  static VecF ldexp(VecF x, VecF n) {  // x * 2^n for integral-valued n in [-126, 127]
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(x.v, _mm256_castsi256_ps(e))};
  }
  static VecF round(VecF x) { return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
};

// dst[j * dst_stride + i] = src[i * src_stride + j] for a kW x kW block of floats (the classic 8 x 8
// transpose: unpack pairs, shuffle quads, then swap 128-bit halves).
inline void transpose_square(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {
    u[g + 0] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
  }
}

#else  // scalar reference: one lane, plain C++ math

struct VecF {
  static constexpr int kWidth = 1;
  float v;

  static VecF zero() { return {0.0f}; }
  static VecF set1(float x) { return {x}; }
  template <typename T>
  static VecF load(const T* p) { return {to_float(*p)}; }
  static VecF load_i8(const int8_t* p) { return {static_cast<float>(*p)}; }
  static VecF load_u4(const uint8_t* p, int shift) { return {static_cast<float>((*p >> shift) & 15)}; }
  static VecF load_fp8_weight(const uint8_t* p) { return {fp8_weight_over_256(*p)}; }
  template <typename T>
  void store(T* p) const { *p = from_float<T>(v); }

  friend VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
  friend VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
  friend VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
  friend VecF operator/(VecF a, VecF b) { return {a.v / b.v}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {std::fma(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
  friend VecF min(VecF a, VecF b) { return {a.v < b.v ? a.v : b.v}; }
  friend VecF abs(VecF a) { return {std::fabs(a.v)}; }
  friend float reduce_add(VecF a) { return a.v; }
  friend float reduce_max(VecF a) { return a.v; }
  friend VecF select_below(VecF x, float limit, VecF a, float value) { return {x.v < limit ? value : a.v}; }
  friend VecF select_at_least(VecF x, float limit, VecF a, float value) { return {x.v >= limit ? a.v : value}; }
  friend VecF select_by_bits(uint32_t bits, VecF a, float value) { return {bits & 1u ? a.v : value}; }
};

inline void transpose_square(const float* src, int64_t, float* dst, int64_t) { dst[0] = src[0]; }

#endif

constexpr int kW = VecF::kWidth;

// Loads / stores of the first n < kW elements (the tail of a row); missing lanes read as 0.
template <typename T>
inline VecF load_partial(const T* p, int n) {
  T buf[kW];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * n);
  return VecF::load(buf);
}
template <typename T>
inline void store_partial(VecF x, T* p, int n) {
  T buf[kW];
  x.store(buf);
  std::memcpy(static_cast<void*>(p), buf, sizeof(T) * n);
}

// e^x with |relative error| < 2e-7 for x in [-87, 88]; exactly 0 below about -87.3 (so
// exp(-inf) = 0), finite above (clamped to e^88.3).
inline VecF exp(VecF x) {
#if defined(__AVX2__)
  const VecF xc = min(max(x, VecF::set1(-87.33f)), VecF::set1(88.3f));
  // x = n ln2 + r, |r| <= ln2/2; ln2 split in two so that n*ln2 is exact to float precision.
  const VecF n = VecF::round(xc * VecF::set1(1.44269504088896341f));
  VecF r = fma(n, VecF::set1(-0.693359375f), xc);
  r = fma(n, VecF::set1(2.12194440e-4f), r);
  // Taylor polynomial of e^r to r^6 (truncation error < 1.2e-7 on |r| <= 0.347), Horner form.
  VecF p = VecF::set1(1.0f / 720);
  p = fma(p, r, VecF::set1(1.0f / 120));
  p = fma(p, r, VecF::set1(1.0f / 24));
  p = fma(p, r, VecF::set1(1.0f / 6));
  p = fma(p, r, VecF::set1(0.5f));
  p = fma(p, r, VecF::set1(1.0f));
  p = fma(p, r, VecF::set1(1.0f));
  return select_below(x, -87.33f, VecF::ldexp(p, n), 0.0f);
#else
  return {std::exp(x.v)};
#endif
}

// 1 / (1 + e^-x), the logistic sigmoid.
inline VecF sigmoid(VecF x) { return VecF::set1(1.0f) / (VecF::set1(1.0f) + exp(VecF::zero() - x)); }

// tanh(x) = 2 sigmoid(2x) - 1; exact at the saturated ends, relative error ~1e-7 elsewhere
// except close to 0, where the absolute error (~1e-7) is what matters for its users.
inline VecF tanh(VecF x) {
#if defined(__AVX2__)
  return fma(VecF::set1(2.0f), sigmoid(x + x), VecF::set1(-1.0f));
#else
  return {std::tanh(x.v)};
#endif
}

// erf(x), Abramowitz & Stegun 7.1.26 (|absolute error| <= 1.5e-7), odd-extended.
inline VecF erf(VecF x) {
#if defined(__AVX2__)
  const VecF sign = select_below(x, 0.0f, VecF::set1(1.0f), -1.0f);
  const VecF a = x * sign;
  const VecF t = VecF::set1(1.0f) / fma(VecF::set1(0.3275911f), a, VecF::set1(1.0f));
  VecF p = VecF::set1(1.061405429f);
  p = fma(p, t, VecF::set1(-1.453152027f));
  p = fma(p, t, VecF::set1(1.421413741f));
  p = fma(p, t, VecF::set1(-0.284496736f));
  p = fma(p, t, VecF::set1(0.254829592f));
  p = p * t;
  const VecF y = VecF::set1(1.0f) - p * exp(VecF::zero() - a * a);
  return y * sign;
#else
  return {std::erf(x.v)};
#endif
}

}  // namespace octavo::cpu::OCTAVO_ISA
