// linear: out = input · weightᵀ (+ bias) for the small row counts of decode steps.
//
// At M = 1 a projection is a matrix-vector product: each weight byte is used once, so the kernel
// only has to stream the weight at memory speed. It walks tiles of kRows weight rows; for each
// group of up to kCols input rows it keeps kRows x kCols vector accumulators live across the K
// loop (the weight tile stays in L1 while the input groups of a larger M pass over it), and
// reduces each accumulator once at the end. Threads split the output features, so every thread
// streams its own contiguous slab of the weight. Each output element is the same sum in the same
// order whatever M is and whichever thread computes it (batch invariant). From 16 rows on, float32
// runs on transposed weight panels instead (linear_panels.h) and bfloat16 on AMX tiles where the
// CPU has them (linear_amx.h); each is batch invariant on its side of its threshold. W4A8 weights
// (int4_a8) multiply int8 inputs: linear_int8_inputs.h, and from 4 rows on AMX int8 tiles
// (linear_int8_tiles.h); so do W8A8 weights (int8_a8): linear_int8_a8.h, and the same tiles; and
// GGUF blocks where the caller asks for int8 inputs (int8_inputs): linear_gguf_a8.h, and from 16
// rows on AVX512-VNNI linear_gguf_a8_panels.h.
#include <type_traits>

#include "bf16_tiles.h"
#include "gguf_blocks.h"
#include "isa_kernels.h"
#include "linear_gguf_a8_panels.h"
#include "linear_int8_a8.h"
#include "linear_int8_inputs.h"
#include "linear_panels.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"
#if defined(__AMX_BF16__)
#include "linear_amx.h"
#include "linear_int8_bf16_tiles.h"
#include "linear_int8_tiles.h"
#endif

namespace octavo::cpu::OCTAVO_ISA {
namespace {

constexpr int kRows = 4;  // weight rows per tile
constexpr int kCols = 4;  // input rows per accumulator group: kRows * kCols accumulators
// Weight rows are software-prefetched this far ahead (two tiles), as insurance for the many
// short row streams of a decode step's small matrices; on the development machine it measured
// neutral within the bandwidth drift, and it costs one instruction per cache line.
constexpr int64_t kPrefetchRows = 2 * kRows;
// Below this many weight bytes the job runs on the calling thread (waking the pool costs more
// than it saves for the tiny matrices of tests).
constexpr int64_t kSerialWeightBytes = 1 << 18;

// acc[r][c] = dot(w[r], x[c]) over K, for nr <= kRows weight rows and NC input rows. The
// weights are float32 when they are a quantized tile decoded once for many input rows.
template <int NC, typename TW, typename T>
void dot_tile(const TW* w, int64_t K, int nr, const T* x, int64_t x_stride, float acc_out[kRows][kCols]) {
  VecF acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = VecF::zero();
  const TW* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (r < nr ? r : 0) * K;  // missing rows repeat row 0
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    VecF xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = VecF::load(x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      if ((k * sizeof(TW)) % 64 == 0) __builtin_prefetch(wr[r] + k + kPrefetchRows * K);
      const VecF wv = VecF::load(wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = fma(wv, xv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const int m = static_cast<int>(K - k);
    VecF xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = load_partial(x + c * x_stride + k, m);
    for (int r = 0; r < kRows; ++r) {
      const VecF wv = load_partial(wr[r] + k, m);
      for (int c = 0; c < NC; ++c) acc[r][c] = fma(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc_out[r][c] = reduce_add(acc[r][c]);
}

#if defined(__AVX512BF16__)
// bfloat16 on CPUs with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs and adds them pairwise
// into 16 float32 lanes, so one instruction consumes a whole cache line of each operand and no
// conversions are needed. (It flushes denormal inputs to zero; their products lie far below the
// float32 sums' resolution, so results match the FMA path within rounding.)
template <int NC>
void dot_tile(const bf16* w, int64_t K, int nr, const bf16* x, int64_t x_stride, float acc_out[kRows][kCols]) {
  __m512 acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const bf16* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (r < nr ? r : 0) * K;
  int64_t k = 0;
  // Plain loads in the main loop and the masked tail written out apart: with one masked loop
  // body GCC stores every accumulator to the stack on each iteration.
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = (__m512bh)_mm512_loadu_si512(x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      __builtin_prefetch(wr[r] + k + kPrefetchRows * K);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);
    }
  }
  if (k < K) {  // masked-off lanes load zeros, which add nothing
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[NC];
    for (int c = 0; c < NC; ++c) xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c * x_stride + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc_out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

template <typename TW, typename T>
void dot_tile_any(int nc, const TW* w, int64_t K, int nr, const T* x, int64_t x_stride, float acc[kRows][kCols]) {
  switch (nc) {
    case 1: return dot_tile<1>(w, K, nr, x, x_stride, acc);
    case 2: return dot_tile<2>(w, K, nr, x, x_stride, acc);
    case 3: return dot_tile<3>(w, K, nr, x, x_stride, acc);
    default: return dot_tile<4>(w, K, nr, x, x_stride, acc);
  }
}

// ---- GGUF block formats: gguf_blocks.h ----------------------------------------------------
using gguf::BlockScale;
using gguf::Gguf;
using gguf::kBlock;

// ---- Octavo's own quantized formats (weights quantized at load time) -----------------------
// kInt8: w = q * s, q int8 [N, K], s float32 per output row. kInt4: w = (q - z) * s, q a nibble
// (bytes [N, K / 2], each 32 weights in 16 bytes ordered as GGUF's), s float32 and z uint8 per
// row and group of group_size inputs. One product (and an exact small-integer difference), so a
// decoded weight is again exactly what `dequantize` writes.

#if defined(__AVX512F__)
inline BlockScale int4_scale(float s, float z) { return {gguf::affine_values(0, z, s, 0, false), VecF::zero()}; }
inline VecF int4_decode(const uint8_t* q, int j, const BlockScale& s) {
  return gguf::lookup(s, gguf::VecU::bytes(q + (j & 15)) >> (j < 16 ? 0 : 4));
}
#else
inline BlockScale int4_scale(float s, float z) { return {VecF::set1(s), VecF::set1(z)}; }
inline VecF int4_decode(const uint8_t* q, int j, const BlockScale& s) {
  return (VecF::load_u4(q + (j & 15), j < 16 ? 0 : 4) - s.b) * s.a;
}
#endif

// Where the rows n.. n + nr - 1 of a quantized weight live, and how their blocks of 32 decode:
// scale(r, blk) for the first of each blocks_per_scale() blocks that share a scale, and
// decode(r, blk, j, scale) for weights [j, j + kW).
// Rows past nr repeat row n (their results are dropped).
constexpr int kScaleBatch = 16;  // blocks of 32 whose scales GGUF rows read at once

template <WeightFormat F>
struct GgufRows {
  using Format = Gguf<F>;
  static constexpr bool kSuperBlocks = Format::kWeights > kBlock;
  static constexpr int kSubBlocks = Format::kWeights / kBlock;
  const uint8_t* row[kRows];
  int64_t row_bytes;
  GgufRows(const LinearParams& p, int64_t n, int nr) : row_bytes(p.in_features / Format::kWeights * Format::kBytes) {
    for (int r = 0; r < kRows; ++r) row[r] = static_cast<const uint8_t*>(p.weight) + (n + (r < nr ? r : 0)) * row_bytes;
  }
  // The (super-)block holding block blk of 32 weights, and for prefetches, its part's bytes.
  const uint8_t* container(int r, int64_t blk) const { return row[r] + blk / kSubBlocks * Format::kBytes; }
  const uint8_t* block(int r, int64_t blk) const {
    return container(r, blk) + blk % kSubBlocks * (Format::kBytes / kSubBlocks);
  }
  int64_t blocks_per_scale() const { return 1; }
  VecF decode(int r, int64_t blk, int j, const BlockScale& s) const {
    if constexpr (kSuperBlocks) return Format::decode(container(r, blk), static_cast<int>(blk % kSubBlocks), j, s);
    else return Format::decode(block(r, blk), j, s);
  }
  // The kernels read the scales of kScaleBatch blocks at a time (gguf::read_scales), and
  // scale_values(d, m) builds what decode needs from them: on AVX-512 1.4-1.6x the Q4_1 bytes per
  // second at M = 1 of reading each block's scale on its own (bench_linear.py, 2 threads; same bits).
  static constexpr bool kBlockScales = true;
  void scales(int r, int64_t blk, int count, float* d, float* m) const {
    gguf::read_scales<F>(row[r], blk, count, d, m);
  }
  static BlockScale scale_values(float d, float m) { return Format::scale_values(d, m); }
};


struct Int8Rows {
  const int8_t* row[kRows];
  float s[kRows];
  int64_t row_bytes;
  Int8Rows(const LinearParams& p, int64_t n, int nr) : row_bytes(p.in_features) {
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = n + (r < nr ? r : 0);
      row[r] = static_cast<const int8_t*>(p.weight) + i * row_bytes;
      s[r] = p.scales[i];
    }
  }
  const int8_t* block(int r, int64_t blk) const { return row[r] + blk * kBlock; }
  BlockScale scale(int r, int64_t) const { return {VecF::set1(s[r]), VecF::zero()}; }
  int64_t blocks_per_scale() const { return row_bytes / kBlock; }  // one scale per row
  static constexpr bool kBlockScales = false;
  VecF decode(int r, int64_t blk, int j, const BlockScale& sc) const { return VecF::load_i8(block(r, blk) + j) * sc.a; }
};

// Float32 scales per row and group of group_size inputs (kInt4, kFp8). A block's group is
// blk / blocks_per_group as a multiply and a shift instead of a 64-bit division (2-3% of int4
// decode on the LM head, measured A/B when every block asked for its scale; a group index
// counted by the callers measured no faster, 2026-11-24). Exact while blk < 2^32 /
// blocks_per_group^2, which the adapter checks.
struct GroupScales {
  const float* s[kRows];
  int64_t groups, blocks_per_group;
  uint64_t group_magic;
  GroupScales(const LinearParams& p, int64_t n, int nr)
      : groups(p.in_features / p.group_size),
        blocks_per_group(p.group_size / kBlock),
        group_magic(((uint64_t{1} << 32) + static_cast<uint64_t>(blocks_per_group) - 1) /
                    static_cast<uint64_t>(blocks_per_group)) {
    for (int r = 0; r < kRows; ++r) s[r] = p.scales + (n + (r < nr ? r : 0)) * groups;
  }
  uint64_t group(int64_t blk) const { return (static_cast<uint64_t>(blk) * group_magic) >> 32; }
  int64_t blocks_per_scale() const { return blocks_per_group; }
};

struct Int4Rows : GroupScales {
  const uint8_t* row[kRows];
  const uint8_t* z[kRows];
  int64_t row_bytes;
  Int4Rows(const LinearParams& p, int64_t n, int nr) : GroupScales(p, n, nr), row_bytes(p.in_features / 2) {
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = n + (r < nr ? r : 0);
      row[r] = static_cast<const uint8_t*>(p.weight) + i * row_bytes;
      z[r] = p.zeros + i * groups;
    }
  }
  const uint8_t* block(int r, int64_t blk) const { return row[r] + blk * (kBlock / 2); }
  BlockScale scale(int r, int64_t blk) const {
    const uint64_t g = group(blk);
    return int4_scale(s[r][g], static_cast<float>(z[r][g]));
  }
  static constexpr bool kBlockScales = false;
  VecF decode(int r, int64_t blk, int j, const BlockScale& sc) const { return int4_decode(block(r, blk), j, sc); }
};

// FP8 (E4M3) weights, w = q * s (kFp8: an FP8 checkpoint's per-tensor, per-channel or
// block-wise scales). Decoded as (q / 256) * (s * 256), which is q * s exactly (powers of two),
// so that the 256 costs no product per weight (VecF::load_fp8_weight). NaN codes decode as
// +-480 s: the loaders refuse weights that hold one.
struct Fp8Rows : GroupScales {
  const uint8_t* row[kRows];
  int64_t row_bytes;
  Fp8Rows(const LinearParams& p, int64_t n, int nr) : GroupScales(p, n, nr), row_bytes(p.in_features) {
    for (int r = 0; r < kRows; ++r) row[r] = static_cast<const uint8_t*>(p.weight) + (n + (r < nr ? r : 0)) * row_bytes;
  }
  const uint8_t* block(int r, int64_t blk) const { return row[r] + blk * kBlock; }
  BlockScale scale(int r, int64_t blk) const { return {VecF::set1(s[r][group(blk)] * 256.0f), VecF::zero()}; }
  static constexpr bool kBlockScales = false;
  VecF decode(int r, int64_t blk, int j, const BlockScale& sc) const {
    return VecF::load_fp8_weight(block(r, blk) + j) * sc.a;
  }
};

// kBf16Tiles read a value at a time: the portable path for levels without AMX (weights are packed
// only where the amx level runs; this keeps them correct if the level changes afterwards).
struct Bf16TileRows {
  const bf16* weight;
  int64_t n, K, row_bytes;
  int nr;  // rows past nr repeat row n
  Bf16TileRows(const LinearParams& p, int64_t first, int rows)
      : weight(static_cast<const bf16*>(p.weight)), n(first), K(p.in_features), row_bytes(p.in_features * 2), nr(rows) {}
  int64_t row(int r) const { return n + (r < nr ? r : 0); }
  const bf16* block(int r, int64_t blk) const { return weight + bf16_tiles::element_index(row(r), blk * kBlock, K); }
  BlockScale scale(int, int64_t) const { return {VecF::zero(), VecF::zero()}; }
  int64_t blocks_per_scale() const { return K / kBlock; }
  static constexpr bool kBlockScales = false;
  VecF decode(int r, int64_t blk, int j, const BlockScale&) const {
    float values[kW];
    for (int e = 0; e < kW; ++e) values[e] = to_float(weight[bf16_tiles::element_index(row(r), blk * kBlock + j + e, K)]);
    return VecF::load(values);
  }
};

// body(blk, scale) for blocks [0, blocks) of rows [first_row, first_row + R), scale[i] being row
// first_row + i's BlockScale for the block: GGUF rows read their per-block scales kScaleBatch
// blocks at a time, the other formats build a scale once for the blocks that share it.
template <int R, typename Rows, typename Body>
void for_each_block(const Rows& w, int first_row, int64_t blocks, const Body& body) {
  BlockScale scale[R];
  if constexpr (Rows::kBlockScales) {
    alignas(64) float d[R][kScaleBatch], m[R][kScaleBatch];
    for (int64_t first = 0; first < blocks; first += kScaleBatch) {
      const int count = static_cast<int>(blocks - first < kScaleBatch ? blocks - first : kScaleBatch);
      for (int r = 0; r < R; ++r) w.scales(first_row + r, first, count, d[r], m[r]);
      for (int i = 0; i < count; ++i) {
        for (int r = 0; r < R; ++r) scale[r] = Rows::scale_values(d[r][i], m[r][i]);
        body(first + i, scale);
      }
    }
  } else {
    int64_t until_rescale = 0;  // blocks left that share the current scales
    for (int64_t blk = 0; blk < blocks; ++blk) {
      if (until_rescale-- == 0) {
        for (int r = 0; r < R; ++r) scale[r] = w.scale(first_row + r, blk);
        until_rescale = w.blocks_per_scale() - 1;
      }
      body(blk, scale);
    }
  }
}

// Row r of w as floats, out[0, blocks * kBlock): what dot_tile_quant multiplies (or those floats
// rounded to out's 16-bit type, for dequantize).
template <typename Rows, typename O>
void decode_row(const Rows& w, int r, int64_t blocks, O* out) {
  for_each_block<1>(w, r, blocks, [&](int64_t blk, const BlockScale* scale) {
    for (int j = 0; j < kBlock; j += kW) w.decode(r, blk, j, scale[0]).store(out + blk * kBlock + j);
  });
}

// As dot_tile, over `blocks` blocks of 32 quantized weights per row. Weights are decoded once
// per vector and used by all NC input rows; the lanes accumulate in the dense kernel's order.
template <int NC, typename Rows, typename T>
void dot_tile_quant(const Rows& w, int64_t blocks, const T* x, int64_t x_stride, float acc_out[kRows][kCols]) {
  VecF acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = VecF::zero();
  for_each_block<kRows>(w, 0, blocks, [&](int64_t blk, const BlockScale* scale) {
    for (int r = 0; r < kRows; ++r)
      __builtin_prefetch(reinterpret_cast<const char*>(w.block(r, blk)) + kPrefetchRows * w.row_bytes);
    const T* xb = x + blk * kBlock;
    for (int j = 0; j < kBlock; j += kW) {
      VecF xv[NC];
      for (int c = 0; c < NC; ++c) xv[c] = VecF::load(xb + c * x_stride + j);
      for (int r = 0; r < kRows; ++r) {
        const VecF wv = w.decode(r, blk, j, scale[r]);
        for (int c = 0; c < NC; ++c) acc[r][c] = fma(wv, xv[c], acc[r][c]);
      }
    }
  });
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc_out[r][c] = reduce_add(acc[r][c]);
}

template <typename Rows, typename T>
void dot_tile_quant_any(int nc, const Rows& w, int64_t blocks, const T* x, int64_t x_stride,
                        float acc[kRows][kCols]) {
  switch (nc) {
    case 1: return dot_tile_quant<1>(w, blocks, x, x_stride, acc);
    case 2: return dot_tile_quant<2>(w, blocks, x, x_stride, acc);
    case 3: return dot_tile_quant<3>(w, blocks, x, x_stride, acc);
    default: return dot_tile_quant<4>(w, blocks, x, x_stride, acc);
  }
}

// Input rows are taken in chunks whose activations fit in L2 (with the weight tile in L1): every
// weight tile then re-reads the chunk from L2. Without chunks, a prefill of 8192 rows streamed its
// 19 MB of activations from L3 or DRAM once per 4 weight rows, and ran 2.5-4x slower per row than
// M = 2048 (bench/RESULTS.md). Chunks are multiples of kCols, so the groups of input rows, and
// with them every output bit, are the same whatever M is.
// Long rows (K > 8192 floats) still get kMinChunkRows per chunk: a chunk re-reads the whole
// weight matrix from memory, so chunks of 4 rows read it M / 4 times (1024 x 14336 float32 at
// M = 64: 23 ms, against 13 ms for torch).
constexpr int64_t kChunkBytes = 1 << 18;
constexpr int64_t kMinChunkRows = 64;

int64_t rows_per_chunk(int64_t row_bytes) {
  const int64_t rows = kChunkBytes / row_bytes / kCols * kCols;
  return rows > kMinChunkRows ? rows : kMinChunkRows;
}

// Output features [n_begin, n_end) of every row. For each tile of kRows weight rows,
// tile.start(n, nr, rows) prepares rows n.. n + nr - 1 for `rows` input rows, then
// tile(nc, x, acc) fills acc[r][c] with their dot products with input rows x, x + in_stride, ...
template <typename T, typename Tile>
void linear_slab(const LinearParams& p, int64_t n_begin, int64_t n_end, Tile& tile) {
  const T* input = static_cast<const T*>(p.input);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  const int64_t chunk = rows_per_chunk(p.in_features * static_cast<int64_t>(sizeof(T)));
  float acc[kRows][kCols];
  for (int64_t m_begin = 0; m_begin < p.rows; m_begin += chunk) {
    const int64_t m_end = p.rows - m_begin < chunk ? p.rows : m_begin + chunk;
    for (int64_t n = n_begin; n < n_end; n += kRows) {
      const int nr = static_cast<int>(n_end - n < kRows ? n_end - n : kRows);
      tile.start(n, nr, m_end - m_begin);
      for (int64_t m = m_begin; m < m_end; m += kCols) {
        const int nc = static_cast<int>(m_end - m < kCols ? m_end - m : kCols);
        tile(nc, input + m * p.in_stride, acc);
        for (int c = 0; c < nc; ++c)
          for (int r = 0; r < nr; ++r) {
            const float b = bias != nullptr ? to_float(bias[n + r]) : 0.0f;
            out[(m + c) * p.out_stride + n + r] = from_float<T>(acc[r][c] + b);
          }
      }
    }
  }
}

// Tile is constructed once per thread from (p) and run by linear_slab.
template <typename T, typename Tile>
void run_linear(const LinearParams& p, int64_t weight_bytes) {
  const int64_t tiles = (p.out_features + kRows - 1) / kRows;
  const int threads = get_num_threads();
  // One contiguous slab per thread: each streams its part of the weight front to back.
  const int64_t grain = weight_bytes < kSerialWeightBytes ? tiles : (tiles + threads - 1) / threads;
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    const int64_t n_end = end * kRows < p.out_features ? end * kRows : p.out_features;
    Tile tile(p);
    linear_slab<T>(p, begin * kRows, n_end, tile);
  });
}

template <typename T>
struct DenseTile {
  const LinearParams& p;
  const T* w = nullptr;
  int nr = 0;
  explicit DenseTile(const LinearParams& params) : p(params) {}
  void start(int64_t n, int rows_in_tile, int64_t) {
    w = static_cast<const T*>(p.weight) + n * p.in_features;
    nr = rows_in_tile;
  }
  void operator()(int nc, const T* x, float acc[kRows][kCols]) const {
    dot_tile_any(nc, w, p.in_features, nr, x, p.in_stride, acc);
  }
};

// From this many input rows on, a quantized tile is decoded once into float32 and the dense
// kernel runs over it; below, weights are decoded in registers for each group of kCols rows.
// Both decode to the same floats and add them in the same order, so the switch changes no bit.
constexpr int64_t kDecodeOnceRows = 2 * kCols;

#if defined(__AMX_BF16__)
// From this many input rows on, bfloat16 products run on AMX tiles (linear_amx.h). Best of 15
// alternating calls on the default model's shapes (bench/RESULTS.md): at 8 rows the tiles took
// 0.55-0.85x the vdpbf16ps kernel's time, at 16 rows 0.3-0.55x; at 4 rows 1.1-2.4x, at 1-2 rows
// up to 2.5x (packing the weight tiles is paid for a few rows). Rows are batch invariant on either
// side of the switch: every row of a tile product is summed in the same order.
constexpr int64_t kAmxFromRows = 8;
#endif

template <typename Rows, typename T>
struct QuantTile {
  const LinearParams& p;
  Rows rows{p, 0, 1};
  float* decoded = nullptr;  // kRows x in_features floats when the tile is decoded once
  explicit QuantTile(const LinearParams& params) : p(params) {}
  void start(int64_t n, int nr, int64_t input_rows) {
    rows = Rows(p, n, nr);
    decoded = input_rows >= kDecodeOnceRows ? decode(rows) : nullptr;
  }
  void operator()(int nc, const T* x, float acc[kRows][kCols]) const {
    if (decoded != nullptr) return dot_tile_any(nc, decoded, p.in_features, kRows, x, p.in_stride, acc);
    dot_tile_quant_any(nc, rows, p.in_features / kBlock, x, p.in_stride, acc);
  }
  float* decode(const Rows& w) const {
    const int64_t K = p.in_features;
    float* rows = panels::row_buffer(kRows * K);  // per thread: no allocation once the largest K was seen
    for (int r = 0; r < kRows; ++r) decode_row(w, r, K / kBlock, rows + r * K);
    return rows;
  }
};

// A quantized weight's rows decoded into a float32 panel (linear_panels.h): kW rows at a time
// into floats, as dequantize writes them, then transposed.
template <typename Rows>
struct QuantPanel {
  const LinearParams& p;
  void operator()(int64_t n, int nr, float* panel) const {
    const int64_t K = p.in_features;
    float* rows = panels::row_buffer(kW * K);
    for (int j = 0; j < nr; j += kW) {
      const int count = nr - j < kW ? nr - j : kW;
      for (int r = 0; r < count; ++r) decode_row(Rows(p, n + j + r, 1), 0, K / kBlock, rows + r * K);
      panels::transpose_rows(rows, K, count, K, j, panel);
    }
    panels::zero_columns(nr, K, panel);
  }
};

// Calls fn(static_cast<Rows*>(nullptr)) with the row decoder of p's quantized format.
template <typename Fn>
void dispatch_rows(const LinearParams& p, Fn&& fn) {
  switch (p.weight_format) {
    case WeightFormat::kQ8_0: return fn(static_cast<GgufRows<WeightFormat::kQ8_0>*>(nullptr));
    case WeightFormat::kQ4_0: return fn(static_cast<GgufRows<WeightFormat::kQ4_0>*>(nullptr));
    case WeightFormat::kQ4_1: return fn(static_cast<GgufRows<WeightFormat::kQ4_1>*>(nullptr));
    case WeightFormat::kQ5_0: return fn(static_cast<GgufRows<WeightFormat::kQ5_0>*>(nullptr));
    case WeightFormat::kQ5_1: return fn(static_cast<GgufRows<WeightFormat::kQ5_1>*>(nullptr));
    case WeightFormat::kIQ4_NL: return fn(static_cast<GgufRows<WeightFormat::kIQ4_NL>*>(nullptr));
    case WeightFormat::kQ3_K: return fn(static_cast<GgufRows<WeightFormat::kQ3_K>*>(nullptr));
    case WeightFormat::kQ4_K: return fn(static_cast<GgufRows<WeightFormat::kQ4_K>*>(nullptr));
    case WeightFormat::kQ5_K: return fn(static_cast<GgufRows<WeightFormat::kQ5_K>*>(nullptr));
    case WeightFormat::kQ6_K: return fn(static_cast<GgufRows<WeightFormat::kQ6_K>*>(nullptr));
    case WeightFormat::kInt8:
    case WeightFormat::kInt8A8: return fn(static_cast<Int8Rows*>(nullptr));
    case WeightFormat::kInt4:
    case WeightFormat::kInt4A8: return fn(static_cast<Int4Rows*>(nullptr));
    case WeightFormat::kFp8: return fn(static_cast<Fp8Rows*>(nullptr));
    case WeightFormat::kBf16Tiles: return fn(static_cast<Bf16TileRows*>(nullptr));
    case WeightFormat::kDense: break;
  }
  OCTAVO_CHECK(false, "not a quantized weight format: " << weight_format_name(p.weight_format));
}

void run_panels(const LinearParams& p) {
  if (p.weight_format == WeightFormat::kDense)
    return panels::linear(p, panels::DensePanel{static_cast<const float*>(p.weight), p.in_features});
  dispatch_rows(p, [&](auto* rows) { panels::linear(p, QuantPanel<std::remove_pointer_t<decltype(rows)>>{p}); });
}

template <typename T>
void run_dense(const LinearParams& p) {
  run_linear<T, DenseTile<T>>(p, p.out_features * p.in_features * static_cast<int64_t>(sizeof(T)));
}

template <typename Rows, typename T>
void run_quant(const LinearParams& p) {
  run_linear<T, QuantTile<Rows, T>>(p, p.out_features * Rows(p, 0, 1).row_bytes);
}

template <typename T>
void run_typed(const LinearParams& p) {
  if (p.weight_format == WeightFormat::kDense) return run_dense<T>(p);
  dispatch_rows(p, [&](auto* rows) { run_quant<std::remove_pointer_t<decltype(rows)>, T>(p); });
}

// Each row decoded to float32 and stored as out's dtype (16-bit types rounded to nearest even
// by the vector stores: 1.5x the rate of converting a float32 row element by element (int4
// 6144x2048 to bfloat16, 2 threads: 2.25 -> 1.54 ms), for bfloat16 prefill on dequantized weights).
template <typename Rows, typename T>
void dequantize_rows(const LinearParams& p) {
  const int64_t K = p.in_features;
  parallel_for(p.out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) decode_row(Rows(p, n, 1), 0, K / kBlock, static_cast<T*>(p.out) + n * K);
  });
}

template <typename Rows>
void dequantize_typed(const LinearParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return dequantize_rows<Rows, float>(p);
    case DType::kBFloat16: return dequantize_rows<Rows, bf16>(p);
    case DType::kFloat16: return dequantize_rows<Rows, f16>(p);
    default: OCTAVO_CHECK(false, "dequantize: unsupported dtype " << dtype_name(p.dtype));
  }
}

// W4A8 and W8A8 weights: int8 inputs at every row count.
template <typename T>
void linear_int8_inputs(const LinearParams& p) {
#if defined(__AMX_BF16__)
  if (int8_tiles::takes(p)) return int8_tiles::linear<T>(p);
#endif
  if (p.weight_format == WeightFormat::kInt8A8) return int8_a8::linear<T>(p);
  int8_inputs::linear<T>(p);
}

}  // namespace

void linear(const LinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  if (p.int8_inputs) {
    switch (p.dtype) {
      case DType::kFloat32: return gguf_a8::linear<float>(p);
      case DType::kBFloat16: return gguf_a8::linear<bf16>(p);
      case DType::kFloat16: return gguf_a8::linear<f16>(p);
      default: OCTAVO_CHECK(false, "linear: unsupported dtype " << dtype_name(p.dtype));
    }
  }
  if (p.weight_format == WeightFormat::kInt4A8 || p.weight_format == WeightFormat::kInt8A8) {
    switch (p.dtype) {
      case DType::kFloat32: return linear_int8_inputs<float>(p);
      case DType::kBFloat16: return linear_int8_inputs<bf16>(p);
      case DType::kFloat16: return linear_int8_inputs<f16>(p);
      default: OCTAVO_CHECK(false, "linear: unsupported dtype " << dtype_name(p.dtype));
    }
  }
#if defined(__AMX_BF16__)
  if (tiles::takes_packed(p)) return p.rows < tiles::kPackedFromRows ? tiles::gemv_packed(p) : tiles::linear(p);
  if (p.rows >= kAmxFromRows && tiles::takes(p)) return tiles::linear(p);
  if (int8_bf16_tiles::takes(p)) return int8_bf16_tiles::linear(p);
#endif
  if (panels::takes(p)) return run_panels(p);
  switch (p.dtype) {
    case DType::kFloat32: return run_typed<float>(p);
    case DType::kBFloat16: return run_typed<bf16>(p);
    case DType::kFloat16: return run_typed<f16>(p);
    default: OCTAVO_CHECK(false, "linear: unsupported dtype " << dtype_name(p.dtype));
  }
}

// Whether linear multiplies p's quantized weight by bfloat16 inputs as they are (int8 on AMX bf16
// tiles), rather than decoding it to float32: callers that could dequantize it to bfloat16 first
// (fused_moe) then need not.
#if defined(__AMX_BF16__)
bool linear_keeps_bf16(const LinearParams& p) { return int8_bf16_tiles::takes(p); }
#else
bool linear_keeps_bf16(const LinearParams&) { return false; }
#endif

void dequantize(const LinearParams& p) {
  dispatch_rows(p, [&](auto* rows) { dequantize_typed<std::remove_pointer_t<decltype(rows)>>(p); });
}

}  // namespace octavo::cpu::OCTAVO_ISA
