// llama.cpp's quantized block formats (ggml-common.h's block_q8_0 ... block_q6_K) as linear.cc
// reads them in place: each decodes to the floats the gguf package's `dequantize` writes, bit for
// bit. The float arithmetic is the package's: a scale times the quant, then for the formats with a
// minimum a separate sum (linear.cc is built without FMA contraction); the K-quants' sub-block
// scale is itself a product, d * sc, rounded first.
//
// Every format decodes blocks of 32 weights (kBlock):
// - Blocks of 32 (kWeights = 32): scale(block) -> BlockScale once per block, from its float16
//   d (and m) in the first dword, which scale_values(d, m) turns into what decode needs;
//   decode(block, j, scale) -> weights [j, j + kW) as floats.
// - Super-blocks of 256 (the K-quants, kWeights = 256) in 8 sub-blocks of 32:
//   sub_scales(super_block, a, b) writes each sub-block's two scale values (a scale and a
//   minimum, or the scales of its two halves of 16), scale_values(a, b) turns them into a
//   BlockScale, and decode(super_block, sub, j, scale) reads weights [j, j + kW) of sub-block sub.
// On AVX-512, formats of at most 32 distinct values per (sub-)block compute those values once
// per block (the same products and sums, hence the same floats) and look each weight up with one
// vpermps (16 values) or vpermt2ps (32): cheaper than converting and scaling every weight.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_scales.h"
#include "octavo/ops.h"
#include "vec.h"

// For helpers of hot loops that GCC's heuristics sometimes leave out of line.
#ifndef OCTAVO_ALWAYS_INLINE
#define OCTAVO_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

namespace octavo::cpu::OCTAVO_ISA {
namespace gguf {

constexpr int kBlock = 32;  // weights per block of 32, and per K-quant sub-block

struct BlockScale {
  VecF a, b;
};

// A float16 stored at p (GGUF scales are unaligned in their blocks).
inline float half_at(const uint8_t* p) {
  f16 h;
  std::memcpy(&h.bits, p, 2);
  return to_float(h);
}

// kW 32-bit integer lanes, for taking the 3-, 5- and 6-bit quants apart before one conversion
// to float (exact: every field is a small integer).
#if defined(__AVX512F__)
struct VecU {
  __m512i v;
  static VecU bytes(const uint8_t* p) {
    return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // Lane l: bit l of word.
  static VecU bits(uint32_t word) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shifted = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), lanes);
    return {_mm512_and_si512(shifted, _mm512_set1_epi32(1))};
  }
  // A shift by a count known only at run time (a K-quant's sub-block) as vpsrlvd, one uop; the
  // form with the count in an xmm register is two, one on the port the lookups need.
  VecU operator>>(int s) const {
    if (__builtin_constant_p(s)) return {_mm512_srli_epi32(v, static_cast<unsigned>(s))};
    return {_mm512_srlv_epi32(v, _mm512_set1_epi32(s))};
  }
  VecU operator<<(int s) const { return {_mm512_slli_epi32(v, static_cast<unsigned>(s))}; }
  VecU operator&(int m) const { return {_mm512_and_si512(v, _mm512_set1_epi32(m))}; }
  VecU operator|(VecU o) const { return {_mm512_or_si512(v, o.v)}; }
  VecF to_float() const { return {_mm512_cvtepi32_ps(v)}; }
};
#elif defined(__AVX2__)
struct VecU {
  __m256i v;
  static VecU bytes(const uint8_t* p) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))};
  }
  static VecU bits(uint32_t word) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), lanes);
    return {_mm256_and_si256(shifted, _mm256_set1_epi32(1))};
  }
  VecU operator>>(int s) const {
    if (__builtin_constant_p(s)) return {_mm256_srli_epi32(v, s)};
    return {_mm256_srlv_epi32(v, _mm256_set1_epi32(s))};
  }
  VecU operator<<(int s) const { return {_mm256_slli_epi32(v, s)}; }
  VecU operator&(int m) const { return {_mm256_and_si256(v, _mm256_set1_epi32(m))}; }
  VecU operator|(VecU o) const { return {_mm256_or_si256(v, o.v)}; }
  VecF to_float() const { return {_mm256_cvtepi32_ps(v)}; }
};
#else
struct VecU {
  uint32_t v;
  static VecU bytes(const uint8_t* p) { return {*p}; }
  static VecU bits(uint32_t word) { return {word & 1u}; }
  VecU operator>>(int s) const { return {v >> s}; }
  VecU operator<<(int s) const { return {v << s}; }
  VecU operator&(int m) const { return {v & static_cast<uint32_t>(m)}; }
  VecU operator|(VecU o) const { return {v | o.v}; }
  VecF to_float() const { return {static_cast<float>(v)}; }
};
#endif

// ---- K-quant scales: each sub-block's two values, a[i] and m[i] for i < 8, as the gguf
// package's products of d (dmin) and the unpacked integers. With vectors, the 12 bytes of packed
// scales are taken apart in an xmm register, four at a time per dword (ggml's masks), and stored
// once as floats: scalar byte stores read back by wider loads would stall store forwarding.
#if defined(__AVX2__)
// The 12 bytes at p in the low three dwords (16 bytes from p could pass the tensor's end).
inline __m128i load12(const uint8_t* p) {
  uint32_t last;
  std::memcpy(&last, p + 8, 4);
  return _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), static_cast<int>(last), 2);
}
// a[i] = da * (low 8 bytes of q)[i], m[i] = dm * (high 8 bytes)[i]; kSigned: the bytes are int8.
template <bool kSigned>
inline void scaled_halves(__m128i q, float da, float dm, float* a, float* m) {
  const __m128i high = _mm_unpackhi_epi64(q, q);
  const __m256i lo = kSigned ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  const __m256i hi = kSigned ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
  _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(da)));
  _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(dm)));
}
// 16 int8 scales of 16 weights each -> the even ones (each sub-block's first half) in the low 8
// bytes, the odd ones in the high 8.
inline __m128i even_then_odd(__m128i q) {
  return _mm_shuffle_epi8(q, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}
#endif

// Q4_K / Q5_K: 8 six-bit scales and minimums in 12 bytes (gguf_scales::k4); a = d * scale,
// m = dmin * minimum.
inline void k4_sub_scales(const uint8_t* q, float d, float dmin, float* a, float* m) {
#if defined(__AVX2__)
  const __m128i v = load12(q);
  const __m128i w0w2w1w2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));
  const __m128i w0w0w1w1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
  const __m128i low6 = _mm_and_si128(w0w2w1w2, _mm_set1_epi8(0x3F));  // scales 0-3, minimums 0-3
  const __m128i nibbles = _mm_and_si128(_mm_srlv_epi32(w0w2w1w2, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi8(0x0F));
  const __m128i tops = _mm_and_si128(_mm_srli_epi32(w0w0w1w1, 2), _mm_set1_epi8(0x30));
  // Bytes: scales 0-3, 4-7, minimums 0-3, 4-7.
  scaled_halves<false>(_mm_blend_epi32(low6, _mm_or_si128(nibbles, tops), 0b1010), d, dmin, a, m);
#else
  for (int i = 0; i < 8; ++i) {
    int sc, mn;
    gguf_scales::k4(q, i, sc, mn);
    a[i] = d * static_cast<float>(sc);
    m[i] = dmin * static_cast<float>(mn);
  }
#endif
}

// Q6_K: 16 int8 scales at q, one per 16 weights; a = d * the first half's, m = d * the second's.
inline void k6_sub_scales(const uint8_t* q, float d, float* a, float* m) {
#if defined(__AVX2__)
  scaled_halves<true>(even_then_odd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), d, d, a, m);
#else
  const auto* sc = reinterpret_cast<const int8_t*>(q);
  for (int i = 0; i < 8; ++i) {
    a[i] = d * static_cast<float>(sc[2 * i]);
    m[i] = d * static_cast<float>(sc[2 * i + 1]);
  }
#endif
}

// Q3_K: 16 six-bit scales in 12 bytes (gguf_scales::k3), stored + 32, one per 16 weights.
inline void k3_sub_scales(const uint8_t* q, float d, float* a, float* m) {
#if defined(__AVX2__)
  const __m128i v = load12(q);
  const __m128i w0w1w0w1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0));
  const __m128i w2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2));
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(w0w1w0w1, _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(w2, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(0x03));
  const __m128i scales = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(high, 4)), _mm_set1_epi8(32));
  scaled_halves<true>(even_then_odd(scales), d, d, a, m);
#else
  for (int i = 0; i < 8; ++i) {
    a[i] = d * static_cast<float>(gguf_scales::k3(q, 2 * i));
    m[i] = d * static_cast<float>(gguf_scales::k3(q, 2 * i + 1));
  }
#endif
}

// Weights [j, j + kW) of a block whose byte i holds weight i in its low nibble and weight i + 16
// in its high one (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), as integer lanes.
inline VecU nibbles(const uint8_t* q, int j) { return (VecU::bytes(q + (j & 15)) >> (j < 16 ? 0 : 4)) & 15; }

#if defined(__AVX512F__)
inline __m512 iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// The 16 (or 2 x 16) values a block's quants stand for, looked up by the quants: vpermps reads
// only an index's low 4 bits, vpermt2ps the low 5.
inline VecF table_of_16(__m512 values, float d) { return {_mm512_mul_ps(values, _mm512_set1_ps(d))}; }
inline VecF lookup(const BlockScale& s, VecU idx) { return {_mm512_permutexvar_ps(idx.v, s.a.v)}; }
inline VecF lookup32(const BlockScale& s, VecU idx) { return {_mm512_permutex2var_ps(s.a.v, idx.v, s.b.v)}; }
// (q - offset) * d + m for q in [first, first + 16), as the gguf package computes it.
inline VecF affine_values(float first, float offset, float d, float m, bool with_min) {
  const VecF q = VecF{_mm512_add_ps(iota(), _mm512_set1_ps(first - offset))} * VecF::set1(d);
  return with_min ? q + VecF::set1(m) : q;
}
// 16 bytes at p shifted right by s bits and masked, byte by byte: the bit fields of 16 weights of
// a K-quant sub-block, taken apart in one xmm register (where three ports run integer work)
// before they are widened to 32-bit lanes (on the one port shuffles have).
inline __m128i byte_fields(const uint8_t* p, int s, int mask) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_and_si128(_mm_srlv_epi32(bytes, _mm_set1_epi32(s)), _mm_set1_epi8(static_cast<char>(mask)));
}
// Q5_0 / Q5_1 / Q5_K: index lanes whose fifth bit is set in `high` (a mask of kW lanes) get 16.
inline VecU with_fifth_bit(VecU low, __mmask16 high) {
  return {_mm512_mask_or_epi32(low.v, high, low.v, _mm512_set1_epi32(16))};
}
#endif

template <WeightFormat F>
struct Gguf;

// ---- blocks of 32 --------------------------------------------------------------------------
// Q8_0: w = d * q, q int8. Q4_0: w = d * (q - 8); Q4_1: w = d * q + m; Q5_0: w = d * (q - 16);
// Q5_1: w = d * q + m, q's fifth bit in a uint32 after d (and m); IQ4_NL: w = d * kIq4NlValues[q].

template <>
struct Gguf<WeightFormat::kQ8_0> {
  static constexpr int kWeights = 32, kBytes = 34;
  static BlockScale scale_values(float d, float) { return {VecF::set1(d), VecF::zero()}; }
  static BlockScale scale(const uint8_t* b) { return scale_values(half_at(b), 0.0f); }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    return VecF::load_i8(reinterpret_cast<const int8_t*>(b + 2) + j) * s.a;
  }
};

// Q4_0, Q4_1 (kMin: a float16 minimum after d), Q5_0 and Q5_1 (kFifth: 4 bytes of fifth bits
// next): d, [m,] [fifth bits,] then 16 bytes of nibbles at kQuants.
template <int kBytesOfBlock, bool kMin, bool kFifth>
struct GgufLinearBlock {
  static constexpr int kWeights = 32, kBytes = kBytesOfBlock;
  static constexpr int kHigh = kMin ? 4 : 2;               // offset of Q5's fifth bits
  static constexpr int kQuants = kHigh + (kFifth ? 4 : 0);  // offset of the nibbles
  static constexpr float kOffset = kMin ? 0.0f : kFifth ? 16.0f : 8.0f;
  static BlockScale scale(const uint8_t* b) { return scale_values(half_at(b), kMin ? half_at(b + 2) : 0.0f); }
  static uint32_t fifth_bits(const uint8_t* b) {
    uint32_t h;
    std::memcpy(&h, b + kHigh, 4);
    return h;
  }
#if defined(__AVX512F__)
  static BlockScale scale_values(float d, float m) {
    return {affine_values(0, kOffset, d, m, kMin), kFifth ? affine_values(16, kOffset, d, m, kMin) : VecF::zero()};
  }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    const VecU q = VecU::bytes(b + kQuants + (j & 15)) >> (j < 16 ? 0 : 4);  // vpermps ignores the high bits
    if constexpr (!kFifth) return lookup(s, q);
    return lookup32(s, with_fifth_bit(q & 15, static_cast<__mmask16>(fifth_bits(b) >> j)));
  }
#else
  static BlockScale scale_values(float d, float m) { return {VecF::set1(d), VecF::set1(m)}; }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    VecU q = nibbles(b + kQuants, j);
    if constexpr (kFifth) q = q | (VecU::bits(fifth_bits(b) >> j) << 4);
    if constexpr (kMin) return q.to_float() * s.a + s.b;
    return (q.to_float() - VecF::set1(kOffset)) * s.a;
  }
#endif
};
template <>
struct Gguf<WeightFormat::kQ4_0> : GgufLinearBlock<18, false, false> {};
template <>
struct Gguf<WeightFormat::kQ4_1> : GgufLinearBlock<20, true, false> {};
template <>
struct Gguf<WeightFormat::kQ5_0> : GgufLinearBlock<22, false, true> {};
template <>
struct Gguf<WeightFormat::kQ5_1> : GgufLinearBlock<24, true, true> {};

// IQ4_NL: a non-uniform grid of 16 int8 values.
inline constexpr float kIq4NlValues[16] = {OCTAVO_IQ4_NL_VALUES};
template <>
struct Gguf<WeightFormat::kIQ4_NL> {
  static constexpr int kWeights = 32, kBytes = 18;
  static BlockScale scale(const uint8_t* b) { return scale_values(half_at(b), 0.0f); }
#if defined(__AVX512F__)
  static BlockScale scale_values(float d, float) {
    return {table_of_16(_mm512_loadu_ps(kIq4NlValues), d), VecF::zero()};
  }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    return lookup(s, VecU::bytes(b + 2 + (j & 15)) >> (j < 16 ? 0 : 4));
  }
#elif defined(__AVX2__)
  // Two tables of 8 (vpermps reads an index's low 3 bits), chosen by bit 3.
  static BlockScale scale_values(float d, float) {
    const __m256 s = _mm256_set1_ps(d);
    return {{_mm256_mul_ps(_mm256_loadu_ps(kIq4NlValues), s)}, {_mm256_mul_ps(_mm256_loadu_ps(kIq4NlValues + 8), s)}};
  }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    const __m256i q = nibbles(b + 2, j).v;
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(q, 28));  // bit 3 -> the sign bit blendv reads
    return {_mm256_blendv_ps(_mm256_permutevar8x32_ps(s.a.v, q), _mm256_permutevar8x32_ps(s.b.v, q), upper)};
  }
#else
  static BlockScale scale_values(float d, float) { return {VecF::set1(d), VecF::zero()}; }
  static VecF decode(const uint8_t* b, int j, const BlockScale& s) {
    return VecF::set1(kIq4NlValues[nibbles(b + 2, j).v]) * s.a;
  }
#endif
};

// ---- super-blocks of 256 (K-quants) --------------------------------------------------------

// Q4_K (kFifth false) and Q5_K: d, dmin, 12 bytes of scales, [Q5_K: 32 bytes of fifth bits,] 128
// bytes of nibbles. Sub-block s: a = d * sc[s], b = dmin * mn[s]; w = a * q - b, q the low
// (s even) or high (s odd) nibbles of bytes 32 * (s / 2).., plus 16 for bit s of byte j of
// the fifth bits.
template <bool kFifth>
struct GgufK4 {
  static constexpr int kWeights = 256, kBytes = kFifth ? 176 : 144;
  static constexpr int kQuants = kFifth ? 48 : 16;
  static void sub_scales(const uint8_t* b, float* a, float* m) {
    k4_sub_scales(b + 4, half_at(b), half_at(b + 2), a, m);
  }
#if defined(__AVX512F__)
  static BlockScale scale_values(float a, float m) {
    return {VecF{_mm512_mul_ps(iota(), _mm512_set1_ps(a))} - VecF::set1(m),
            kFifth ? VecF{_mm512_mul_ps(_mm512_add_ps(iota(), _mm512_set1_ps(16)), _mm512_set1_ps(a))} - VecF::set1(m)
                   : VecF::zero()};
  }
  static VecF decode(const uint8_t* b, int sub, int j, const BlockScale& s) {
    if constexpr (!kFifth) return lookup(s, VecU::bytes(b + kQuants + 32 * (sub >> 1) + j) >> (4 * (sub & 1)));
    const __m128i q = _mm_or_si128(byte_fields(b + kQuants + 32 * (sub >> 1) + j, 4 * (sub & 1), 15),
                                   _mm_slli_epi16(byte_fields(b + 16 + j, sub, 1), 4));
    return lookup32(s, {_mm512_cvtepu8_epi32(q)});
  }
#else
  static BlockScale scale_values(float a, float m) { return {VecF::set1(a), VecF::set1(m)}; }
  static VecF decode(const uint8_t* b, int sub, int j, const BlockScale& s) {
    VecU q = (VecU::bytes(b + kQuants + 32 * (sub >> 1) + j) >> (4 * (sub & 1))) & 15;
    if constexpr (kFifth) q = q | (((VecU::bytes(b + 16 + j) >> sub) & 1) << 4);
    return q.to_float() * s.a - s.b;
  }
#endif
};
template <>
struct Gguf<WeightFormat::kQ4_K> : GgufK4<false> {};
template <>
struct Gguf<WeightFormat::kQ5_K> : GgufK4<true> {};

// Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16 weights), d.
// Sub-block s = 4h + c: low nibbles of bytes 64h + 32 (c % 2).. shifted by 4 (c / 2), high bits
// of bytes 128 + 32h.. shifted by 2c; w = (d * scale) * (q - 32). a and b: its halves' scales.
template <>
struct Gguf<WeightFormat::kQ6_K> {
  static constexpr int kWeights = 256, kBytes = 210;
  static void sub_scales(const uint8_t* b, float* a, float* m) { k6_sub_scales(b + 192, half_at(b + 208), a, m); }
  static BlockScale scale_values(float a, float m) { return {VecF::set1(a), VecF::set1(m)}; }
  static VecF decode(const uint8_t* b, int sub, int j, const BlockScale& s) {
    const int h = sub >> 2, c = sub & 3;
#if defined(__AVX512F__)
    const __m128i q = _mm_or_si128(byte_fields(b + 64 * h + 32 * (c & 1) + j, 4 * (c >> 1), 15),
                                   _mm_slli_epi16(byte_fields(b + 128 + 32 * h + j, 2 * c, 3), 4));
    const __m128i centred = _mm_sub_epi8(q, _mm_set1_epi8(32));  // q - 32 fits int8, as gguf computes it
    return VecF{_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(centred))} * (j < 16 ? s.a : s.b);
#else
    const VecU low = (VecU::bytes(b + 64 * h + 32 * (c & 1) + j) >> (4 * (c >> 1))) & 15;
    const VecU high = (VecU::bytes(b + 128 + 32 * h + j) >> (2 * c)) & 3;
    return ((low | (high << 4)).to_float() - VecF::set1(32.0f)) * (j < 16 ? s.a : s.b);
#endif
  }
};

// Q3_K: 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales (one per 16 weights,
// stored + 32), d. Sub-block s = 4h + c: 2-bit quants of bytes 32 + 32h.. shifted by 2c, high
// bit s of bytes j; w = (d * (scale - 32)) * q, q = low - 4 where the high bit is clear.
template <>
struct Gguf<WeightFormat::kQ3_K> {
  static constexpr int kWeights = 256, kBytes = 110;
  static void sub_scales(const uint8_t* b, float* a, float* m) { k3_sub_scales(b + 96, half_at(b + 108), a, m); }
  static BlockScale scale_values(float a, float m) { return {VecF::set1(a), VecF::set1(m)}; }
  static VecF decode(const uint8_t* b, int sub, int j, const BlockScale& s) {
    const int h = sub >> 2, c = sub & 3;
#if defined(__AVX512F__)
    const __m128i q =
        _mm_or_si128(byte_fields(b + 32 + 32 * h + j, 2 * c, 3), _mm_slli_epi16(byte_fields(b + j, sub, 1), 2));
    return VecF{_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(q, _mm_set1_epi8(4))))} * (j < 16 ? s.a : s.b);
#else
    const VecU low = (VecU::bytes(b + 32 + 32 * h + j) >> (2 * c)) & 3;
    const VecU high = (VecU::bytes(b + j) >> sub) & 1;
    return ((low | (high << 2)).to_float() - VecF::set1(4.0f)) * (j < 16 ? s.a : s.b);
#endif
  }
};

#if defined(__AVX2__)
// The float16 pairs of 8 dwords (d in the low half, m in the high one) as floats.
OCTAVO_ALWAYS_INLINE void scale_pairs(__m256i dm, __m256& d, __m256& m) {
  const __m256i low = _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)), high = _mm256_srli_epi32(dm, 16);
  // packus interleaves the 128-bit halves: 0-3 and 4-7 of each land in order after the permute.
  const __m256i halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0b11011000);
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}
#endif

// The two scale values of blocks [blk, blk + count) of 32 weights of a row at `row` (count and
// blk multiples of the sub-blocks per super-block): the K-quants' sub_scales, or each block's
// float16 d (and m, meaningless for the formats without one) from its first dword. On AVX-512
// one gather and two conversions per 16 blocks instead of two scalar conversions per block (in
// the float path 1.1x faster than reading them 8 at a time into registers as linear_gguf_a8.h's
// scales8 does, measured A/B on Zen 4; in that kernel the other way round).
template <WeightFormat F>
void read_scales(const uint8_t* row, int64_t blk, int count, float* d, float* m) {
  using Format = Gguf<F>;
  if constexpr (Format::kWeights > kBlock) {
    constexpr int kSub = Format::kWeights / kBlock;
    for (int i = 0; i < count; i += kSub) Format::sub_scales(row + (blk + i) / kSub * Format::kBytes, d + i, m + i);
  } else {
    const uint8_t* first = row + blk * Format::kBytes;
#if defined(__AVX512F__)
    const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(Format::kBytes));
    const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
    const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, offsets, first, 1);
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
#else
    for (int i = 0; i < count; ++i) {
      d[i] = half_at(first + i * Format::kBytes);
      m[i] = half_at(first + i * Format::kBytes + 2);
    }
#endif
  }
}

}  // namespace gguf
}  // namespace octavo::cpu::OCTAVO_ISA
