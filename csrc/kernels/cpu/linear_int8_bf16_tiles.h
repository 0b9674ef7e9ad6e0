// linear for int8 weights (one scale per row) and bfloat16 activations on AMX bf16 tiles, from
// batched decode (an LM head) to prefill (MoE experts); included by linear.cc in the "amx" ISA
// level only.
//
// The vector kernel decodes each int8 weight to float32 for every group of 4 input rows, so its
// time grows with the rows: the 50304 x 2048 LM head of an OLMoE-sized model took 6 ms at 1 row
// and 38 ms at 32. Here each weight is converted to bfloat16 (exact: |q| <= 127) once per pass of
// up to 64 input rows, 16 rows x 32 inputs at a time, and is tdpbf16ps's first operand against
// those rows (up to four tiles of 16 columns, transposed once per pass into the operand's pair
// layout): products of two bfloat16 are exact in float32 and the tile adds them in float32, then
// each row's sum is multiplied by its scale. The tile's order of addition is the hardware's, so
// results may differ from the vector kernel's in the last bits: a row is batch invariant on each
// side of kFromRows.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "linear_amx.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace int8_bf16_tiles {

constexpr int kTileK = 32;      // bf16 per tile row
constexpr int kTileBytes = tiles::kTileBytes;
constexpr int kMaxColTiles = 4;  // input tiles of 16 columns per pass
constexpr int kCols = 16 * kMaxColTiles;  // input rows per pass
// From this many rows (the vector kernel's time at 4 rows, 3x less at 8, 5x less at 32: the LM
// head above, bench/RESULTS.md) at every batch size. A product re-reads its weights once per kCols
// rows, and still beats the kernels that decode every weight to float32 per few rows by 5-9x at
// 256-512 rows, and torch's GEMM on weights already dequantized (14336 x 4096 at 512 rows: 34-37
// ms against 40-42).
constexpr int64_t kFromRows = 4;

inline bool takes(const LinearParams& p) {
  return p.weight_format == WeightFormat::kInt8 && p.dtype == DType::kBFloat16 && p.rows >= kFromRows &&
         p.in_features % kTileK == 0;
}

// Input rows [m, m + mc) (mc <= kCols; missing rows zero) as K / 32 steps of kMaxColTiles
// second-operand tiles (those past mc's not written): tile (kb, h) row j holds input pair j (inputs
// 2j, 2j + 1 of the step) of rows m + 16h...
inline void transpose_inputs(const LinearParams& p, int64_t m, int mc, uint8_t* b) {
  const auto* x = static_cast<const bf16*>(p.input);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < p.in_features / kTileK; ++kb)
    for (int h = 0; 16 * h < mc; ++h) {
      __m512i rows[16], pairs[16];
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * h + i;
        rows[i] = r < mc ? _mm512_loadu_si512(x + (m + r) * p.in_stride + kb * kTileK) : zero;
      }
      transpose_16x16(rows, pairs);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(b + (kb * kMaxColTiles + h) * kTileBytes + j * 64, pairs[j]);
    }
}

// 32 int8 weights at q as bfloat16.
inline __m512i weights_as_bf16(const int8_t* q) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
  const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
  return reinterpret_cast<const __m512i&>(packed);
}

OCTAVO_WEIGHT_FIRST_STEP(Bf16Step, _tile_dpbf16ps)

// Weight rows [n, n + nr) (nr <= 16) against input rows [m, m + mc) (ColTiles tiles of 16): out[m
// + i][n + r]. Step kb + 1's weight tile is converted while step kb's multiplies (two buffers, as
// in linear_int8_tiles.h).
template <int ColTiles>
void weight_tile(const LinearParams& p, const uint8_t* b, int64_t m, int mc, int64_t n, int nr) {
  const int64_t K = p.in_features, steps = K / kTileK;
  const auto* w = static_cast<const int8_t*>(p.weight);
  int64_t rows[16];  // rows past nr repeat row n (their results are dropped)
  for (int r = 0; r < 16; ++r) rows[r] = n + (r < nr ? r : 0);
  alignas(64) uint8_t a[2][kTileBytes];
  const auto convert = [&](int64_t kb) {
    for (int r = 0; r < 16; ++r) {
      const int8_t* row = w + rows[r] * K + kb * kTileK;
      // The next 16 rows, a tile of rows ahead (once per 64-byte line).
      if (kb % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 16 * K), _MM_HINT_T0);
      _mm512_store_si512(a[kb & 1] + r * 64, weights_as_bf16(row));
    }
  };
  tiles::zero_columns<ColTiles>();
  convert(0);
  for (int64_t kb = 0; kb < steps; ++kb) {
    Bf16Step::step<ColTiles>(a[kb & 1], 64, b + kb * kMaxColTiles * kTileBytes);
    if (kb + 1 < steps) convert(kb + 1);
  }
  alignas(64) float sums[16 * kCols];  // [weight row][input row]
  tiles::store_columns<ColTiles>(sums, kCols * 4);
  const auto* bias = static_cast<const bf16*>(p.bias);
  for (int h = 0; h < ColTiles; ++h) {
    __m512i by_weight[16], by_input[16];
    for (int r = 0; r < 16; ++r)
      by_weight[r] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(sums + r * kCols + 16 * h), _mm512_set1_ps(p.scales[rows[r]])));
    transpose_16x16(by_weight, by_input);
    for (int i = 0; i < 16 && 16 * h + i < mc; ++i) {
      VecF y{_mm512_castsi512_ps(by_input[i])};
      if (bias != nullptr) y = y + (nr == 16 ? VecF::load(bias + n) : load_partial(bias + n, nr));
      bf16* out = static_cast<bf16*>(p.out) + (m + 16 * h + i) * p.out_stride + n;
      if (nr == 16) y.store(out);
      else store_partial(y, out, nr);
    }
  }
}

inline void weight_tiles(const LinearParams& p, const uint8_t* b, int64_t m, int mc, int64_t n, int nr) {
  switch ((mc + 15) / 16) {
    case 1: return weight_tile<1>(p, b, m, mc, n, nr);
    case 2: return weight_tile<2>(p, b, m, mc, n, nr);
    case 3: return weight_tile<3>(p, b, m, mc, n, nr);
    default: return weight_tile<4>(p, b, m, mc, n, nr);
  }
}

// Threads split the weight's tiles of 16 rows, each streaming its own slab once per kCols rows.
inline void linear(const LinearParams& p) {
  const int64_t steps = p.in_features / kTileK, tiles = (p.out_features + 15) / 16, threads = get_num_threads();
  auto* b = static_cast<uint8_t*>(thread_scratch(3, static_cast<size_t>(steps * kMaxColTiles * kTileBytes)));
  const bool serial = p.out_features * p.in_features < (int64_t{1} << 18);  // waking the pool costs more
  for (int64_t m = 0; m < p.rows; m += kCols) {
    const int mc = static_cast<int>(p.rows - m < kCols ? p.rows - m : kCols);
    transpose_inputs(p, m, mc, b);
    parallel_for(tiles, serial ? tiles : (tiles + threads - 1) / threads, [&](int64_t begin, int64_t end) {
      static const tiles::TileConfig config;
      _tile_loadconfig(&config);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * 16;
        weight_tiles(p, b, m, mc, n, static_cast<int>(p.out_features - n < 16 ? p.out_features - n : 16));
      }
      _tile_release();
    });
  }
}

}  // namespace int8_bf16_tiles
}  // namespace octavo::cpu::OCTAVO_ISA
