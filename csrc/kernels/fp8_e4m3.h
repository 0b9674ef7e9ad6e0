// FP8 E4M3 (torch.float8_e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, 0x7f / 0xff are NaN, the largest finite value is 448) to and from float, for an
// fp8 KV cache (kv_cache_dtype="fp8"). One definition for the CPU and CUDA kernels, so that a
// cache written on either device reads the same on both.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace octavo {
// Internal linkage: the CPU kernels compile this header once per ISA level with different -m
// flags, and the linker must not pick one level's copy for all of them (see cpu/vec.h).
namespace {

constexpr float kFp8E4M3Max = 448.0f;

OCTAVO_HOST_DEVICE inline uint32_t fp8_float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

OCTAVO_HOST_DEVICE inline float fp8_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// x rounded to the nearest E4M3 value (ties to even). Magnitudes past 448, infinities included,
// saturate to +-448 as vLLM's fp8 cache writes do (torch's .to(float8_e4m3fn) gives NaN there);
// NaN stays NaN.
OCTAVO_HOST_DEVICE inline uint8_t fp8_e4m3_from_float(float x) {
  const uint32_t u = fp8_float_bits(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // |x| >= 448
  if (a < 0x3c800000u) {                     // |x| < 2^-6: subnormal steps of 2^-9 (8 steps = 2^-6, code 0x08)
    return sign | static_cast<uint8_t>(rintf(fp8_bits_float(a) * 512.0f));
  }
  // Normal: keep 3 of float's 23 mantissa bits, ties to even (a carry moves into the exponent),
  // and rebias the exponent from 127 to 7.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return sign | static_cast<uint8_t>((r >> 20) - (120u << 3));
}

OCTAVO_HOST_DEVICE inline float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if ((b & 0x7f) == 0x7f) v = NAN;
  else if (e == 0) v = static_cast<float>(m) * (1.0f / 512.0f);
  else v = fp8_bits_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80) ? -v : v;
}

}  // namespace
}  // namespace octavo
