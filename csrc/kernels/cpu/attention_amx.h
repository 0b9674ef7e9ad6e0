// Prefill attention on AMX tiles for bfloat16 caches, included by attention.cc in the "amx" ISA
// level only. A job's query rows (at most 64: four row tiles) meet the keys a chunk of four cache
// blocks (64 keys) at a time: S = Q Kᵀ and acc += P V are tile multiplies, and the online softmax
// between them (attention.cc's vector code) runs once per 64 keys instead of once per block.
//
// Query rows are read as tiles straight from the job's bfloat16 query copy. Keys become the weight
// operand of Q Kᵀ through the 16 x 16 dword transpose (vec.h) linear_amx.h packs weights with (head
// dimensions in pairs as tile rows, keys as columns); values become that of P V by interleaving
// pairs of key rows (keys in pairs as tile rows, head dimensions as columns). P is rounded to
// bfloat16 for the multiply, as FlashAttention does on GPUs; sums stay float32.
//
// Tile registers (all 16 rows x 64 bytes): 0-3 accumulate (S of one row tile against the chunk's
// four blocks, then acc of four row tiles for 16 columns), 4 holds keys or values, 5 queries or P.
#pragma once

#include <immintrin.h>

#include "linear_amx.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace attention_tiles {

constexpr int64_t kRowTile = 16;
constexpr int64_t kMaxRows = 4 * kRowTile;     // accumulator tiles 0-3
constexpr int64_t kBlockKeys = 16;             // the cache block size this path takes
constexpr int64_t kChunkBlocks = 4;            // blocks per softmax step
constexpr int64_t kChunkKeys = kChunkBlocks * kBlockKeys;
constexpr int64_t kTileBytes = tiles::kTileBytes;

// Whether a job of `rows` query rows over a cache of this geometry runs on tiles.
inline bool takes(int64_t rows, int64_t block_size, int64_t head_size) {
  return rows <= kMaxRows && block_size == kBlockKeys && head_size % 32 == 0;
}

inline void begin() {
  static const tiles::TileConfig config;
  _tile_loadconfig(&config);
}

inline void end() { _tile_release(); }

// Scratch bytes for a chunk's packed keys and values, and for P, at head size d.
inline int64_t key_bytes(int64_t d) { return kChunkBlocks * d / 32 * kTileBytes; }
inline int64_t value_bytes(int64_t d) { return kChunkKeys / 32 * d / 16 * kTileBytes; }

// Block b of the chunk (keys [16 x d], or null where the chunk has no block b) as d / 32 key
// tiles at keys + (b * d / 32 + c) * 1 KiB: dimensions [32c, 32c + 32) in pairs (rows) for the 16
// keys (columns). Keys outside the job's range are packed as they are: their scores are masked.
inline void pack_keys(const bf16* kblk, int64_t b, int64_t d, uint8_t* keys) {
  for (int64_t c = 0; c < d / 32; ++c) {
    uint8_t* tile = keys + (b * d / 32 + c) * kTileBytes;
    if (kblk == nullptr) continue;  // never multiplied
    __m512i rows[16], cols[16];
    for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(kblk + j * d + c * 32);
    transpose_16x16(rows, cols);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 64, cols[i]);
  }
}

// Block b's values [16 x d] into the chunk's value tiles: tile (h, c) at values + (h * d / 16 + c)
// * 1 KiB holds keys [32h, 32h + 32) of the chunk in pairs (row i: keys 2i and 2i + 1,
// interleaved) for columns [16c, 16c + 16). Keys outside [j0, j1), and a missing block, are zeros:
// an unwritten cache row may hold NaNs, and 0 * NaN would reach the sums.
inline void pack_values(const bf16* vblk, int64_t b, int64_t d, int64_t j0, int64_t j1, uint8_t* values) {
  const auto row = [&](int64_t j, int64_t c) {
    return vblk != nullptr && j >= j0 && j < j1
               ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vblk + j * d + c * 16))
               : _mm256_setzero_si256();
  };
  const int64_t h = b / 2, first_row = (b % 2) * 8;  // two blocks per 32-key tile
  for (int64_t c = 0; c < d / 16; ++c) {
    uint8_t* tile = values + (h * d / 16 + c) * kTileBytes;
    for (int64_t i = 0; i < 8; ++i) {
      const __m512i even = _mm512_cvtepu16_epi32(row(2 * i, c));
      const __m512i odd = _mm512_slli_epi32(_mm512_cvtepu16_epi32(row(2 * i + 1, c)), 16);
      _mm512_storeu_si512(tile + (first_row + i) * 64, _mm512_or_si512(even, odd));
    }
  }
}

// s [16 rows x 64 keys] = q (16 rows, stride d) times the chunk's key tiles, for NB blocks.
template <int NB>
inline void row_tile_scores(const bf16* q, int64_t d, const uint8_t* keys, float* s) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t tiles_per_block = d / 32;
  for (int64_t c = 0; c < d / 32; ++c) {
    _tile_loadd(5, q + c * 32, d * 2);
    _tile_loadd(4, keys + c * kTileBytes, 64);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NB > 1) {
      _tile_loadd(4, keys + (tiles_per_block + c) * kTileBytes, 64);
      _tile_dpbf16ps(1, 5, 4);
    }
    if constexpr (NB > 2) {
      _tile_loadd(4, keys + (2 * tiles_per_block + c) * kTileBytes, 64);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (NB > 3) {
      _tile_loadd(4, keys + (3 * tiles_per_block + c) * kTileBytes, 64);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  constexpr int64_t ld = kChunkKeys * 4;
  _tile_stored(0, s, ld);
  if constexpr (NB > 1) _tile_stored(1, s + kBlockKeys, ld);
  if constexpr (NB > 2) _tile_stored(2, s + 2 * kBlockKeys, ld);
  if constexpr (NB > 3) _tile_stored(3, s + 3 * kBlockKeys, ld);
}

// s [rows x 64] = scale * Q Kᵀ against the chunk's `blocks` blocks (scores of missing blocks are
// left unset: the mask overwrites them). q holds rows rounded up to 16, pad rows zero.
inline void scores(const bf16* q, int64_t rows, int64_t d, const uint8_t* keys, int64_t blocks, float scale,
                   float* s) {
  for (int64_t r = 0; r < rows; r += kRowTile) {
    const bf16* qr = q + r * d;
    float* sr = s + r * kChunkKeys;
    switch (blocks) {
      case 1: row_tile_scores<1>(qr, d, keys, sr); break;
      case 2: row_tile_scores<2>(qr, d, keys, sr); break;
      case 3: row_tile_scores<3>(qr, d, keys, sr); break;
      default: row_tile_scores<4>(qr, d, keys, sr); break;
    }
  }
  const __m512 k = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < blocks * kBlockKeys; j += 16)
      _mm512_storeu_ps(s + r * kChunkKeys + j, _mm512_mul_ps(_mm512_loadu_ps(s + r * kChunkKeys + j), k));
}

// acc[r][16c .. 16c + 16) += P V for NRT row tiles; p [rows x 64] bf16, halves h < NH of 32 keys.
template <int NRT>
inline void column_values(const bf16* p, const uint8_t* values, int64_t d, int64_t c, int nh, float* acc) {
  float* a = acc + c * 16;
  const int64_t stride = d * 4, p_stride = kChunkKeys * 2;
  _tile_loadd(0, a, stride);
  if constexpr (NRT > 1) _tile_loadd(1, a + kRowTile * d, stride);
  if constexpr (NRT > 2) _tile_loadd(2, a + 2 * kRowTile * d, stride);
  if constexpr (NRT > 3) _tile_loadd(3, a + 3 * kRowTile * d, stride);
  for (int h = 0; h < nh; ++h) {
    _tile_loadd(4, values + (h * d / 16 + c) * kTileBytes, 64);
    _tile_loadd(5, p + h * 32, p_stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NRT > 1) {
      _tile_loadd(5, p + kRowTile * kChunkKeys + h * 32, p_stride);
      _tile_dpbf16ps(1, 5, 4);
    }
    if constexpr (NRT > 2) {
      _tile_loadd(5, p + 2 * kRowTile * kChunkKeys + h * 32, p_stride);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (NRT > 3) {
      _tile_loadd(5, p + 3 * kRowTile * kChunkKeys + h * 32, p_stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  }
  _tile_stored(0, a, stride);
  if constexpr (NRT > 1) _tile_stored(1, a + kRowTile * d, stride);
  if constexpr (NRT > 2) _tile_stored(2, a + 2 * kRowTile * d, stride);
  if constexpr (NRT > 3) _tile_stored(3, a + 3 * kRowTile * d, stride);
}

// acc [rows x d, rows rounded up to 16] += P V over the chunk's `blocks` blocks, with P (the
// probabilities online_softmax left in s) rounded to bfloat16 into p (pad rows zero).
inline void values(const float* s, int64_t rows, const uint8_t* values, int64_t blocks, int64_t d, bf16* p,
                   float* acc) {
  const int64_t row_tiles = (rows + kRowTile - 1) / kRowTile;
  const int nh = static_cast<int>((blocks + 1) / 2);  // 32-key halves holding the blocks
  for (int64_t r = 0; r < row_tiles * kRowTile; ++r)
    for (int64_t j = 0; j < nh * 32; j += 16) {
      const __m256i bits = r < rows ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + r * kChunkKeys + j))
                                    : _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * kChunkKeys + j), bits);
    }
  for (int64_t c = 0; c < d / 16; ++c) {
    switch (row_tiles) {
      case 1: column_values<1>(p, values, d, c, nh, acc); break;
      case 2: column_values<2>(p, values, d, c, nh, acc); break;
      case 3: column_values<3>(p, values, d, c, nh, acc); break;
      default: column_values<4>(p, values, d, c, nh, acc); break;
    }
  }
}

}  // namespace attention_tiles
}  // namespace octavo::cpu::OCTAVO_ISA
