// linear for weight format int4_a8 (W4A8) on AMX int8 tiles, for prefill and batched decode;
// included by linear.cc in the "amx" ISA level only, after linear_int8_inputs.h.
//
// The arithmetic is linear_int8_inputs.h's: each input row rounded to int8 with one scale d per
// weight group, exact integer sums per group, then out += s * d * sum in float32 group by group.
// Here the integer sums come from tdpbssd, which multiplies a 16 x 64 int8 input tile by a 64 x
// 16 int8 weight tile into 16 x 16 int32 sums (16384 products in one instruction, 16x what
// vpdpbusd does). The weight tile holds q - z (in [-15, 15]: signed, so the zero points need no
// separate term), unpacked from the nibbles once per panel of 32 weight rows and row chunk, in
// the VNNI layout tdpbssd reads: tile row r holds, for 16 output features, the 4 weights k = 4r..4r
// + 3. A group's sums leave the tiles at its end and are scaled into float32 accumulators, so a
// group must be a whole number of 64-input tiles (takes()). Tiles 0-3 hold a 32 x 32 block of
// sums, 4-5 two input tiles and 6-7 two weight tiles.
//
// The per-group float32 terms are the vector kernel's, but that kernel sums a group's blocks in
// separate lanes before adding them, so the two kernels' results may differ in the last bits: a
// row is batch invariant on each side of kTilesFromRows, as linear's other tile paths are.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "linear_amx.h"
#include "linear_int8_inputs.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace int8_tiles {

constexpr int kTileK = 64;                  // int8 per tile row
constexpr int kPanel = 32;                  // weight rows per packed panel (two weight tiles)
constexpr int kBlockRows = 32;              // input rows per block (two input tiles)
constexpr int kTileBytes = tiles::kTileBytes;
constexpr int64_t kChunkBytes = 1 << 20;    // int8 input rows per chunk: kept in L2 across panels
// From this many input rows on, linear takes the tiles (bench/RESULTS.md, "W4A8 on AMX tiles").
constexpr int64_t kTilesFromRows = 8;

inline bool takes(const LinearParams& p) {
  return p.weight_format == WeightFormat::kInt4A8 && p.group_size % kTileK == 0 && p.rows >= kTilesFromRows;
}

// The input rows rounded to int8, as input tiles: block b (32 rows) and step kb (64 inputs) are
// two 16 x 64 tiles at a + (b * steps + kb) * 2 * kTileBytes, rows past M zeros; d [M, groups].
struct TiledInputs {
  int8_t* a;
  float* d;
  int64_t steps;  // K / 64
};

template <typename T>
void round_row(const LinearParams& p, int64_t i, const TiledInputs& r) {
  const int64_t G = p.group_size, groups = p.in_features / G;
  const T* x = static_cast<const T*>(p.input) + i * p.in_stride;
  int8_t* row = r.a + i / kBlockRows * r.steps * 2 * kTileBytes + i % kBlockRows * kTileK;
  for (int64_t g = 0; g < groups; ++g) {
    double inv = 0.0;
    const bool finite = int8_inputs::group_scale(x + g * G, G, r.d[i * groups + g], inv);
    for (int64_t k = g * G; k < (g + 1) * G; k += kTileK) {
      int8_t* a = row + k / kTileK * 2 * kTileBytes;
      if (finite) int8_inputs::round_values(x + k, kTileK, inv, a);
      else std::memset(a, 0, kTileK);
    }
  }
}

template <typename T>
TiledInputs round_inputs(const LinearParams& p) {
  const int64_t blocks = (p.rows + kBlockRows - 1) / kBlockRows, steps = p.in_features / kTileK;
  const int64_t bytes = blocks * steps * 2 * kTileBytes;
  // Slot 3 of the calling thread: the workers use slots 0-1 below, the calling thread among them.
  auto* a = static_cast<int8_t*>(thread_scratch(3, static_cast<size_t>(bytes + p.rows * (p.in_features / p.group_size) * 4)));
  const TiledInputs r{a, reinterpret_cast<float*>(a + bytes), steps};
  // Rows past M in the last block stay zero (their sums are computed and dropped).
  for (int64_t i = p.rows; i < blocks * kBlockRows; ++i)
    for (int64_t kb = 0; kb < steps; ++kb)
      std::memset(a + (i / kBlockRows * steps + kb) * 2 * kTileBytes + i % kBlockRows * kTileK, 0, kTileK);
  parallel_for(p.rows, int8_inputs::rounding_grain(p), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) round_row<T>(p, i, r);
  });
  return r;
}

// Weight rows [n, n + nr) (nr <= kPanel; missing rows zero) as K / 64 pairs of weight tiles of q - z
// (tile (kb, h): rows n + 16h.., inputs [64 kb, 64 kb + 64)), then their scales by group [groups,
// 32] (0 for missing rows).
inline void pack_panel(const LinearParams& p, int64_t n, int nr, uint8_t* panel, float* scales) {
  const int64_t K = p.in_features, G = p.group_size, groups = K / G, row_bytes = K / 2;
  const auto* q = static_cast<const uint8_t*>(p.weight) + n * row_bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < K / kTileK; ++kb) {
    const int64_t g = kb * kTileK / G;
    for (int h = 0; h < 2; ++h) {
      __m512i rows[16], cols[16];
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * h + i;
        if (r >= nr) {
          rows[i] = zero;
          continue;
        }
        // Two blocks of 32: their low nibbles are inputs 0-15, the high ones 16-31.
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * row_bytes + kb * 32));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
        const __m512i nibbles = _mm512_and_si512(both, low4);  // lo0 lo1 hi0 hi1 (16 bytes each)
        const __m512i ordered = _mm512_shuffle_i64x2(nibbles, nibbles, _MM_SHUFFLE(3, 1, 2, 0));
        rows[i] = _mm512_sub_epi8(ordered, _mm512_set1_epi8(static_cast<char>(p.zeros[(n + r) * groups + g])));
      }
      transpose_16x16(rows, cols);  // dword j of every row: the VNNI layout
      uint8_t* tile = panel + (kb * 2 + h) * kTileBytes;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * 64, cols[i]);
    }
  }
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int r = 0; r < kPanel; ++r) scales[gi * kPanel + r] = r < nr ? p.scales[(n + r) * groups + gi] : 0.0f;
}

// acc[r][0, 32) += s * d[r] * sums[r] for one group, over rows [0, mr) of a 32 x 32 block; the
// first group adds to zeros instead (the same sums as clearing acc first, without the stores).
inline void scale_group(const int32_t* sums, const float* s, const float* d, int64_t d_stride, int mr, bool first,
                        float* acc) {
  const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
  for (int r = 0; r < mr; ++r) {
    const __m512 dr = _mm512_set1_ps(d[r * d_stride]);
    float* a = acc + r * kPanel;
    const __m512 a0 = first ? _mm512_setzero_ps() : _mm512_load_ps(a);
    const __m512 a1 = first ? _mm512_setzero_ps() : _mm512_load_ps(a + 16);
    _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kPanel)), _mm512_mul_ps(s0, dr), a0));
    _mm512_store_ps(a + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kPanel + 16)),
                                            _mm512_mul_ps(s1, dr), a1));
  }
}

// The float32 block acc (rows [m, m + mr), features [n, n + nr)) plus bias into out.
template <typename T>
void store_block(const LinearParams& p, const float* acc, int64_t m, int mr, int64_t n, int nr) {
  const T* bias = static_cast<const T*>(p.bias);
  for (int r = 0; r < mr; ++r) {
    T* out = static_cast<T*>(p.out) + (m + r) * p.out_stride + n;
    for (int c = 0; c < nr; c += kW) {
      const int w = nr - c < kW ? nr - c : kW;
      VecF y = VecF::load(acc + r * kPanel + c);
      if (bias != nullptr) y = y + (w == kW ? VecF::load(bias + n + c) : load_partial(bias + n + c, w));
      if (w == kW) y.store(out + c);
      else store_partial(y, out + c, w);
    }
  }
}

// One 32-row block (input tiles a) against a packed panel: the sums group by group into acc (its
// rows [0, mr) written).
template <int InputTiles>
void block_product(const LinearParams& p, const uint8_t* a, const uint8_t* panel, const float* scales,
                   const float* d, int mr, float* acc) {
  const int64_t groups = p.in_features / p.group_size, steps_per_group = p.group_size / kTileK;
  alignas(64) int32_t sums[kBlockRows * kPanel];
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (InputTiles == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = g * steps_per_group; kb < (g + 1) * steps_per_group; ++kb) {
      _tile_loadd(4, a + kb * 2 * kTileBytes, 64);
      if constexpr (InputTiles == 2) _tile_loadd(5, a + (kb * 2 + 1) * kTileBytes, 64);
      _tile_loadd(6, panel + kb * 2 * kTileBytes, 64);
      _tile_loadd(7, panel + (kb * 2 + 1) * kTileBytes, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if constexpr (InputTiles == 2) {
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, sums, kPanel * 4);
    _tile_stored(1, sums + 16, kPanel * 4);
    if constexpr (InputTiles == 2) {
      _tile_stored(2, sums + 16 * kPanel, kPanel * 4);
      _tile_stored(3, sums + 16 * kPanel + 16, kPanel * 4);
    }
    scale_group(sums, scales + g * kPanel, d + g, groups, mr, g == 0, acc);
  }
}

// Rows [m_begin, m_end) (a whole chunk of blocks but the last) against panels [first, last).
template <typename T>
void run_part(const LinearParams& p, const TiledInputs& r, int64_t m_begin, int64_t m_end, int64_t first,
              int64_t last) {
  const int64_t groups = p.in_features / p.group_size, block_bytes = r.steps * 2 * kTileBytes;
  auto* panel = static_cast<uint8_t*>(thread_scratch(0, static_cast<size_t>(block_bytes)));
  auto* scales = static_cast<float*>(thread_scratch(1, static_cast<size_t>(groups * kPanel * 4)));
  static const tiles::TileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float acc[kBlockRows * kPanel];
  for (int64_t pi = first; pi < last; ++pi) {
    const int64_t n = pi * kPanel;
    const int nr = static_cast<int>(p.out_features - n < kPanel ? p.out_features - n : kPanel);
    pack_panel(p, n, nr, panel, scales);
    for (int64_t m = m_begin; m < m_end; m += kBlockRows) {
      const int mr = static_cast<int>(m_end - m < kBlockRows ? m_end - m : kBlockRows);
      const uint8_t* a = reinterpret_cast<const uint8_t*>(r.a) + m / kBlockRows * block_bytes;
      if (mr <= 16) block_product<1>(p, a, panel, scales, r.d + m * groups, mr, acc);
      else block_product<2>(p, a, panel, scales, r.d + m * groups, mr, acc);
      store_block<T>(p, acc, m, mr, n, nr);
    }
  }
  _tile_release();
}

// Work items are (row chunk, panel) pairs, panels fastest, as in linear_amx.h.
template <typename T>
void linear(const LinearParams& p) {
  const TiledInputs r = round_inputs<T>(p);
  const int64_t panels = (p.out_features + kPanel - 1) / kPanel;
  const int64_t chunk = std::max<int64_t>(kBlockRows, kChunkBytes / p.in_features / kBlockRows * kBlockRows);
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
  const int threads = get_num_threads();
  const int64_t grain = (panels * chunks + threads - 1) / threads;
  parallel_for(panels * chunks, grain, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t ci = begin / panels, first = begin % panels;
      const int64_t last = first + (end - begin) < panels ? first + (end - begin) : panels;
      run_part<T>(p, r, ci * chunk, (ci + 1) * chunk < p.rows ? (ci + 1) * chunk : p.rows, first, last);
      begin += last - first;
    }
  });
}

}  // namespace int8_tiles
}  // namespace octavo::cpu::OCTAVO_ISA
