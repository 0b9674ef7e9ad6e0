// linear on AMX tiles: bfloat16 out = input · weightᵀ (+ bias) for prefill and batched decode,
// included by linear.cc in the "amx" ISA level only.
//
// An AMX tile multiply (tdpbf16ps) takes a 16 x 32 bf16 tile of the input, a 32 x 16 bf16 tile
// of the weight and adds the 16 x 16 float32 products into an accumulator tile: 8192 multiply-adds
// in one instruction, 8x what vdpbf16ps does per cycle. The weight tile must be in "VNNI" layout:
// tile row r holds, for 16 output features n, the pair of weights (k = 2r, 2r + 1) of row n. A
// weight row's 32 bf16 are 16 such pairs (dwords), so the tile is the 16 x 16 dword transpose of
// 16 weight rows: packed once per panel of 32 weight rows, for every input row of a chunk. A
// kBf16Tiles weight (csrc/kernels/bf16_tiles.h) is stored in that layout already, so its panels
// are read in place; that takes 0.6-0.8x the time at 8-64 rows over a model's weights read from
// DRAM (bench/python/bench_bf16_tiles.py), and a single row runs a vector kernel on it.
//
// Tiles 0-3 accumulate a 32 x 32 block of the output, tiles 4-5 hold two 16-row input tiles and
// 6-7 the two weight tiles of a panel: each step loads 4 tiles and runs 4 multiplies. (With only
// 8 tile registers, 2 x 2 is the largest block; loads cost about as much as the multiplies.)
// Accumulation order within an instruction is the hardware's, and results match the float32
// reference within the rounding of bfloat16 products summed in float32.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace tiles {

constexpr int kTileRows = 16;       // rows of every tile
constexpr int kTileK = 32;          // bf16 per input-tile row: 64 bytes
constexpr int kPanel = 32;          // weight rows per packed panel (two weight tiles)
constexpr int kBlockRows = 32;      // input rows per block (two input tiles)
constexpr int kTileBytes = 1024;    // 16 rows x 64 bytes
// Input rows per chunk: the chunk's activations (kChunkBytes) stay in L2 while every panel of
// the weight passes over them; each panel is packed once per chunk.
constexpr int64_t kChunkBytes = 1 << 20;

// The tile configuration (palette 1): tiles 0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kTileRows;
    }
  }
};

// Packs weight rows [n, n + nr) (nr <= kPanel; missing rows are zeros) into K / 32 pairs of
// weight tiles: panel + (kb * 2 + h) * kTileBytes is the tile of rows n + 16h.. and inputs
// [32 kb, 32 kb + 32).
inline void pack_panel(const bf16* w, int64_t K, int nr, uint8_t* panel) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < K / kTileK; ++kb) {
    for (int h = 0; h < 2; ++h) {
      __m512i rows[16], cols[16];
      for (int i = 0; i < 16; ++i) {
        const int r = 16 * h + i;
        rows[i] = r < nr ? _mm512_loadu_si512(w + r * K + kb * kTileK) : zero;
      }
      transpose_16x16(rows, cols);
      uint8_t* tile = panel + (kb * 2 + h) * kTileBytes;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * 64, cols[i]);
    }
  }
}

// Bias of features [n, n + 32) as two float32 vectors (zeros without bias; lanes past the mask too).
inline void load_bias(const bf16* bias, int64_t n, __mmask32 mask, __m512& b0, __m512& b1) {
  b0 = b1 = _mm512_setzero_ps();
  if (bias == nullptr) return;
  const __m512i bits = _mm512_maskz_loadu_epi16(mask, bias + n);
  b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
  b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
}

// dst[0, 32) (the lanes in mask) = lo, hi plus bias, rounded to bf16.
inline void store_row(__m512 lo, __m512 hi, __m512 b0, __m512 b1, __mmask32 mask, bf16* dst) {
  const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(hi, b1), _mm512_add_ps(lo, b0));
  _mm512_mask_storeu_epi16(dst, mask, packed);
}

// out rows [m, m + mr) (mr <= kBlockRows), features [n, n + nr): the float32 block c (32 x 32,
// row stride 32) plus bias, rounded to bf16.
inline void store_block(const float* c, int mr, int nr, const bf16* bias, int64_t n, bf16* out, int64_t out_stride) {
  const __mmask32 mask = nr >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << nr) - 1);
  __m512 b0, b1;
  load_bias(bias, n, mask, b0, b1);
  for (int r = 0; r < mr; ++r)
    store_row(_mm512_load_ps(c + r * 32), _mm512_load_ps(c + r * 32 + 16), b0, b1, mask, out + r * out_stride + n);
}

// Input rows [m, m + mr) (mr <= kBlockRows; missing rows are zeros) as K / 32 pairs of input
// tiles, each 16 rows x 64 contiguous bytes: tile loads then read whole cache lines in order
// instead of 16 rows a row stride apart (12% less time over the default model's shapes at M =
// 32..1024 than tiles loaded from the activations in place, best of 40 alternating calls).
inline void pack_rows(const bf16* x, int64_t x_stride, int64_t mr, int64_t K, uint8_t* tiles) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t kb = 0; kb < K / kTileK; ++kb) {
    uint8_t* dst = tiles + kb * 2 * kTileBytes;
    for (int r = 0; r < kBlockRows; ++r) {
      const __m512i row = r < mr ? _mm512_loadu_si512(x + r * x_stride + kb * kTileK) : zero;
      _mm512_store_si512(dst + r * 64, row);  // rows 16-31 land in the second tile
    }
  }
}

// A type whose multiply<InputTiles>() runs the tile multiplies of one step of a block product
// (sums 0-3, inputs 4-5, weights 6-7) with the intrinsic `product`: tdpbf16ps here, tdpbssd for
// W4A8 (linear_int8_tiles.h). GCC's tile intrinsics are macros that paste their tile numbers into
// the instruction's text, so the numbers must be literals, not template parameters.
#define OCTAVO_TILE_PRODUCT(Name, product)  \
  struct Name {                             \
    template <int InputTiles>               \
    static void multiply() {                \
      product(0, 4, 6);                     \
      product(1, 4, 7);                     \
      if constexpr (InputTiles == 2) {      \
        product(2, 5, 6);                   \
        product(3, 5, 7);                   \
      }                                     \
    }                                       \
  };
OCTAVO_TILE_PRODUCT(Bf16Product, _tile_dpbf16ps)

// Tiles 0-3 (0-1 with one input tile) cleared, and stored as a 32 x 32 block of 4-byte sums c
// (row stride 32).
template <int InputTiles>
inline void zero_block() {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (InputTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}
template <int InputTiles>
inline void store_sums(void* c) {
  auto* bytes = static_cast<uint8_t*>(c);
  _tile_stored(0, bytes, 128);
  _tile_stored(1, bytes + 64, 128);
  if constexpr (InputTiles == 2) {
    _tile_stored(2, bytes + 16 * 128, 128);
    _tile_stored(3, bytes + 16 * 128 + 64, 128);
  }
}

// Tiles 0-3 (0-1 with one input tile) loaded from a block of sums that store_sums wrote.
template <int InputTiles>
inline void load_sums(const void* c) {
  const auto* bytes = static_cast<const uint8_t*>(c);
  _tile_loadd(0, bytes, 128);
  _tile_loadd(1, bytes + 64, 128);
  if constexpr (InputTiles == 2) {
    _tile_loadd(2, bytes + 16 * 128, 128);
    _tile_loadd(3, bytes + 16 * 128 + 64, 128);
  }
}

// ---- The weights as the first operand (int8 layouts for a few input rows) --------------------
// Each step multiplies one weight tile (16 weight rows, tile 4) by Columns input tiles of 16 input
// rows each (tiles 5-7; a fourth reuses tile 5 once its product has read it) into sums tiles
// 0..Columns-1, each 16 weight rows x 16 input rows. The weight tile's rows lie a_stride bytes
// apart: 64 in an unpacked copy, the row length where the tile is read from the weight itself.
#define OCTAVO_WEIGHT_FIRST_STEP(Name, product)                               \
  struct Name {                                                               \
    template <int Columns>                                                    \
    static void step(const uint8_t* a, int64_t a_stride, const uint8_t* b) {  \
      _tile_loadd(4, a, a_stride);                                            \
      _tile_loadd(5, b, 64);                                                  \
      product(0, 4, 5);                                                       \
      if constexpr (Columns > 1) {                                            \
        _tile_loadd(6, b + tiles::kTileBytes, 64);                            \
        product(1, 4, 6);                                                     \
      }                                                                       \
      if constexpr (Columns > 2) {                                            \
        _tile_loadd(7, b + 2 * tiles::kTileBytes, 64);                        \
        product(2, 4, 7);                                                     \
      }                                                                       \
      if constexpr (Columns > 3) {                                            \
        _tile_loadd(5, b + 3 * tiles::kTileBytes, 64);                        \
        product(3, 4, 5);                                                     \
      }                                                                       \
    }                                                                         \
  };

// Sums tiles 0..Columns-1 cleared, or stored side by side: [16 weight rows][16 * Columns input
// rows] of 4-byte sums at `sums`, row stride `stride` bytes.
template <int Columns>
inline void zero_columns() {
  _tile_zero(0);
  if constexpr (Columns > 1) _tile_zero(1);
  if constexpr (Columns > 2) _tile_zero(2);
  if constexpr (Columns > 3) _tile_zero(3);
}
template <int Columns>
inline void store_columns(void* sums, int stride) {
  auto* bytes = static_cast<uint8_t*>(sums);
  _tile_stored(0, bytes, stride);
  if constexpr (Columns > 1) _tile_stored(1, bytes + 64, stride);
  if constexpr (Columns > 2) _tile_stored(2, bytes + 128, stride);
  if constexpr (Columns > 3) _tile_stored(3, bytes + 192, stride);
}

// Steps [kb_begin, kb_end) of a block product into tiles 0-3: input tiles 4-5 (two per step at
// a, the second only with InputTiles = 2), weight tiles 6-7 (two per step at panel). With `next`,
// the next panel's two tiles of each step are prefetched while this one multiplies.
template <typename Product, int InputTiles>
inline void block_steps(const uint8_t* a, const uint8_t* panel, int64_t kb_begin, int64_t kb_end,
                        const uint8_t* next = nullptr) {
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    if (next != nullptr)
      for (int line = 0; line < 2 * kTileBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + kb * 2 * kTileBytes + line), _MM_HINT_T0);
    _tile_loadd(4, a + kb * 2 * kTileBytes, 64);
    if constexpr (InputTiles == 2) _tile_loadd(5, a + (kb * 2 + 1) * kTileBytes, 64);
    _tile_loadd(6, panel + kb * 2 * kTileBytes, 64);
    _tile_loadd(7, panel + (kb * 2 + 1) * kTileBytes, 64);
    Product::template multiply<InputTiles>();
  }
}

// A 32 x 32 output block from packed input tiles (pack_rows) and a packed panel; with one input
// tile (InputTiles = 1), the first 16 rows only: two multiplies per step instead of four (blocks of
// at most 16 rows: 0.72-0.93x the two-tile time at 8-16 rows, best of 25 alternating calls).
template <int InputTiles>
inline void block_product(const uint8_t* a, const uint8_t* panel, int64_t K, float* c, const uint8_t* next = nullptr) {
  zero_block<InputTiles>();
  block_steps<Bf16Product, InputTiles>(a, panel, 0, K / kTileK, next);
  store_sums<InputTiles>(c);
}

// Panel pi's weight tiles: where a kBf16Tiles weight keeps them, or packed from the dense rows into
// `scratch`.
inline const uint8_t* panel_tiles(const LinearParams& p, int64_t pi, int64_t panel_bytes, int nr, uint8_t* scratch) {
  if (p.weight_format == WeightFormat::kBf16Tiles) return static_cast<const uint8_t*>(p.weight) + pi * panel_bytes;
  pack_panel(static_cast<const bf16*>(p.weight) + pi * kPanel * p.in_features, p.in_features, nr, scratch);
  return scratch;
}

// The product over rows [m_begin, m_end) and panels [panel_begin, panel_end): the rows are packed
// into input tiles once (a last partial block padded with zeros), then each panel is packed and
// multiplied with every row block.
inline void run_part(const LinearParams& p, int64_t m_begin, int64_t m_end, int64_t panel_begin, int64_t panel_end) {
  const int64_t K = p.in_features;
  const bf16* input = static_cast<const bf16*>(p.input);
  const bf16* bias = static_cast<const bf16*>(p.bias);
  bf16* out = static_cast<bf16*>(p.out);
  const int64_t block_bytes = K / kTileK * 2 * kTileBytes;  // one 32-row block, or one panel
  const int64_t blocks = (m_end - m_begin + kBlockRows - 1) / kBlockRows;
  // Per-thread scratch (64-byte aligned, kept between calls), not STL containers: see vec.h.
  auto* panel = static_cast<uint8_t*>(thread_scratch(0, static_cast<size_t>(block_bytes)));
  auto* rows = static_cast<uint8_t*>(thread_scratch(1, static_cast<size_t>(blocks * block_bytes)));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m = m_begin + b * kBlockRows;
    pack_rows(input + m * p.in_stride, p.in_stride, m_end - m < kBlockRows ? m_end - m : kBlockRows, K,
              rows + b * block_bytes);
  }
  static const TileConfig config;
  _tile_loadconfig(&config);
  alignas(64) float c[kBlockRows * kPanel];
  for (int64_t pi = panel_begin; pi < panel_end; ++pi) {
    const int64_t n = pi * kPanel;
    const int nr = static_cast<int>(p.out_features - n < kPanel ? p.out_features - n : kPanel);
    const uint8_t* tiles = panel_tiles(p, pi, block_bytes, nr, panel);
    // Stored tiles stream from memory: the first row block asks for the next panel's ahead
    // (0.8-0.95x the time at 32-64 rows over a model's weights from DRAM, 2 threads).
    const bool ahead = p.weight_format == WeightFormat::kBf16Tiles && pi + 1 < panel_end;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m = m_begin + b * kBlockRows;
      const uint8_t* next = ahead && b == 0 ? tiles + block_bytes : nullptr;
      if (m_end - m <= kTileRows) block_product<1>(rows + b * block_bytes, tiles, K, c, next);
      else block_product<2>(rows + b * block_bytes, tiles, K, c, next);
      store_block(c, static_cast<int>(m_end - m < kBlockRows ? m_end - m : kBlockRows), nr, bias, n,
                  out + m * p.out_stride, p.out_stride);
    }
  }
  _tile_release();
}

// Rows per chunk: as many chunks as kChunkBytes of activations need, of equal size in whole
// blocks (so that threads given one chunk each get equal work).
inline int64_t rows_per_chunk(int64_t M, int64_t K) {
  const int64_t chunks = (M * K * 2 + kChunkBytes - 1) / kChunkBytes;
  const int64_t blocks = ((M + chunks - 1) / chunks + kBlockRows - 1) / kBlockRows;
  return blocks * kBlockRows;
}

// ---- kBf16Tiles weights (packed once at load) -------------------------------------------------
// With the weight tiles stored, a call pays no packing. Below 8 rows the vector kernel below takes
// them instead: it streams the weight at memory speed, where tile loads from DRAM did not (2-4
// rows on tiles: 0.8-0.85x its speed over a model's weights, bench_bf16_tiles.py).
constexpr int64_t kPackedFromRows = 8;
constexpr int64_t kGemvPrefetchBytes = 8 * kTileBytes;  // as far ahead as the dense kernel's prefetch

inline bool takes_packed(const LinearParams& p) {
  return p.weight_format == WeightFormat::kBf16Tiles && p.dtype == DType::kBFloat16;
}

// Rows [m, m + NR) against panels [begin, end) of a kBf16Tiles weight with vdpbf16ps: a tile row
// holds 16 features' weight pairs, multiplied by the row's input pair broadcast to every lane, so
// the 16 lanes are 16 outputs and no horizontal sums are needed. Even and odd pairs accumulate
// apart (two dependency chains); each row's sums run in the same order whatever NR is.
template <int NR>
inline void gemv_rows(const LinearParams& p, int64_t m, int64_t begin, int64_t end) {
  const int64_t K = p.in_features, panel_bytes = K / kTileK * 2 * kTileBytes;
  const auto* x = static_cast<const bf16*>(p.input) + m * p.in_stride;
  const auto* bias = static_cast<const bf16*>(p.bias);
  bf16* out = static_cast<bf16*>(p.out) + m * p.out_stride;
  for (int64_t pi = begin; pi < end; ++pi) {
    const uint8_t* panel = static_cast<const uint8_t*>(p.weight) + pi * panel_bytes;
    __m512 acc[NR][2][2];
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h][0] = acc[r][h][1] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < K / kTileK; ++kb) {
      const uint8_t* tile = panel + kb * 2 * kTileBytes;
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(tile + kGemvPrefetchBytes + i * 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tile + kTileBytes + kGemvPrefetchBytes + i * 64), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + i * 64);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + kTileBytes + i * 64);
        for (int r = 0; r < NR; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * p.in_stride + kb * kTileK + 2 * i, sizeof(pair));
          const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0][i & 1] = _mm512_dpbf16_ps(acc[r][0][i & 1], w0, xr);
          acc[r][1][i & 1] = _mm512_dpbf16_ps(acc[r][1][i & 1], w1, xr);
        }
      }
    }
    __m512 b0, b1;
    load_bias(bias, pi * kPanel, ~__mmask32{0}, b0, b1);
    for (int r = 0; r < NR; ++r)
      store_row(_mm512_add_ps(acc[r][0][0], acc[r][0][1]), _mm512_add_ps(acc[r][1][0], acc[r][1][1]), b0, b1,
                ~__mmask32{0}, out + r * p.out_stride + pi * kPanel);
  }
}

// Below kPackedFromRows rows: threads split the panels, each streaming its own slab of the weight.
inline void gemv_packed(const LinearParams& p) {
  const int64_t panels = p.out_features / kPanel;
  const int threads = get_num_threads();
  const bool serial = p.out_features * p.in_features * 2 < (int64_t{1} << 18);  // waking the pool costs more
  parallel_for(panels, serial ? panels : (panels + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    int64_t m = 0;
    for (; m + 4 <= p.rows; m += 4) gemv_rows<4>(p, m, begin, end);
    switch (p.rows - m) {
      case 3: gemv_rows<3>(p, m, begin, end); break;
      case 2: gemv_rows<2>(p, m, begin, end); break;
      case 1: gemv_rows<1>(p, m, begin, end); break;
      default: break;
    }
  });
}

// Whether the tile path takes this product (the dense bfloat16 case with whole 32-input blocks).
inline bool takes(const LinearParams& p) {
  return p.dtype == DType::kBFloat16 && p.weight_format == WeightFormat::kDense && p.in_features % kTileK == 0;
}

// Work items are (row chunk, panel) pairs, panels fastest: each thread takes a contiguous run of
// panels of one chunk, so it streams its part of the weight while the chunk stays in cache.
// run_part(m_begin, m_end, first panel, last panel) per run.
template <typename RunPart>
void over_chunks_and_panels(int64_t rows, int64_t chunk, int64_t panels, const RunPart& run_part) {
  const int64_t chunks = (rows + chunk - 1) / chunk;
  const int threads = get_num_threads();
  const int64_t grain = (panels * chunks + threads - 1) / threads;
  parallel_for(panels * chunks, grain, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t ci = begin / panels, first = begin % panels;
      const int64_t last = first + (end - begin) < panels ? first + (end - begin) : panels;
      run_part(ci * chunk, (ci + 1) * chunk < rows ? (ci + 1) * chunk : rows, first, last);
      begin += last - first;
    }
  });
}

inline void linear(const LinearParams& p) {
  over_chunks_and_panels(p.rows, rows_per_chunk(p.rows, p.in_features), (p.out_features + kPanel - 1) / kPanel,
                         [&](int64_t m_begin, int64_t m_end, int64_t first, int64_t last) {
                           run_part(p, m_begin, m_end, first, last);
                         });
}

}  // namespace tiles
}  // namespace octavo::cpu::OCTAVO_ISA
