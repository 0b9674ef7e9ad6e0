// The integer fields of GGUF's K-quant super-blocks that the CPU (cpu/gguf_blocks.h) and CUDA
// (cuda/weight_rows.cuh) decoders both unpack, defined once (ggml-common.h's layouts).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace octavo::gguf_scales {

// Q4_K / Q5_K: sub-block i's 6-bit scale and minimum, packed in 12 bytes q (ggml's
// get_scale_min_k4): the first four in the low 6 bits of bytes 0-3 and 4-7, the last four in the
// nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7.
OCTAVO_HOST_DEVICE inline void k4(const uint8_t* q, int i, int& scale, int& min) {
  if (i < 4) {
    scale = q[i] & 63;
    min = q[i + 4] & 63;
  } else {
    scale = (q[i + 4] & 0xF) | ((q[i - 4] >> 6) << 4);
    min = (q[i + 4] >> 4) | ((q[i] >> 6) << 4);
  }
}

// Q3_K: the scale of weights [16i, 16i + 16), 6 bits stored + 32 in 12 bytes q: the low 4 bits
// in the nibbles of bytes 0-7 (i < 8 low, else high), the top 2 in bytes 8-11.
OCTAVO_HOST_DEVICE inline int k3(const uint8_t* q, int i) {
  const int low = (i < 8 ? q[i] : q[i - 8] >> 4) & 0xF;
  const int high = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (low | (high << 4)) - 32;
}

}  // namespace octavo::gguf_scales

// IQ4_NL's grid: the int8 value each of its 16 indices stands for (llama.cpp's kvalues_iq4nl),
// for the CPU's and CUDA's tables.
#define OCTAVO_IQ4_NL_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
