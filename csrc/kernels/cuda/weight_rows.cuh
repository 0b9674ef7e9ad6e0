// The weight formats as CUDA kernels read them: each format's row decoder (Row(p, n), then
// decode(blk, q, w) for part q of each block of 32 weights), shared by linear / dequantize
// (linear.cu) and the experts of fused_moe (moe.cu).
//
// A decoded weight is the float that the CPU kernel decodes and `dequantize` writes, bit for
// bit: GGUF formats with the gguf package's arithmetic (one product; Q4_1 then a separate sum,
// written as __fmul_rn / __fadd_rn so that nvcc cannot contract them into one FMA).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "gguf_scales.h"
#include "params.h"

namespace octavo::cuda {

constexpr int kBlockWeights = 32;  // weights per block, in every format
constexpr int kParts = 4;          // threads per block of 32 weights, 8 weights each

inline bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// ---- loads ----------------------------------------------------------------------------------

// Four elements of T, read or written with one load / store (p aligned to 4 elements).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};
template <typename T>
__device__ __forceinline__ void load4(const T* p, float out[4]) {
  const Quad<T> q = *reinterpret_cast<const Quad<T>*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = to_float(q.v[i]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float in[4]) {
  Quad<T> q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Quad<T>*>(p) = q;
}

// Four bytes at p: one load where p is 4-byte aligned, two where it is only 2-byte aligned (the
// quants of Q8_0's 34-byte and Q4_0's 18-byte blocks).
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t load_u32_2aligned(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
}
__device__ __forceinline__ float half_at(const uint8_t* p) { return to_float(*reinterpret_cast<const f16*>(p)); }

// ---- decoding: the 8 weights of part q, w[i] = weight 4q + i, w[4 + i] = weight 16 + 4q + i ----

// u - offset, for integers u < 2^23 and offset, without an integer-to-float conversion (those
// run at a quarter of the FP32 rate or less, too slow to decode 4-bit weights at memory speed):
// the float with 2^23's exponent and u in its mantissa is 2^23 + u, and subtracting 2^23 +
// offset is exact.
__device__ __forceinline__ float minus(uint32_t u, float offset) {
  return __uint_as_float(0x4B000000u | u) - (8388608.0f + offset);
}

// Signed bytes `lo` (weights 4q..) and `hi` (16 + 4q..) times scale. Flipping each byte's top
// bit gives q + 128 unsigned.
__device__ __forceinline__ void signed_bytes(uint32_t lo, uint32_t hi, float scale, float w[8]) {
  lo ^= 0x80808080u, hi ^= 0x80808080u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = __fmul_rn(minus((lo >> (8 * i)) & 0xFFu, 128.0f), scale);
    w[4 + i] = __fmul_rn(minus((hi >> (8 * i)) & 0xFFu, 128.0f), scale);
  }
}

// Nibbles of four bytes (low: weights 4q.., high: 16 + 4q..) as (nibble - offset) * scale, then
// + min for Q4_1 (kMin).
template <bool kMin>
__device__ __forceinline__ void nibbles(uint32_t bytes, float offset, float scale, float min, float w[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t nibble = (bytes >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15u;
    const float v = __fmul_rn(minus(nibble, offset), scale);
    w[i] = kMin ? __fadd_rn(v, min) : v;
  }
}

// Part q's 8 weights (v, as decode gives them) in their places of the whole block's 32.
__device__ __forceinline__ void place_part(int q, const float v[8], float out[32]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[4 * q + i] = v[i];
    out[16 + 4 * q + i] = v[4 + i];
  }
}

// The four 32-bit words of 16 bytes.
__device__ __forceinline__ void words_of(const uint4& b, uint32_t (&w)[4]) {
  w[0] = b.x, w[1] = b.y, w[2] = b.z, w[3] = b.w;
}

// One row n of the weight, per format: Row(p, n), then decode(blk, q, w) for each block.
// kAlign: the byte alignment its loads need of the weight's start. Formats whose blocks are
// aligned runs of 16 or 32 bytes also have decode_block(blk, w), all 32 weights of a block from
// 16-byte loads, which need kBlockAlign (16) of the weight's start (see decode_block below).
template <typename T>
struct DenseRow {
  static constexpr int kAlign = 4 * sizeof(T), kBlockAlign = 16;
  const T* w;
  __device__ DenseRow(const LinearParams& p, int64_t n) : w(static_cast<const T*>(p.weight) + n * p.in_features) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    load4(w + blk * kBlockWeights + 4 * q, out);
    load4(w + blk * kBlockWeights + 16 + 4 * q, out + 4);
  }
  __device__ void decode_block(int64_t blk, float out[32]) const {
#pragma unroll
    for (int i = 0; i < kBlockWeights; i += Pack<T>::kSize) {
      const Pack<T> pack = load_pack(w + blk * kBlockWeights + i);
#pragma unroll
      for (int e = 0; e < Pack<T>::kSize; ++e) out[i + e] = to_float(pack.v[e]);
    }
  }
};

// GGUF blocks (ggml's block_q8_0, block_q4_0, block_q4_1): float16 scale d (Q4_1 also a float16
// minimum m), then the quants; Q8_0: w = d * q; Q4_0: w = d * (q - 8); Q4_1: w = d * q + m.
template <int kBytes>
struct GgufRow {
  const uint8_t* w;
  __device__ GgufRow(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * (p.in_features / kBlockWeights * kBytes)) {}
  __device__ const uint8_t* block(int64_t blk) const { return w + blk * kBytes; }
};
struct Q8_0Row : GgufRow<34> {
  static constexpr int kAlign = 2;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    signed_bytes(load_u32_2aligned(b + 2 + 4 * q), load_u32_2aligned(b + 18 + 4 * q), half_at(b), out);
  }
};
struct Q4_0Row : GgufRow<18> {
  static constexpr int kAlign = 2;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    nibbles<false>(load_u32_2aligned(b + 2 + 4 * q), 8.0f, half_at(b), 0.0f, out);
  }
};
struct Q4_1Row : GgufRow<20> {
  static constexpr int kAlign = 4;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    nibbles<true>(load_u32(b + 4 + 4 * q), 0.0f, half_at(b), half_at(b + 2), out);
  }
};

// Q5_0 / Q5_1 (kMin): Q4_0's / Q4_1's nibbles, and weight i's fifth bit in bit i of a uint32
// after d (and m); Q5_0: w = d * (q - 16), Q5_1: w = d * q + m.
template <int kBytes, bool kMin>
struct Q5Row : GgufRow<kBytes> {
  static constexpr int kAlign = kMin ? 4 : 2;
  static constexpr int kHigh = kMin ? 4 : 2;  // offset of the fifth bits; the nibbles follow
  using GgufRow<kBytes>::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = this->block(blk);
    const uint32_t high = load_u32_2aligned(b + kHigh), bytes = load_u32_2aligned(b + kHigh + 4 + 4 * q);
    const float d = half_at(b), m = kMin ? half_at(b + 2) : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int weight = i < 4 ? 4 * q + i : 16 + 4 * q + i - 4;
      const uint32_t v = ((bytes >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15u) | (((high >> weight) & 1u) << 4);
      const float w = __fmul_rn(minus(v, kMin ? 0.0f : 16.0f), d);
      out[i] = kMin ? __fadd_rn(w, m) : w;
    }
  }
};
using Q5_0Row = Q5Row<22, false>;
using Q5_1Row = Q5Row<24, true>;

// IQ4_NL: Q4_0's nibbles index a grid of 16 int8 values; w = d * value.
__constant__ const float kIq4NlValues[16] = {OCTAVO_IQ4_NL_VALUES};
struct IQ4_NLRow : GgufRow<18> {
  static constexpr int kAlign = 2;
  using GgufRow::GgufRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = block(blk);
    const uint32_t bytes = load_u32_2aligned(b + 2 + 4 * q);
    const float d = half_at(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(kIq4NlValues[(bytes >> (i < 4 ? 8 * i : 8 * (i - 4) + 4)) & 15u], d);
  }
};

// ---- K-quants: super-blocks of 256 weights, decoded per sub-block of 32 (blk counts those) ----
// Each thread unpacks its sub-block's scales itself: a few integer operations per 8 weights.
template <int kBytes>
struct SuperRow {
  const uint8_t* w;
  __device__ SuperRow(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * (p.in_features / 256 * kBytes)) {}
  __device__ const uint8_t* super_block(int64_t blk) const { return w + (blk >> 3) * kBytes; }
};

// Bits [shift, shift + width) of byte i of word.
__device__ __forceinline__ uint32_t field(uint32_t word, int i, int shift, uint32_t mask) {
  return (word >> (8 * i + shift)) & mask;
}

// Q4_K / Q5_K (kFifth): d, dmin, packed 6-bit scales and minimums, [32 bytes of fifth bits,] 128
// bytes of nibbles; sub-block s: w = (d * sc) * q - dmin * mn, q the low (s even) or high nibbles
// of bytes 32 (s / 2).., plus 16 for bit s of the fifth-bit bytes.
template <bool kFifth>
struct QK4Row : SuperRow<kFifth ? 176 : 144> {
  static constexpr int kAlign = 4;
  static constexpr int kQuants = kFifth ? 48 : 16;
  using SuperRow<kFifth ? 176 : 144>::SuperRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = this->super_block(blk);
    const int s = static_cast<int>(blk & 7);
    int sc, mn;
    gguf_scales::k4(b + 4, s, sc, mn);
    const float a = __fmul_rn(half_at(b), static_cast<float>(sc));
    const float m = __fmul_rn(half_at(b + 2), static_cast<float>(mn));
    const uint8_t* quants = b + kQuants + 32 * (s >> 1);
    const uint32_t words[2] = {load_u32(quants + 4 * q), load_u32(quants + 16 + 4 * q)};
    const uint32_t high[2] = {kFifth ? load_u32(b + 16 + 4 * q) : 0u, kFifth ? load_u32(b + 32 + 4 * q) : 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = field(words[i / 4], i % 4, 4 * (s & 1), 15u) | (field(high[i / 4], i % 4, s, 1u) << 4);
      out[i] = __fsub_rn(__fmul_rn(minus(v, 0.0f), a), m);
    }
  }
};
using Q4_KRow = QK4Row<false>;
using Q5_KRow = QK4Row<true>;

// Q6_K: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per 16 weights), d.
// Sub-block s = 4h + c: nibbles of bytes 64h + 32 (c % 2).. shifted by 4 (c / 2), high bits of
// bytes 128 + 32h.. shifted by 2c; w = (d * scale) * (q - 32).
struct Q6_KRow : SuperRow<210> {
  static constexpr int kAlign = 2;
  using SuperRow::SuperRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = super_block(blk);
    const int s = static_cast<int>(blk & 7), h = s >> 2, c = s & 3;
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 2 * s;
    const float scale[2] = {__fmul_rn(d, static_cast<float>(sc[0])), __fmul_rn(d, static_cast<float>(sc[1]))};
    const uint8_t *low = b + 64 * h + 32 * (c & 1), *high = b + 128 + 32 * h;
    const uint32_t lows[2] = {load_u32_2aligned(low + 4 * q), load_u32_2aligned(low + 16 + 4 * q)};
    const uint32_t highs[2] = {load_u32_2aligned(high + 4 * q), load_u32_2aligned(high + 16 + 4 * q)};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = field(lows[i / 4], i % 4, 4 * (c >> 1), 15u) | (field(highs[i / 4], i % 4, 2 * c, 3u) << 4);
      out[i] = __fmul_rn(minus(v, 32.0f), scale[i / 4]);
    }
  }
};

// Q3_K: 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales (one per 16 weights), d.
// Sub-block s = 4h + c: 2-bit quants of bytes 32 + 32h.. shifted by 2c, high bit s of bytes
// 0..; w = (d * scale) * q, q = low - 4 where the high bit is clear.
struct Q3_KRow : SuperRow<110> {
  static constexpr int kAlign = 2;
  using SuperRow::SuperRow;
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = super_block(blk);
    const int s = static_cast<int>(blk & 7), h = s >> 2, c = s & 3;
    const float d = half_at(b + 108);
    const float scale[2] = {__fmul_rn(d, static_cast<float>(gguf_scales::k3(b + 96, 2 * s))),
                            __fmul_rn(d, static_cast<float>(gguf_scales::k3(b + 96, 2 * s + 1)))};
    const uint8_t* low = b + 32 + 32 * h;
    const uint32_t lows[2] = {load_u32_2aligned(low + 4 * q), load_u32_2aligned(low + 16 + 4 * q)};
    const uint32_t highs[2] = {load_u32_2aligned(b + 4 * q), load_u32_2aligned(b + 16 + 4 * q)};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = field(lows[i / 4], i % 4, 2 * c, 3u) | (field(highs[i / 4], i % 4, s, 1u) << 2);
      out[i] = __fmul_rn(minus(v, 4.0f), scale[i / 4]);
    }
  }
};

// Octavo's load-time formats (ops.h): int8, w = q * s per row; int4, w = (q - z) * s per row and
// group of group_size inputs, nibbles ordered as GGUF's.
struct Int8Row {
  static constexpr int kAlign = 4, kBlockAlign = 16;
  const int8_t* w;
  float scale;
  __device__ Int8Row(const LinearParams& p, int64_t n)
      : w(static_cast<const int8_t*>(p.weight) + n * p.in_features), scale(p.scales[n]) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(w + blk * kBlockWeights);
    signed_bytes(load_u32(b + 4 * q), load_u32(b + 16 + 4 * q), scale, out);
  }
  __device__ void decode_block(int64_t blk, float out[32]) const {
    const uint4* b = reinterpret_cast<const uint4*>(w + blk * kBlockWeights);
    uint32_t lo[4], hi[4];
    words_of(b[0], lo);
    words_of(b[1], hi);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      float v[8];
      signed_bytes(lo[q], hi[q], scale, v);
      place_part(q, v, out);
    }
  }
};
struct Int4Row {
  static constexpr int kAlign = 4, kBlockAlign = 16;
  const uint8_t* w;
  const float* scales;
  const uint8_t* zeros;
  int32_t blocks_per_group;
  __device__ Int4Row(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * (p.in_features / 2)),
        scales(p.scales + n * (p.in_features / p.group_size)),
        zeros(p.zeros + n * (p.in_features / p.group_size)),
        blocks_per_group(static_cast<int32_t>(p.group_size / kBlockWeights)) {}
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const int32_t g = static_cast<int32_t>(blk) / blocks_per_group;  // 32-bit: a 64-bit divide is a long call
    nibbles<false>(load_u32(w + blk * (kBlockWeights / 2) + 4 * q), static_cast<float>(zeros[g]), scales[g], 0.0f,
                   out);
  }
  __device__ void decode_block(int64_t blk, float out[32]) const {
    uint32_t words[4];
    words_of(*reinterpret_cast<const uint4*>(w + blk * (kBlockWeights / 2)), words);
    const int32_t g = static_cast<int32_t>(blk) / blocks_per_group;
    const float zero = static_cast<float>(zeros[g]), scale = scales[g];
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      float v[8];
      nibbles<false>(words[q], zero, scale, 0.0f, v);
      place_part(q, v, out);
    }
  }
};

// fp8: FP8 checkpoints' E4M3 weights, w = q * s per row and group of group_size inputs.
struct Fp8Row {
  static constexpr int kAlign = 4, kBlockAlign = 16;
  const uint8_t* w;
  const float* scales;
  int32_t blocks_per_group;
  __device__ Fp8Row(const LinearParams& p, int64_t n)
      : w(static_cast<const uint8_t*>(p.weight) + n * p.in_features),
        scales(p.scales + n * (p.in_features / p.group_size)),
        blocks_per_group(static_cast<int32_t>(p.group_size / kBlockWeights)) {}
  __device__ float scale(int64_t blk) const {
    return scales[static_cast<int32_t>(blk) / blocks_per_group];  // 32-bit divide, as Int4Row
  }
  // Codes lo (weights 4q..) and hi (16 + 4q..) times scale.
  __device__ static void part(uint32_t lo, uint32_t hi, float scale, float out[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[i] = __fmul_rn(fp8_e4m3_to_float(static_cast<uint8_t>(lo >> (8 * i))), scale);
      out[4 + i] = __fmul_rn(fp8_e4m3_to_float(static_cast<uint8_t>(hi >> (8 * i))), scale);
    }
  }
  __device__ void decode(int64_t blk, int q, float out[8]) const {
    const uint8_t* b = w + blk * kBlockWeights;
    part(load_u32(b + 4 * q), load_u32(b + 16 + 4 * q), scale(blk), out);
  }
  __device__ void decode_block(int64_t blk, float out[32]) const {
    const uint4* b = reinterpret_cast<const uint4*>(w + blk * kBlockWeights);
    uint32_t lo[4], hi[4];
    words_of(b[0], lo);
    words_of(b[1], hi);
    const float s = scale(blk);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      float v[8];
      part(lo[q], hi[q], s, v);
      place_part(q, v, out);
    }
  }
};

// Whether Row has decode_block (16-byte loads of whole blocks), and the alignment of the weight's
// start that decode_block below needs.
template <typename Row, typename = void>
struct HasBlockLoads : std::false_type {};
template <typename Row>
struct HasBlockLoads<Row, std::void_t<decltype(Row::kBlockAlign)>> : std::true_type {};
template <typename Row>
constexpr int block_align() {
  if constexpr (HasBlockLoads<Row>::value) return Row::kBlockAlign;
  else return Row::kAlign;
}

// All 32 weights of block blk, out[i] = weight i: the same floats as decode's parts, in one or two
// 16-byte loads where the format has them (a GGUF block's fields are not 16-byte aligned).
template <typename Row>
__device__ __forceinline__ void decode_block(const Row& w, int64_t blk, float out[32]) {
  if constexpr (HasBlockLoads<Row>::value) {
    w.decode_block(blk, out);
  } else {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      float v[8];
      w.decode(blk, q, v);
      place_part(q, v, out);
    }
  }
}

// Calls fn(static_cast<Row*>(nullptr)) with the row decoder of a GGUF format and returns true;
// false for the other formats.
template <typename Fn>
bool dispatch_gguf(WeightFormat format, Fn&& fn) {
  switch (format) {
    case WeightFormat::kQ8_0: return fn(static_cast<Q8_0Row*>(nullptr)), true;
    case WeightFormat::kQ4_0: return fn(static_cast<Q4_0Row*>(nullptr)), true;
    case WeightFormat::kQ4_1: return fn(static_cast<Q4_1Row*>(nullptr)), true;
    case WeightFormat::kQ5_0: return fn(static_cast<Q5_0Row*>(nullptr)), true;
    case WeightFormat::kQ5_1: return fn(static_cast<Q5_1Row*>(nullptr)), true;
    case WeightFormat::kIQ4_NL: return fn(static_cast<IQ4_NLRow*>(nullptr)), true;
    case WeightFormat::kQ3_K: return fn(static_cast<Q3_KRow*>(nullptr)), true;
    case WeightFormat::kQ4_K: return fn(static_cast<Q4_KRow*>(nullptr)), true;
    case WeightFormat::kQ5_K: return fn(static_cast<Q5_KRow*>(nullptr)), true;
    case WeightFormat::kQ6_K: return fn(static_cast<Q6_KRow*>(nullptr)), true;
    default: return false;
  }
}

// Calls fn(static_cast<Row*>(nullptr)) with the row decoder of `format` (dense: of T) and returns
// true; false for the formats CUDA does not read (the CPU's bf16 tiles and int8-input formats).
template <typename T, typename Fn>
bool dispatch_rows(WeightFormat format, Fn&& fn) {
  if (dispatch_gguf(format, fn)) return true;
  switch (format) {
    case WeightFormat::kDense: return fn(static_cast<DenseRow<T>*>(nullptr)), true;
    case WeightFormat::kInt8: return fn(static_cast<Int8Row*>(nullptr)), true;
    case WeightFormat::kInt4: return fn(static_cast<Int4Row*>(nullptr)), true;
    case WeightFormat::kFp8: return fn(static_cast<Fp8Row*>(nullptr)), true;
    default: return false;
  }
}

// The kR x kC dot products of weight rows w with input rows x over in_features, as linear_kernel
// and fused_moe's expert_gemv_kernel compute them: the block's kThreads threads walk the blocks
// of 32 weights, kParts threads per block (part q decodes weights 4q.. and 16 + 4q..), and each
// warp's sums are reduced by a butterfly into partial[warp][r][c]. Returns after a barrier;
// sum_partial then adds the warps in order, so a row's sum does not depend on the others.
template <int kThreads, typename Row, typename TIn, int kR, int kC>
__device__ __forceinline__ void dot_rows(const Row (&w)[kR], const TIn* const (&x)[kC], int64_t in_features,
                                         float (&partial)[kThreads / 32][kR][kC]) {
  const int q = threadIdx.x % kParts;
  float acc[kR][kC] = {};
  const int64_t blocks = in_features / kBlockWeights;
  for (int64_t blk = threadIdx.x / kParts; blk < blocks; blk += kThreads / kParts) {
    const int64_t k = blk * kBlockWeights + 4 * q;
    float xs[kC][8];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      load4(x[c] + k, xs[c]);
      load4(x[c] + k + 16, xs[c] + 4);
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      float ws[8];
      w[r].decode(blk, q, ws);
#pragma unroll
      for (int c = 0; c < kC; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r][c] = fmaf(ws[j], xs[c][j], acc[r][c]);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      float v = acc[r][c];
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0) partial[warp][r][c] = v;
    }
  __syncthreads();
}

template <int kWarps, int kR, int kC>
__device__ __forceinline__ float sum_partial(const float (&partial)[kWarps][kR][kC], int r, int c) {
  float sum = partial[0][r][c];
  for (int i = 1; i < kWarps; ++i) sum += partial[i][r][c];
  return sum;
}

}  // namespace octavo::cuda
