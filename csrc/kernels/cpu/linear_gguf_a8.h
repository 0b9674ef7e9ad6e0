// linear for GGUF block weights multiplied by int8 inputs (LinearParams::int8_inputs: opt in, as
// llama.cpp does on the CPU), included by linear.cc in every ISA level.
//
// Each input row is rounded per block of 32 inputs as the int4_a8 kernel rounds a group
// (round_into: d = m / 127, a = rint(x * 127 / m); llama.cpp's Q8_0 activations), and each weight
// block is taken apart into 32 small integers u, one byte each, with the format's offset o, its
// scale s (one per block, or one per half of 16: Q3_K, Q6_K) and for some formats a minimum m:
// w = s * (u - o) + m. Then a block's product is
//   d * s * sum (u - o) * a + m * d * sum a
// whose inner sum is exact: vpdpbusd (four u8 x s8 products per 32-bit lane; vpmaddubsw and
// vpmaddwd before AVX512-VNNI) starts from -o times the inputs' sums over the same four lanes,
// so the offset costs no instruction. Q8_0 and IQ4_NL hold signed values: |w| times a with w's
// sign. One float multiply-add per block and weight row then scales the eight lanes (d * s was
// multiplied for 8 blocks at once); the minimums' terms are one multiply-add per 8 blocks. Per
// weight block that is 5-10 instructions on 32 weights, where the float path decodes and
// multiplies 32 floats: 1.5-1.8x its speed at M = 1 on one thread of an AMD EPYC (Zen 4 class),
// 1.0-1.5x at M = 16, but 0.8-0.9x at M = 64, where the float path decodes a tile once for all
// rows (bench/RESULTS.md); so from 16 rows on, where the CPU has AVX512-VNNI, the weights are
// decoded once into panels instead (linear_gguf_a8_panels.h, which also holds the entry point,
// linear). The result is that of the inputs rounded so, up to float32 rounding of
// the per-block terms (sums of 8 lanes per block, in the lanes' order). A block with a
// non-finite input makes its row's outputs NaN.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "linear_int8_inputs.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

// The per-block helpers below are OCTAVO_ALWAYS_INLINE (gguf_blocks.h): GCC's heuristics left
// scales8 out of line in some builds (a call, vzeroupper and its results through memory per 8
// blocks), which took the kernel from 1.5x the float path's speed to 0.85x.

namespace octavo::cpu::OCTAVO_ISA {
namespace gguf_a8 {

using gguf::kBlock;
constexpr int kTileRows = 4;     // weight rows that share each load of the inputs
constexpr int kScaleBatch = 16;  // blocks whose scales are read and multiplied at once
constexpr int kLanes = 8;        // 32-bit lanes of a block's sums: four inputs each
#if defined(__AVX512VL__)
constexpr int kInputRows = 4;  // 16 accumulators of 32 ymm registers
#elif defined(__AVX2__)
constexpr int kInputRows = 2;  // 8 of 16
#else
constexpr int kInputRows = 1;
#endif

// ---- the formats' integers -------------------------------------------------------------------
// Bytes<F>: kOffset, kSigned (values are int8 with their sign, kOffset 0), kMin (+1: w = s * u + m,
// -1: s * u - m, 0: none), kHalves (a scale per 16); value(b, sub, i): u of weight i of block b
// (or of sub-block sub of super-block b), and with vectors load(b, sub): all 32 as bytes.
inline int nibble(const uint8_t* q, int i) { return i < 16 ? q[i] & 15 : q[i - 16] >> 4; }
inline int bit(const uint8_t* word, int i) { return (word[i / 8] >> (i % 8)) & 1; }
inline constexpr int8_t kIq4NlBytes[16] = {OCTAVO_IQ4_NL_VALUES};

#if defined(__AVX2__)
OCTAVO_ALWAYS_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// The 16 bytes at p as 32 nibbles: low nibbles in bytes 0-15, high ones in 16-31.
OCTAVO_ALWAYS_INLINE __m256i nibbles32(const uint8_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0F));
}
// Byte i: `value` where bit i of the 32-bit word at p is set, else 0.
OCTAVO_ALWAYS_INLINE __m256i bit_bytes(const uint8_t* p, int value) {
  uint32_t word;
  std::memcpy(&word, p, 4);
#if defined(__AVX512BW__)
  return _mm256_maskz_mov_epi8(word, _mm256_set1_epi8(static_cast<char>(value)));
#else
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i bits = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits),
                          _mm256_set1_epi8(static_cast<char>(value)));
#endif
}
// (byte >> shift) & mask for the 32 bytes at p (16-bit shifts: the bits a byte takes from its
// neighbour land above the mask).
OCTAVO_ALWAYS_INLINE __m256i fields32(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(static_cast<char>(mask)));
}
#endif

template <WeightFormat F>
struct Bytes;

// Blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1 (as gguf_blocks.h's GgufLinearBlock): d, [m,] [fifth
// bits,] nibbles.
template <bool kHasMin, bool kFifth>
struct LinearBlockBytes {
  static constexpr int kOffset = kHasMin ? 0 : kFifth ? 16 : 8, kMin = kHasMin ? 1 : 0;
  static constexpr bool kSigned = false, kHalves = false;
  static constexpr int kHigh = kHasMin ? 4 : 2, kQuants = kHigh + (kFifth ? 4 : 0);
  static int value(const uint8_t* b, int, int i) {
    return nibble(b + kQuants, i) | (kFifth ? bit(b + kHigh, i) << 4 : 0);
  }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int) {
    if constexpr (!kFifth) return nibbles32(b + kQuants);
    else return _mm256_or_si256(nibbles32(b + kQuants), bit_bytes(b + kHigh, 16));
  }
#endif
};
template <>
struct Bytes<WeightFormat::kQ4_0> : LinearBlockBytes<false, false> {};
template <>
struct Bytes<WeightFormat::kQ4_1> : LinearBlockBytes<true, false> {};
template <>
struct Bytes<WeightFormat::kQ5_0> : LinearBlockBytes<false, true> {};
template <>
struct Bytes<WeightFormat::kQ5_1> : LinearBlockBytes<true, true> {};

template <>
struct Bytes<WeightFormat::kQ8_0> {
  static constexpr int kOffset = 0, kMin = 0;
  static constexpr bool kSigned = true, kHalves = false;
  static int value(const uint8_t* b, int, int i) { return static_cast<int8_t>(b[2 + i]); }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int) { return load32(b + 2); }
#endif
};

template <>
struct Bytes<WeightFormat::kIQ4_NL> {
  static constexpr int kOffset = 0, kMin = 0;
  static constexpr bool kSigned = true, kHalves = false;
  static int value(const uint8_t* b, int, int i) { return kIq4NlBytes[nibble(b + 2, i)]; }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlBytes)));
    return _mm256_shuffle_epi8(table, nibbles32(b + 2));
  }
#endif
};

// Q4_K / Q5_K sub-block s: nibbles of bytes 32 (s / 2).. after the scales (low for even s), plus
// 16 for bit s of the fifth bits' byte i; w = a * u - m.
template <bool kFifth>
struct K4Bytes {
  static constexpr int kOffset = 0, kMin = -1, kQuants = kFifth ? 48 : 16;
  static constexpr bool kSigned = false, kHalves = false;
  static int value(const uint8_t* b, int s, int i) {
    const int low = (b[kQuants + 32 * (s >> 1) + i] >> (4 * (s & 1))) & 15;
    return low | (kFifth ? ((b[16 + i] >> s) & 1) << 4 : 0);
  }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int s) {
    const __m256i low = fields32(b + kQuants + 32 * (s >> 1), 4 * (s & 1), 15);
    if constexpr (!kFifth) return low;
    else return _mm256_or_si256(low, _mm256_slli_epi16(fields32(b + 16, s, 1), 4));
  }
#endif
};
template <>
struct Bytes<WeightFormat::kQ4_K> : K4Bytes<false> {};
template <>
struct Bytes<WeightFormat::kQ5_K> : K4Bytes<true> {};

// Q6_K sub-block s = 4h + c: low nibbles of bytes 64h + 32 (c % 2).. shifted by 4 (c / 2), high
// 2 bits of bytes 128 + 32h.. shifted by 2c; w = (d * scale of the half) * (u - 32).
template <>
struct Bytes<WeightFormat::kQ6_K> {
  static constexpr int kOffset = 32, kMin = 0;
  static constexpr bool kSigned = false, kHalves = true;
  static int value(const uint8_t* b, int s, int i) {
    const int h = s >> 2, c = s & 3;
    return ((b[64 * h + 32 * (c & 1) + i] >> (4 * (c >> 1))) & 15) | (((b[128 + 32 * h + i] >> (2 * c)) & 3) << 4);
  }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int s) {
    const int h = s >> 2, c = s & 3;
    return _mm256_or_si256(fields32(b + 64 * h + 32 * (c & 1), 4 * (c >> 1), 15),
                           _mm256_slli_epi16(fields32(b + 128 + 32 * h, 2 * c, 3), 4));
  }
#endif
};

// Q3_K sub-block s = 4h + c: 2-bit quants of bytes 32 + 32h.. shifted by 2c, plus 4 for bit s of
// byte i; w = (d * (scale of the half - 32)) * (u - 4).
template <>
struct Bytes<WeightFormat::kQ3_K> {
  static constexpr int kOffset = 4, kMin = 0;
  static constexpr bool kSigned = false, kHalves = true;
  static int value(const uint8_t* b, int s, int i) {
    const int h = s >> 2, c = s & 3;
    return ((b[32 + 32 * h + i] >> (2 * c)) & 3) | (((b[i] >> s) & 1) << 2);
  }
#if defined(__AVX2__)
  OCTAVO_ALWAYS_INLINE static __m256i load(const uint8_t* b, int s) {
    const int h = s >> 2, c = s & 3;
    return _mm256_or_si256(fields32(b + 32 + 32 * h, 2 * c, 3), _mm256_slli_epi16(fields32(b, s, 1), 2));
  }
#endif
};

// ---- the inputs ------------------------------------------------------------------------------
// Per input row and block of 32: the rounded inputs, d, d * sum a, and -offset * sum a over each
// lane's four inputs (where vpdpbusd starts). d and d * sum a have kScaleBatch zeros after the
// row's blocks, so that the kernel reads them 8 at a time past a row's last block. They live in
// the calling thread's scratch (slot kScratchSlot), reused from call to call: a decode step makes
// about 120 of them, and four allocations each added up.
struct RoundedInputs {
  int64_t blocks, padded;  // blocks per row, and the scale arrays' stride
  int8_t* a;
  float* d;
  float* dsum;
  int32_t* offset_sums;  // for the rows kernel
  // For the panels (linear_gguf_a8_panels.h): -panel offset * sum a per row, block and half of 16
  // (formats with a scale per half), or over the whole block in the first of the two (the others).
  int32_t* half_offsets;
};
constexpr int kScratchSlot = 3;

inline int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// One block of 32 inputs at x (size: 32, GGUF rows are whole blocks) rounded into a with its d,
// as int8_inputs::round_into rounds it (the same m, d, 1 / d in double and rounding), and lane
// l's sum of a[4l..4l+3]. On AVX-512 the block's largest |x| and finiteness come from two vectors
// (round_into's generic loop and reductions took three times as long, a fifth of a 64-row
// product's time on the panels).
template <typename T>
OCTAVO_ALWAYS_INLINE void round_block(const T* x, int64_t size, float& d, int8_t* a, int32_t (&lanes)[kLanes]) {
#if defined(__AVX512BW__)
  const __m512 v0 = VecF::load(x).v, v1 = VecF::load(x + 16).v;
  const __m512 zero = _mm512_setzero_ps();
  // x - x is 0 for finite x and NaN for the rest.
  const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), zero, _CMP_NEQ_UQ) |
                        _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), zero, _CMP_NEQ_UQ);
  if (bad != 0) {
    d = NAN;
    std::memset(a, 0, kBlock);
    std::fill(lanes, lanes + kLanes, 0);
    return;
  }
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  d = static_cast<float>(m / 127.0);
  // round_values' arithmetic (round16) on the vectors in hand: the bytes stay in a register for
  // the sums (read back from two 16-byte stores, a 32-byte load missed store forwarding: a third
  // of the rounding's time).
  const __m512d inv = _mm512_set1_pd(m > 0.0f ? 127.0 / m : 0.0);
  (void)size;  // the scalar levels' round_into takes it
  const __m256i bytes = _mm256_set_m128i(int8_inputs::round16(v1, inv), int8_inputs::round16(v0, inv));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), bytes);
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sums);
#else
  int8_inputs::round_into(x, size, d, a);
  for (int l = 0; l < kLanes; ++l) lanes[l] = a[4 * l] + a[4 * l + 1] + a[4 * l + 2] + a[4 * l + 3];
#endif
}

// Points r's arrays into the calling thread's scratch, sized for p.rows rows.
inline void layout_inputs(const LinearParams& p, RoundedInputs& r) {
  r.blocks = p.in_features / kBlock;
  r.padded = r.blocks + kScaleBatch;
  const int64_t a_bytes = aligned64(p.rows * p.in_features), scale_bytes = aligned64(p.rows * r.padded * 4);
  const int64_t sums_bytes = aligned64(p.rows * r.blocks * kLanes * 4);
  auto* base = static_cast<char*>(thread_scratch(
      kScratchSlot, static_cast<size_t>(a_bytes + 2 * scale_bytes + sums_bytes + p.rows * r.blocks * 2 * 4)));
  r.a = reinterpret_cast<int8_t*>(base);
  r.d = reinterpret_cast<float*>(base + a_bytes);
  r.dsum = reinterpret_cast<float*>(base + a_bytes + scale_bytes);
  r.offset_sums = reinterpret_cast<int32_t*>(base + a_bytes + 2 * scale_bytes);
  r.half_offsets = reinterpret_cast<int32_t*>(base + a_bytes + 2 * scale_bytes + sums_bytes);
}

// Input rows [begin, end) rounded into r, with what one of the two kernels needs beside them: for
// the rows kernel (panels false) offset_sums with the format's offset, for the panels half_offsets
// with theirs.
template <typename T>
void round_rows(const LinearParams& p, bool panels, int offset, bool halves, int64_t begin, int64_t end,
                const RoundedInputs& r) {
  const T* input = static_cast<const T*>(p.input);
  for (int64_t i = begin; i < end; ++i) {
    std::fill(r.d + i * r.padded + r.blocks, r.d + (i + 1) * r.padded, 0.0f);
    std::fill(r.dsum + i * r.padded + r.blocks, r.dsum + (i + 1) * r.padded, 0.0f);
    for (int64_t b = 0; b < r.blocks; ++b) {
      float& d = r.d[i * r.padded + b];
      int32_t lanes[kLanes];
      // (A size GCC cannot fold: with the constant 32 it warns of the dead tails it inlines.)
      const int64_t size = std::min<int64_t>(kBlock, p.in_features - b * kBlock);
      round_block(input + i * p.in_stride + b * kBlock, size, d, r.a + i * p.in_features + b * kBlock, lanes);
      const int32_t first = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      const int32_t second = lanes[4] + lanes[5] + lanes[6] + lanes[7];
      r.dsum[i * r.padded + b] = d * static_cast<float>(first + second);
      if (panels) {
        int32_t* offsets = r.half_offsets + (i * r.blocks + b) * 2;
        offsets[0] = -offset * (halves ? first : first + second);
        offsets[1] = halves ? -offset * second : 0;
      } else {
        for (int l = 0; l < kLanes; ++l) r.offset_sums[(i * r.blocks + b) * kLanes + l] = -offset * lanes[l];
      }
    }
  }
}

// Every input row rounded (round_rows), split over the threads from 16K inputs on (W4A8's
// rounding_grain waits for 64K): at 64 rows of 576 the rounding on one thread was a fifth of a
// panel product's time on two.
template <typename T>
void round_inputs(const LinearParams& p, bool panels, int offset, bool halves, RoundedInputs& r) {
  layout_inputs(p, r);
  parallel_for(p.rows, grain_for(p.rows, p.in_features, 1 << 14, 1 << 12), [&](int64_t begin, int64_t end) {
    round_rows<T>(p, panels, offset, halves, begin, end, r);
  });
}

// ---- the kernel --------------------------------------------------------------------------------
// Weight rows n.. n + kTileRows - 1 (rows past the matrix repeat row n; their results are dropped).
template <WeightFormat F>
struct Tile {
  using Format = gguf::Gguf<F>;
  static constexpr int kSub = Format::kWeights / kBlock;
  const uint8_t* row[kTileRows];
  int64_t row_bytes;
  const uint8_t* end;  // of the weights
  Tile(const LinearParams& p, int64_t n, int nr)
      : row_bytes(p.in_features / Format::kWeights * Format::kBytes),
        end(static_cast<const uint8_t*>(p.weight) + p.out_features * row_bytes) {
    for (int t = 0; t < kTileRows; ++t)
      row[t] = static_cast<const uint8_t*>(p.weight) + (n + (t < nr ? t : 0)) * row_bytes;
  }
  // The (super-)block holding block blk, and blk's sub-block in it.
  const uint8_t* container(int t, int64_t blk) const { return row[t] + blk / kSub * Format::kBytes; }
};

// Per weight row and input row of a batch of blocks: d * s (and the second halves' d * s).
struct BatchScales {
  alignas(64) float first[kTileRows][kInputRows][kScaleBatch];
  alignas(64) float second[kTileRows][kInputRows][kScaleBatch];
};

// The minimums' terms of a tile's (weight row, input row) pairs: eight lanes where vectors are.
#if defined(__AVX2__)
using Minimums = __m256;
#else
using Minimums = float;
#endif

#if defined(__AVX2__)
// All ones in the 32-bit lanes below count.
inline __m256i lane_mask(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The two scale values of 8 blocks [blk, blk + 8) of a row (none past `count`: zeros), in
// registers; the weights end at `end`. Blocks of 32 have their float16 d and m in their first
// dword: eight scalar loads and two conversions (on Zen 4 a gather of them took a third of the
// kernel's time, and scalar conversions stored one by one stall the vector load that reads them
// back); the K-quants' eight sub-blocks' values are stored eight at a time and read back whole.
template <WeightFormat F>
OCTAVO_ALWAYS_INLINE void scales8(const uint8_t* row, int64_t blk, int count, const uint8_t* end, __m256& s,
                                  __m256& m) {
  using Format = gguf::Gguf<F>;
  if constexpr (Format::kWeights > kBlock) {
    alignas(32) float a[8], b[8];
    Format::sub_scales(row + blk / 8 * Format::kBytes, a, b);
    s = _mm256_load_ps(a);
    m = _mm256_load_ps(b);
  } else {
    const uint8_t* b = row + blk * Format::kBytes;
    // Eight dwords, past `count` too where the weights go on (those lanes are cleared after), read
    // one by one and inserted (a vector load of scalar stores would stall on store forwarding).
    const auto word = [b](int i) {
      int v;
      std::memcpy(&v, b + i * Format::kBytes, 4);
      return v;
    };
    __m256i dm;
    if (b + 8 * Format::kBytes <= end) {
      dm = _mm256_setr_epi32(word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7));
    } else {  // the weights' last blocks
      int words[8] = {};
      for (int i = 0; i < std::min(count, 8); ++i) words[i] = word(i);
      dm = _mm256_setr_epi32(words[0], words[1], words[2], words[3], words[4], words[5], words[6], words[7]);
    }
    dm = _mm256_and_si256(lane_mask(count), dm);
    gguf::scale_pairs(dm, s, m);
  }
}
#endif

// Reads the batch's weight scales, multiplies them by the inputs' d, and adds the minimums' terms.
template <WeightFormat F, int M>
OCTAVO_ALWAYS_INLINE void batch_scales(const Tile<F>& w, const RoundedInputs& r, int64_t i, int64_t first, int count,
                                       BatchScales& out, Minimums (&minimums)[kTileRows][kInputRows]) {
  using B = Bytes<F>;
  for (int t = 0; t < kTileRows; ++t) {
#if defined(__AVX2__)
    for (int k = 0; k < kScaleBatch; k += 8) {
      if (k >= count) break;
      __m256 sk, mk;
      scales8<F>(w.row[t], first + k, count - k, w.end, sk, mk);
      for (int c = 0; c < M; ++c) {
        const float* d = r.d + (i + c) * r.padded + first + k;
        const float* dsum = r.dsum + (i + c) * r.padded + first + k;
        const __m256 dk = _mm256_loadu_ps(d);
        _mm256_store_ps(out.first[t][c] + k, _mm256_mul_ps(sk, dk));
        if constexpr (B::kHalves) _mm256_store_ps(out.second[t][c] + k, _mm256_mul_ps(mk, dk));
        if constexpr (B::kMin > 0) minimums[t][c] = _mm256_fmadd_ps(mk, _mm256_loadu_ps(dsum), minimums[t][c]);
        if constexpr (B::kMin < 0) minimums[t][c] = _mm256_fnmadd_ps(mk, _mm256_loadu_ps(dsum), minimums[t][c]);
      }
    }
#else
    float s[kScaleBatch], m[kScaleBatch];
    gguf::read_scales<F>(w.row[t], first, count, s, m);
    for (int c = 0; c < M; ++c) {
      const float* d = r.d + (i + c) * r.padded + first;
      const float* dsum = r.dsum + (i + c) * r.padded + first;
      for (int k = 0; k < count; ++k) {
        out.first[t][c][k] = s[k] * d[k];
        if constexpr (B::kHalves) out.second[t][c][k] = m[k] * d[k];
        if constexpr (B::kMin > 0) minimums[t][c] += m[k] * dsum[k];
        if constexpr (B::kMin < 0) minimums[t][c] -= m[k] * dsum[k];
      }
    }
#endif
  }
}

#if defined(__AVX2__)
OCTAVO_ALWAYS_INLINE __m256i dot_add(__m256i acc, __m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}
inline float reduce8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

// out[t][c] = weight row t of the tile against input row i + c, c < M.
template <WeightFormat F, int M>
void dot_tile(const Tile<F>& w, const RoundedInputs& r, int64_t i, int64_t K, float out[kTileRows][kInputRows]) {
  using B = Bytes<F>;
  constexpr int kSub = Tile<F>::kSub;
  Minimums minimums[kTileRows][kInputRows];
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) minimums[t][c] = Minimums{};
  BatchScales scales;
#if defined(__AVX2__)
  __m256 acc[kTileRows][M];
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) acc[t][c] = _mm256_setzero_ps();
#else
  float acc[kTileRows][M] = {};
#endif
  for (int64_t first = 0; first < r.blocks; first += kScaleBatch) {
    const int count = static_cast<int>(std::min<int64_t>(kScaleBatch, r.blocks - first));
    batch_scales<F, M>(w, r, i, first, count, scales, minimums);
    for (int k = 0; k < count; ++k) {
      const int64_t blk = first + k;
      const int sub = static_cast<int>(blk % kSub);
      const int64_t in = blk * kBlock;
#if defined(__AVX2__)
      __m256i a[M], start[M];
      for (int c = 0; c < M; ++c) {
        a[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.a + (i + c) * K + in));
        const int32_t* sums = r.offset_sums + ((i + c) * r.blocks + blk) * kLanes;
        start[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums));
      }
      for (int t = 0; t < kTileRows; ++t) {
        const uint8_t* b = w.container(t, blk);
        // Two tiles ahead, as linear.cc's kernels prefetch; every other block (18-34 bytes each)
        // still touches every cache line.
        const int64_t ahead = sub * (Tile<F>::Format::kBytes / kSub) + 2 * kTileRows * w.row_bytes;
        if ((blk & 1) == 0) __builtin_prefetch(b + ahead);
        const __m256i u = B::load(b, sub);
        for (int c = 0; c < M; ++c) {
          // Signed values (offset 0, so start is 0): |w| times a with w's sign.
          const __m256i sums = B::kSigned ? dot_add(start[c], _mm256_abs_epi8(u), _mm256_sign_epi8(a[c], u))
                                          : dot_add(start[c], u, a[c]);
          __m256 scale = _mm256_set1_ps(scales.first[t][c][k]);
          if constexpr (B::kHalves) scale = _mm256_blend_ps(scale, _mm256_set1_ps(scales.second[t][c][k]), 0xF0);
          acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[t][c]);
        }
      }
#else
      for (int t = 0; t < kTileRows; ++t) {
        const uint8_t* b = w.container(t, blk);
        for (int c = 0; c < M; ++c) {
          const int8_t* a = r.a + (i + c) * K + in;
          int32_t half[2] = {0, 0};
          for (int e = 0; e < kBlock; ++e) half[e / 16] += (B::value(b, sub, e) - B::kOffset) * a[e];
          const float second = B::kHalves ? scales.second[t][c][k] : scales.first[t][c][k];
          acc[t][c] += static_cast<float>(half[0]) * scales.first[t][c][k] + static_cast<float>(half[1]) * second;
        }
      }
#endif
    }
  }
  for (int t = 0; t < kTileRows; ++t)
    for (int c = 0; c < M; ++c) {
#if defined(__AVX2__)
      out[t][c] = reduce8(acc[t][c]) + reduce8(minimums[t][c]);
#else
      out[t][c] = acc[t][c] + minimums[t][c];
#endif
    }
}

// The rows kernel: each weight tile's blocks against kInputRows input rows at a time.
template <WeightFormat F, typename T>
void linear_rows(const LinearParams& p, const RoundedInputs& r) {
  const int64_t tiles = (p.out_features + kTileRows - 1) / kTileRows;
  const int64_t weight_bytes = p.out_features * Tile<F>(p, 0, 1).row_bytes, threads = get_num_threads();
  const int64_t grain = weight_bytes < (int64_t{1} << 16) ? tiles : (tiles + threads - 1) / threads;
  const auto store = [&](int64_t i, int64_t n, int nr, const float (&y)[kTileRows][kInputRows], int c) {
    T* out = static_cast<T*>(p.out) + i * p.out_stride + n;
    for (int t = 0; t < nr; ++t)
      out[t] = from_float<T>(p.bias != nullptr ? y[t][c] + to_float(static_cast<const T*>(p.bias)[n + t]) : y[t][c]);
  };
  // Input rows in chunks whose rounded inputs (about 2.25 bytes per input) stay in L2 while every
  // weight tile of the thread's slab passes over them; without chunks a prefill streamed all of
  // them from L3 or memory once per 4 weight rows. Chunks are whole groups of input rows, so every
  // row is computed the same way whatever M is.
  const int64_t chunk = std::max<int64_t>(4, (int64_t{1} << 17) / (3 * p.in_features) / 4 * 4);
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m_begin = 0; m_begin < p.rows; m_begin += chunk) {
      const int64_t m_end = std::min(p.rows, m_begin + chunk);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t n = tile * kTileRows;
        const int nr = static_cast<int>(std::min<int64_t>(kTileRows, p.out_features - n));
        const Tile<F> w(p, n, nr);
        float y[kTileRows][kInputRows] = {};
        int64_t i = m_begin;
        for (; i + kInputRows <= m_end; i += kInputRows) {
          dot_tile<F, kInputRows>(w, r, i, p.in_features, y);
          for (int c = 0; c < kInputRows; ++c) store(i + c, n, nr, y, c);
        }
        // The rest one at a time: a row's sums do not depend on the rows it ran with.
        for (; i < m_end; ++i) {
          dot_tile<F, 1>(w, r, i, p.in_features, y);
          store(i, n, nr, y, 0);
        }
      }
    }
  });
}

}  // namespace gguf_a8
}  // namespace octavo::cpu::OCTAVO_ISA
