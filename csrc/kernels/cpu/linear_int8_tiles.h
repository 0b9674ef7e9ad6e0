// linear for weight formats int4_a8 (W4A8) and int8_a8 (W8A8) on AMX int8 tiles, for batched
// decode and prefill; included by linear.cc in the "amx" ISA level only, after
// linear_int8_inputs.h and linear_int8_a8.h.
//
// The arithmetic is linear_int8_inputs.h's: each input row rounded to int8 with one scale d per
// weight group, exact integer sums per group, then out += s * d * sum in float32 group by group.
// Here the integer sums come from tdpbssd, which multiplies a 16 x 64 int8 tile by a 64 x 16 int8
// tile (the second in "VNNI" layout: tile row r holds, for each of 16 columns, 4 consecutive k)
// into 16 x 16 int32 sums: 16384 products in one instruction, 16x what vpdpbusd does. Weights
// enter as q - z (in [-15, 15]: signed, so the zero points need no separate term), unpacked from
// the nibbles. A group's sums leave the tiles at its end and are scaled into float32 accumulators,
// so a group must be a whole number of 64-input tiles (takes()). W8A8 weights enter as stored, and
// its inputs have one group, the whole row (linear() sets group_size to K): one epilogue, the
// same vfmadd as linear_int8_a8.h's, so its rows get that kernel's bits on either layout.
//
// Two layouts, by row count (measured in bench/RESULTS.md):
// - Up to kFewRows (64) input rows (decode batches, a prefill's small MoE experts), the weights are
//   the first operand, in their own row order: unpacking them is the main cost, and it is paid once
//   per call. (14336 x 4096 at 32 and 64 rows: the panels took 1.6-1.8x and 1.4-1.6x its time.)
// - More rows (prefill): panels of 32 weight rows are unpacked and transposed into the second
//   operand, and 32 x 32 blocks of sums use all 8 tiles. Where the rounded inputs fit in the
//   last-level cache, groups of panels that fit in L2 meet every input row (the weight is read
//   once; W8A8 rows longer than 4096 inputs in slices of 4096, with or without that cache); else
//   each panel is packed once per chunk of rows that fits in L2, or, for rows too long for such
//   chunks, the first layout runs in passes of kFewRows rows.
// All add the same float32 terms in the same order, so a row gets the same bits from any. The
// W4A8 vector kernel sums a group's blocks in separate lanes before adding them, so its results
// may differ in the last bits: a row is batch invariant on each side of kTilesFromRows, as
// linear's other tile paths are. (W8A8's are the same bits on both sides.)
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

inline bool int8_weights(const LinearParams& p) { return p.weight_format == WeightFormat::kInt8A8; }

// From this many input rows on, linear takes the tiles: up to kFewRows (below) with the weights as
// the first operand, then on packed panels (bench/RESULTS.md, MoE section, "Fourth session").
// W8A8 weights of kInt8TilesFromBytes or more from 2 rows: their weight tiles are read from the
// weight as stored, with nothing to unpack, so 2-3 rows beat the vector kernel's int16
// multiply-adds (14336 x 4096 and 4096 x 14336 from DRAM: 2.3-2.4 ms against 2.6-4.0); on a
// 2048 x 2048 weight they did not (0.26-0.31 ms against 0.24-0.28), nor did one row (OLMoE-shaped
// experts at one token: 2.4 ms per layer against 2.0). W4A8's unpacking leaves 2-3 rows a draw.
constexpr int64_t kTilesFromRows = 4;
constexpr int64_t kInt8TilesFromRows = 2;
constexpr int64_t kInt8TilesFromBytes = int64_t{1} << 24;

inline int64_t tiles_from_rows(const LinearParams& p) {
  const bool large = p.out_features * p.in_features >= kInt8TilesFromBytes;
  return int8_weights(p) && large ? kInt8TilesFromRows : kTilesFromRows;
}

inline bool takes(const LinearParams& p) {
  const bool groups_fit = p.weight_format == WeightFormat::kInt4A8   ? p.group_size % kTileK == 0
                          : p.weight_format == WeightFormat::kInt8A8 ? p.in_features % kTileK == 0
                                                                     : false;
  return groups_fit && p.rows >= tiles_from_rows(p);
}
inline int64_t weight_row_bytes(const LinearParams& p) { return int8_weights(p) ? p.in_features : p.in_features / 2; }

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

// The 64 weights of two nibble blocks at q less their zero point z (q - z in [-15, 15] as signed
// bytes), in "block order": the low nibbles of both blocks, then the high ones, which is inputs
// 0-15, 32-47, 16-31, 48-63 of the two blocks.
inline __m512i weights_minus_zero_block_order(const uint8_t* q, uint8_t z) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
  return _mm512_sub_epi8(_mm512_and_si512(both, _mm512_set1_epi8(0x0F)), _mm512_set1_epi8(static_cast<char>(z)));
}

// Swaps the middle two 16-byte quarters: input order to block order and back.
inline __m512i swap_middle_quarters(__m512i v) { return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)); }

// A weight's rows as the tiles take them, read once per call from p.
struct WeightSteps {
  const uint8_t* q;
  const uint8_t* zeros;
  int64_t row_bytes, groups;
  bool int8;
  explicit WeightSteps(const LinearParams& p)
      : q(static_cast<const uint8_t*>(p.weight)), zeros(p.zeros), row_bytes(weight_row_bytes(p)),
        groups(p.in_features / p.group_size), int8(int8_weights(p)) {}
  // Row `row`'s inputs [64 kb, 64 kb + 64), of group g, as signed bytes: W8A8's as stored, W4A8's
  // q - z in block order, or in input order where InputOrder.
  template <bool InputOrder>
  __m512i step(int64_t row, int64_t kb, int64_t g) const {
    const uint8_t* r = q + row * row_bytes;
    if (int8) return _mm512_loadu_si512(r + kb * kTileK);
    const __m512i v = weights_minus_zero_block_order(r + kb * 32, zeros[row * groups + g]);
    return InputOrder ? swap_middle_quarters(v) : v;
  }
};

// Weight rows [n, n + nr) (nr <= kPanel; missing rows zero), steps [kb_begin, kb_end), as pairs
// of weight tiles (W4A8: of q - z; tile (kb - kb_begin, h): rows n + 16h.., inputs [64 kb, 64 kb +
// 64)).
inline void pack_panel_steps(const LinearParams& p, int64_t n, int nr, int64_t kb_begin, int64_t kb_end,
                             uint8_t* panel) {
  const int64_t G = p.group_size;
  const WeightSteps w(p);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const int64_t g = kb * kTileK / G;
    for (int h = 0; h < 2; ++h) {
      __m512i rows[16], cols[16];
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * h + i;
        if (r >= nr) {
          rows[i] = zero;
          continue;
        }
        rows[i] = w.step<true>(n + r, kb, g);
      }
      transpose_16x16(rows, cols);  // dword j of every row: the VNNI layout
      uint8_t* tile = panel + ((kb - kb_begin) * 2 + h) * kTileBytes;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * 64, cols[i]);
    }
  }
}

// The scales of weight rows [n, n + nr) by group, [groups, 32] (0 for missing rows).
inline void panel_scales(const LinearParams& p, int64_t n, int nr, float* scales) {
  const int64_t groups = p.in_features / p.group_size;
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int r = 0; r < kPanel; ++r) scales[gi * kPanel + r] = r < nr ? p.scales[(n + r) * groups + gi] : 0.0f;
}

// The panel of weight rows [n, n + nr) over all K / 64 steps, then their scales.
inline void pack_panel(const LinearParams& p, int64_t n, int nr, uint8_t* panel, float* scales) {
  pack_panel_steps(p, n, nr, 0, p.in_features / kTileK, panel);
  panel_scales(p, n, nr, scales);
}

// Weight rows in panel pi: kPanel, fewer in the last.
inline int panel_rows(const LinearParams& p, int64_t pi) {
  return static_cast<int>(p.out_features - pi * kPanel < kPanel ? p.out_features - pi * kPanel : kPanel);
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

// The float32 block acc (rows [m, m + mr), features [n, n + nr), row stride acc_stride) plus bias
// into out.
template <typename T>
void store_block(const LinearParams& p, const float* acc, int64_t acc_stride, int64_t m, int mr, int64_t n, int nr) {
  const T* bias = static_cast<const T*>(p.bias);
  for (int r = 0; r < mr; ++r) {
    T* out = static_cast<T*>(p.out) + (m + r) * p.out_stride + n;
    for (int c = 0; c < nr; c += kW) {
      const int w = nr - c < kW ? nr - c : kW;
      VecF y = VecF::load(acc + r * acc_stride + c);
      if (bias != nullptr) y = y + (w == kW ? VecF::load(bias + n + c) : load_partial(bias + n + c, w));
      if (w == kW) y.store(out + c);
      else store_partial(y, out + c, w);
    }
  }
}

OCTAVO_TILE_PRODUCT(Int8Product, _tile_dpbssd)

// One 32-row block (input tiles a) against a packed panel: the sums group by group into acc (its
// rows [0, mr) written).
template <int InputTiles>
void block_product(const LinearParams& p, const uint8_t* a, const uint8_t* panel, const float* scales,
                   const float* d, int mr, float* acc) {
  const int64_t groups = p.in_features / p.group_size, steps_per_group = p.group_size / kTileK;
  alignas(64) int32_t sums[2][kBlockRows * kPanel];
  const auto scale = [&](int64_t g) { scale_group(sums[g & 1], scales + g * kPanel, d + g, groups, mr, g == 0, acc); };
  for (int64_t g = 0; g < groups; ++g) {
    tiles::zero_block<InputTiles>();
    tiles::block_steps<Int8Product, InputTiles>(a, panel, g * steps_per_group, (g + 1) * steps_per_group);
    if (g > 0) scale(g - 1);  // on the vector units while the tiles multiply group g
    tiles::store_sums<InputTiles>(sums[g & 1]);
  }
  scale(groups - 1);
}

// Rows [m_begin, m_end) (whole blocks but the last) against panels [first, last), `together`
// panels packed at a time: each block of input rows meets all of them before the next block.
template <typename T>
void run_part(const LinearParams& p, const TiledInputs& r, int64_t m_begin, int64_t m_end, int64_t first,
              int64_t last, int64_t together) {
  // A panel holds as many bytes as a block of inputs: K / 64 pairs of tiles.
  const int64_t groups = p.in_features / p.group_size, block_bytes = r.steps * 2 * kTileBytes;
  auto* packed = static_cast<uint8_t*>(thread_scratch(0, static_cast<size_t>(together * block_bytes)));
  auto* scales = static_cast<float*>(thread_scratch(1, static_cast<size_t>(together * groups * kPanel * 4)));
  static const tiles::TileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float acc[kBlockRows * kPanel];
  for (int64_t begin = first; begin < last; begin += together) {
    const int64_t end = std::min(last, begin + together);
    for (int64_t pi = begin; pi < end; ++pi)
      pack_panel(p, pi * kPanel, panel_rows(p, pi), packed + (pi - begin) * block_bytes,
                 scales + (pi - begin) * groups * kPanel);
    for (int64_t m = m_begin; m < m_end; m += kBlockRows) {
      const int mr = static_cast<int>(m_end - m < kBlockRows ? m_end - m : kBlockRows);
      const uint8_t* a = reinterpret_cast<const uint8_t*>(r.a) + m / kBlockRows * block_bytes;
      for (int64_t pi = begin; pi < end; ++pi) {
        const uint8_t* panel = packed + (pi - begin) * block_bytes;
        const float* s = scales + (pi - begin) * groups * kPanel;
        if (mr <= 16) block_product<1>(p, a, panel, s, r.d + m * groups, mr, acc);
        else block_product<2>(p, a, panel, s, r.d + m * groups, mr, acc);
        store_block<T>(p, acc, kPanel, m, mr, pi * kPanel, panel_rows(p, pi));
      }
    }
  }
  _tile_release();
}

// Input rows per chunk: as many as keep kChunkBytes of rounded inputs in L2 across the panels.
inline int64_t chunk_rows(const LinearParams& p) {
  return std::max<int64_t>(kBlockRows, kChunkBytes / p.in_features / kBlockRows * kBlockRows);
}

template <typename T>
void linear_panels(const LinearParams& p) {
  const TiledInputs r = round_inputs<T>(p);
  const int64_t chunk = chunk_rows(p);
  tiles::over_chunks_and_panels(p.rows, chunk, (p.out_features + kPanel - 1) / kPanel,
                                [&](int64_t m_begin, int64_t m_end, int64_t first, int64_t last) {
                                  run_part<T>(p, r, m_begin, m_end, first, last, 1);
                                });
}

// Chunks of rows read the whole weight from memory once per chunk: Mixtral's 14336 x 4096 at 512
// rows twice, its 4096 x 14336 (passes of 64 rows) eight times, a large part of a MoE layer's time
// where the experts' weights are far larger than any cache. Where the rounded inputs are small
// enough to stay in the last-level cache, each thread instead packs groups of panels that stay in
// L2 (kGroupBytes) and streams all the input rows past each group: the weight is read once, and
// the inputs once per group from that cache.
constexpr int64_t kGroupBytes = 1 << 20;
constexpr int64_t kGroupsUpToInputBytes = 8 << 20;

// ---- W8A8's long rows in slices ------------------------------------------------------------------
// A group holds 1 MB of panels: at K = 14336 (Mixtral's down projection) two panels, so every
// 32-row block of inputs (458 KB) streams past L2 for each 64 outputs, and the tile loop runs at
// 0.96 T multiply-adds/s per core there against 1.55 at K = 4096 (bench_amx_ceiling). W8A8's sums
// are exact int32 over the whole row, so the row can be cut into slices of kSliceInputs: a group
// packs 8 panels of one slice, every block of rows meets them, and each block's int32 sums wait in
// memory for the next slice. Exact sums in any order: the same bits as the panels above.
constexpr int64_t kSliceInputs = 4096;

// Where the rounded inputs pass kGroupsUpToInputBytes, the slices still win: each group of 256
// outputs reads all the inputs (from memory, if not from cache), but passes of kFewRows rows would
// read the whole weight once per pass, 4x the bytes (4096 x 14336 at 1024 and 2048 rows: 32 and
// 60-63 ms against 40-45 and 87-88). Up to kSlicesUpToRows: each thread keeps 1 KB of sums per row.
constexpr int64_t kSlicesUpToRows = 4096;

inline bool by_slices(const LinearParams& p) { return int8_weights(p) && p.in_features > kSliceInputs; }
inline bool sliced_rows(const LinearParams& p) { return by_slices(p) && p.rows <= kSlicesUpToRows; }

inline bool by_panel_groups(const LinearParams& p) {
  return p.rows > chunk_rows(p) && (p.rows * p.in_features <= kGroupsUpToInputBytes || sliced_rows(p));
}

template <typename T>
void linear_panel_groups(const LinearParams& p) {
  const TiledInputs r = round_inputs<T>(p);
  const int64_t panels = (p.out_features + kPanel - 1) / kPanel;
  const int64_t together = std::max<int64_t>(1, kGroupBytes / (p.in_features * kPanel));
  const int64_t groups = (panels + together - 1) / together, threads = get_num_threads();
  parallel_for(groups, (groups + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    run_part<T>(p, r, 0, p.rows, begin * together, std::min(panels, end * together), together);
  });
}

// The sums of one block (tiles a, from its slice's first step) with one panel's slice, `steps`
// steps, added to the sums in `carried` (cleared first where `first`) and written back there.
template <int InputTiles>
void slice_product(const uint8_t* a, const uint8_t* panel, int64_t steps, bool first, int32_t* carried) {
  if (first) tiles::zero_block<InputTiles>();
  else tiles::load_sums<InputTiles>(carried);
  tiles::block_steps<Int8Product, InputTiles>(a, panel, 0, steps);
  tiles::store_sums<InputTiles>(carried);
}

// All the rows against panels [first, last), slice by slice; after the last slice each block's
// sums take scale_group's epilogue, as block_product's single group does.
template <typename T>
void run_sliced_part(const LinearParams& p, const TiledInputs& r, int64_t first, int64_t last) {
  const int64_t slice_steps = kSliceInputs / kTileK, slice_bytes = slice_steps * 2 * kTileBytes;
  const int64_t together = last - first, blocks = (p.rows + kBlockRows - 1) / kBlockRows;
  const int64_t block_bytes = r.steps * 2 * kTileBytes, block_sums = kBlockRows * kPanel;
  auto* packed = static_cast<uint8_t*>(thread_scratch(0, static_cast<size_t>(together * slice_bytes)));
  auto* scales = static_cast<float*>(thread_scratch(1, static_cast<size_t>(together * kPanel * 4)));
  auto* carried = static_cast<int32_t*>(thread_scratch(2, static_cast<size_t>(blocks * together * block_sums * 4)));
  for (int64_t pi = first; pi < last; ++pi)
    panel_scales(p, pi * kPanel, panel_rows(p, pi), scales + (pi - first) * kPanel);  // W8A8: one group
  static const tiles::TileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float acc[kBlockRows * kPanel];
  for (int64_t s0 = 0; s0 < r.steps; s0 += slice_steps) {
    const int64_t s1 = std::min(r.steps, s0 + slice_steps);
    for (int64_t pi = first; pi < last; ++pi)
      pack_panel_steps(p, pi * kPanel, panel_rows(p, pi), s0, s1, packed + (pi - first) * slice_bytes);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m = b * kBlockRows;
      const int mr = static_cast<int>(p.rows - m < kBlockRows ? p.rows - m : kBlockRows);
      const uint8_t* a = reinterpret_cast<const uint8_t*>(r.a) + b * block_bytes + s0 * 2 * kTileBytes;
      for (int64_t pi = first; pi < last; ++pi) {
        int32_t* sums = carried + (b * together + pi - first) * block_sums;
        const uint8_t* panel = packed + (pi - first) * slice_bytes;
        if (mr <= 16) slice_product<1>(a, panel, s1 - s0, s0 == 0, sums);
        else slice_product<2>(a, panel, s1 - s0, s0 == 0, sums);
        if (s1 < r.steps) continue;
        scale_group(sums, scales + (pi - first) * kPanel, r.d + m, 1, mr, true, acc);
        store_block<T>(p, acc, kPanel, m, mr, pi * kPanel, panel_rows(p, pi));
      }
    }
  }
  _tile_release();
}

template <typename T>
void linear_slices(const LinearParams& p) {
  const TiledInputs r = round_inputs<T>(p);
  const int64_t panels = (p.out_features + kPanel - 1) / kPanel, threads = get_num_threads();
  // 8 panels of a slice fill kGroupBytes; fewer where that would leave a thread without a group.
  const int64_t most = kGroupBytes / (kSliceInputs * kPanel);
  const int64_t together = std::clamp<int64_t>((panels + threads - 1) / threads, 1, most);
  const int64_t groups = (panels + together - 1) / together;
  parallel_for(groups, (groups + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      run_sliced_part<T>(p, r, g * together, std::min(panels, (g + 1) * together));
  });
}

// ---- A few input rows (decode batches, small experts) ------------------------------------------
// With a few rows, packing whole panels costs more than the products it feeds: each weight tile is
// unpacked, transposed and then used for a few rows only. Here the weights are tdpbssd's first
// operand, 16 rows x 64 inputs in their own order (unpacked, nothing transposed), and the inputs
// its second, up to 4 tiles of 16 rows transposed once per call: the sums are 16 weight rows x 16
// input rows per tile. Each group's sums are scaled as scale_group does, in the same order, so a
// row gets the same bits here as on the panels above.
constexpr int kFewRows = 64;  // the most input rows: 4 tiles of 16
// Panels pack each weight once per chunk of rows; where an input row is so long that a chunk holds
// fewer rows than this, the weights-first layout in passes of kFewRows rows is faster (4096 x
// 14336 at 512 rows: 23-24 ms with the rows rounded on all threads, against 33-37 on chunks of 64
// rows).
constexpr int64_t kPanelsFromChunkRows = 128;

// The input rows as K / 64 steps of `tiles` tiles in tdpbssd's second-operand layout (tile row j:
// for each of the tile's 16 input rows, its inputs 4j..4j + 3 of the step; rows past M zeros), and
// d as [groups, 16 * tiles].
struct FewInputs {
  const uint8_t* b;
  const float* d;
  int tiles;
};

template <typename T>
FewInputs transpose_inputs(const LinearParams& p) {
  const int64_t K = p.in_features, G = p.group_size, groups = K / G, steps = K / kTileK;
  const int tiles = static_cast<int>((p.rows + 15) / 16), cols = 16 * tiles;
  const int64_t b_bytes = steps * tiles * kTileBytes, d_bytes = groups * cols * 4;
  // Slot 3 of the calling thread, as round_inputs above.
  auto* b = static_cast<uint8_t*>(thread_scratch(3, static_cast<size_t>(b_bytes + d_bytes + cols * K)));
  auto* d = reinterpret_cast<float*>(b + b_bytes);
  auto* rows = reinterpret_cast<int8_t*>(b + b_bytes + d_bytes);  // [cols, K], row-major
  std::fill(d, d + groups * cols, 0.0f);
  std::memset(rows + p.rows * K, 0, static_cast<size_t>((cols - p.rows) * K));
  parallel_for(p.rows, int8_inputs::rounding_grain(p), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* x = static_cast<const T*>(p.input) + i * p.in_stride;
      for (int64_t g = 0; g < groups; ++g)
        int8_inputs::round_into(x + g * G, G, d[g * cols + i], rows + i * K + g * G);
    }
  });
  for (int64_t kb = 0; kb < steps; ++kb)
    for (int t = 0; t < tiles; ++t) {
      __m512i in[16], out[16];
      // In W4A8 weights' block order (few_rows_tile), so that they need no shuffle.
      for (int i = 0; i < 16; ++i) {
        in[i] = _mm512_loadu_si512(rows + (16 * t + i) * K + kb * kTileK);
        if (!int8_weights(p)) in[i] = swap_middle_quarters(in[i]);
      }
      transpose_16x16(in, out);  // dword j of every row: 4 inputs of each row per tile row
      uint8_t* tile = b + (kb * tiles + t) * kTileBytes;
      for (int j = 0; j < 16; ++j) _mm512_store_si512(tile + j * 64, out[j]);
    }
  return {b, d, tiles};
}

OCTAVO_WEIGHT_FIRST_STEP(Int8Step, _tile_dpbssd)

// Weight rows [n, n + nr) (nr <= 16) against InputTiles tiles of the inputs from tile t0:
// out[i][n + r] for i in [16 t0, 16 (t0 + InputTiles)) and < M. W4A8: step kb + 1's weight tile is
// unpacked while step kb's multiplies (two buffers): a tile load waits for the stores to its
// buffer to reach the cache, and that wait then overlaps other work. W8A8: a whole tile of 16 rows
// is read from the weight itself (from memory in the first pass, t0 = 0; from L2 in the next).
template <typename T, int InputTiles>
void few_rows_tile(const LinearParams& p, const FewInputs& in, int64_t n, int nr, int t0) {
  const int64_t K = p.in_features, G = p.group_size, groups = K / G, steps = K / kTileK;
  const int64_t steps_per_group = G / kTileK, row_bytes = weight_row_bytes(p), in_cols = 16 * in.tiles;
  constexpr int cols = 16 * InputTiles;
  const auto* q = static_cast<const uint8_t*>(p.weight);
  int64_t rows[16];  // rows past nr repeat row n (their results are dropped)
  for (int r = 0; r < 16; ++r) rows[r] = n + (r < nr ? r : 0);
  // The next 16 rows' bytes of step kb are asked for, a tile of rows ahead as the vector kernel
  // prefetches (once per line: W4A8 steps take half a line). The prefetches stay beside the loads
  // they run ahead of: from a lambda of their own, GCC 12 left every one out of the binary (W4A8 at
  // OLMoE's 32 tokens: 14.0 -> 16.5 ms).
  const int64_t step_bytes = row_bytes / steps;
  const bool direct = int8_weights(p) && nr == 16;
  alignas(64) uint8_t a[2][kTileBytes];
  const WeightSteps w(p);
  const auto unpack = [&](int64_t kb) {
    const int64_t g = kb / steps_per_group;
    for (int r = 0; r < 16; ++r) {
      const uint8_t* row = q + rows[r] * row_bytes + kb * step_bytes;
      if (step_bytes == 64 || kb % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + 16 * row_bytes), _MM_HINT_T0);
      _mm512_store_si512(a[kb & 1] + r * 64, w.step<false>(rows[r], kb, g));
    }
  };
  alignas(64) int32_t sums[16 * cols];  // [weight row][input row]
  __m512 acc[InputTiles][16];  // [t][r]: weight row r's outputs for input rows 16t..16t + 15
  for (int t = 0; t < InputTiles; ++t)
    for (int r = 0; r < 16; ++r) acc[t][r] = _mm512_setzero_ps();
  if (!direct) unpack(0);
  tiles::zero_columns<InputTiles>();
  for (int64_t kb = 0; kb < steps; ++kb) {
    const uint8_t* b = in.b + (kb * in.tiles + t0) * kTileBytes;
    if (direct) {
      const uint8_t* next = q + (n + 16) * row_bytes + kb * kTileK;
      if (t0 == 0)
        for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * row_bytes), _MM_HINT_T0);
      Int8Step::step<InputTiles>(q + n * row_bytes + kb * kTileK, row_bytes, b);
    } else {
      Int8Step::step<InputTiles>(a[kb & 1], 64, b);
      if (kb + 1 < steps) unpack(kb + 1);
    }
    if ((kb + 1) % steps_per_group != 0) continue;
    const int64_t g = kb / steps_per_group;  // the group ends: its sums scaled into acc
    tiles::store_columns<InputTiles>(sums, cols * 4);
    tiles::zero_columns<InputTiles>();
    for (int t = 0; t < InputTiles; ++t) {
      const __m512 d = _mm512_load_ps(in.d + g * in_cols + 16 * (t0 + t));
      for (int r = 0; r < 16; ++r) {
        const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(p.scales[rows[r] * groups + g]), d);
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * cols + 16 * t)), sd, acc[t][r]);
      }
    }
  }
  // acc[t][r] holds weight row r's outputs for 16 input rows: transposed, out's rows.
  for (int t = 0; t < InputTiles && 16 * (t0 + t) < p.rows; ++t) {
    __m512i by_weight[16], by_input[16];
    for (int r = 0; r < 16; ++r) by_weight[r] = _mm512_castps_si512(acc[t][r]);
    transpose_16x16(by_weight, by_input);
    alignas(64) float block[16 * 16];
    for (int i = 0; i < 16; ++i) _mm512_store_si512(block + i * 16, by_input[i]);
    const int64_t m = 16 * (t0 + t);
    store_block<T>(p, block, 16, m, static_cast<int>(p.rows - m < 16 ? p.rows - m : 16), n, nr);
  }
}

// All the input rows against weight rows [n, n + nr), in passes of up to 4 input tiles.
template <typename T>
void few_rows_tiles(const LinearParams& p, const FewInputs& in, int64_t n, int nr) {
  for (int t0 = 0; t0 < in.tiles; t0 += 4) {
    switch (std::min(4, in.tiles - t0)) {
      case 1: few_rows_tile<T, 1>(p, in, n, nr, t0); break;
      case 2: few_rows_tile<T, 2>(p, in, n, nr, t0); break;
      case 3: few_rows_tile<T, 3>(p, in, n, nr, t0); break;
      default: few_rows_tile<T, 4>(p, in, n, nr, t0); break;
    }
  }
}

// Threads split the weight's tiles of 16 rows, each streaming its own slab: tiles_from_rows <= M
// <= kFewRows rows, and W8A8 prefills whose int8 inputs fit in L2 (weights_first), whose weight
// tiles are then read from memory once, with no packing at all.
constexpr int64_t kWeightsFirstInputBytes = 1 << 20;

inline bool weights_first(const LinearParams& p) {
  return p.rows <= kFewRows || (int8_weights(p) && p.rows * p.in_features <= kWeightsFirstInputBytes);
}

template <typename T>
void linear_few_rows(const LinearParams& p) {
  const FewInputs in = transpose_inputs<T>(p);
  const int64_t tiles = (p.out_features + 15) / 16, threads = get_num_threads();
  const bool serial = p.out_features * weight_row_bytes(p) < (int64_t{1} << 18);  // waking the pool costs more
  parallel_for(tiles, serial ? tiles : (tiles + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    static const tiles::TileConfig config;
    _tile_loadconfig(&config);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * 16;
      few_rows_tiles<T>(p, in, n, static_cast<int>(p.out_features - n < 16 ? p.out_features - n : 16));
    }
    _tile_release();
  });
}

template <typename T>
void linear(const LinearParams& params) {
  LinearParams p = params;
  if (int8_weights(p)) p.group_size = p.in_features;  // W8A8: one group, the whole row
  if (weights_first(p)) return linear_few_rows<T>(p);
  if (by_panel_groups(p)) return sliced_rows(p) ? linear_slices<T>(p) : linear_panel_groups<T>(p);
  if (chunk_rows(p) >= kPanelsFromChunkRows) return linear_panels<T>(p);
  for (int64_t m = 0; m < p.rows; m += kFewRows) {  // long rows: passes of kFewRows rows
    LinearParams pass = p;
    pass.input = static_cast<const T*>(p.input) + m * p.in_stride;
    pass.out = static_cast<T*>(p.out) + m * p.out_stride;
    pass.rows = std::min<int64_t>(kFewRows, p.rows - m);
    linear_few_rows<T>(pass);
  }
}

}  // namespace int8_tiles
}  // namespace octavo::cpu::OCTAVO_ISA
