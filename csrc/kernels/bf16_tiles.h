// The layout of WeightFormat::kBf16Tiles: a bfloat16 weight [N, K] stored as the AMX weight tiles
// that cpu/linear_amx.h otherwise builds on every call.
//
// An AMX bf16 multiply takes its weight tile in "VNNI" layout: tile row i holds, for 16 output
// features, the pair of weights (k = 2i, 2i + 1) of each. Rows are grouped in panels of 32 (two
// tiles side by side); panel p takes the bytes rows [32p, 32p + 32) take in the dense layout, as
// K / 32 pairs of 1 KiB tiles: tile (kb, h) holds rows 32p + 16h .. + 15 and inputs
// [32kb, 32kb + 32). So a product reads a panel front to back with plain tile loads, and the
// vector kernel for a single input row multiplies 16 features at once with no horizontal sums.
#pragma once

#include <cstdint>

namespace octavo::bf16_tiles {

constexpr int64_t kPanelRows = 32;     // weight rows per panel
constexpr int64_t kTileK = 32;         // inputs per tile (16 pairs)
constexpr int64_t kTileElements = 512; // bf16 per tile: 16 rows x 64 bytes

// Index, in bf16 elements, of weight (n, k) of a [N, K] weight in this layout.
inline int64_t element_index(int64_t n, int64_t k, int64_t K) {
  const int64_t panel = n / kPanelRows, half = (n % kPanelRows) / 16, col = n % 16;
  const int64_t kb = k / kTileK, pair = (k % kTileK) / 2;
  return panel * kPanelRows * K + (kb * 2 + half) * kTileElements + pair * 32 + col * 2 + (k & 1);
}

}  // namespace octavo::bf16_tiles
