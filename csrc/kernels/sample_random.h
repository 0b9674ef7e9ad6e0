// The sampler's random numbers and greedy cut-off, shared by the CPU and CUDA kernels: the same
// (seed, counter) draws the same u on both, so with the same kept weights both pick the same
// token. `static`: every translation unit keeps its own copy, since the CPU files are compiled
// once per instruction set and must not share code built for another.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace octavo::sampling {

constexpr float kGreedyTemperature = 1e-5f;  // below this a request is greedy, as in vLLM

// splitmix64's finalizer: a bijective 64-bit mix whose outputs look independent for
// neighbouring inputs, so (seed, counter) pairs give a counter-based random stream.
OCTAVO_HOST_DEVICE static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// u in [0, 1) with 53 random bits.
OCTAVO_HOST_DEVICE static inline double uniform(int64_t seed, int64_t counter) {
  const uint64_t h = mix64(mix64(static_cast<uint64_t>(seed) + 0x9e3779b97f4a7c15ull) ^ static_cast<uint64_t>(counter));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

}  // namespace octavo::sampling
