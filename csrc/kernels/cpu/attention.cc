// paged_attention on the CPU: FlashAttention-style online softmax over the paged KV cache for a
// flat batch that mixes prefill chunks and decodes.
//
// Work is cut into jobs: the query rows of a few consecutive tokens of one sequence times the G
// query heads of one KV head (so each K/V vector read serves all rows), against a range of key
// positions. When the batch has too few tiles to keep every thread busy (a single long decode),
// a tile's keys are split across jobs (flash-decoding) and the partial softmax states are merged
// afterwards. Keys are visited one cache block at a time: scores S = Q K^T for the block, the
// causal / sliding-window mask, the running max and sum, then acc += P V. On the amx level,
// prefill jobs of bfloat16 queries over bfloat16 caches compute S and P V on AMX tiles, 64 keys
// at a time (attention_amx.h). The caches may hold another float dtype than the query (an engine's
// kv_cache_dtype: a float32 model over a float16 cache streams half the bytes): K and V are read as
// float32, so the arithmetic is the query's float32 (or bf16 x bf16 for two bfloat16s). An fp8
// cache's scales come in as factors: k_scale of the softmax scale, v_scale of the output, each
// times 256, since its values are read as 2^-8 times themselves (vec.h's fp8_256: float16 bits;
// the same bits of result, as powers of two cancel exactly).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "isa_kernels.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "vec.h"
#if defined(__AMX_BF16__)
#include "attention_amx.h"
#endif

namespace octavo::cpu::OCTAVO_ISA {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTileRows = 64;        // query rows (tokens x heads) per prefill tile
constexpr int64_t kTransposeRows = 16;   // from this many rows, S is computed from a transposed K block
// Shortest key range worth a job of its own. A decode's K and V come from memory (a step's
// weights pushed them out of cache), so even short contexts read faster split over the threads:
// one decode over 200 keys took 47 us on one thread, 31 us split (SmolLM2's 9 / 3 heads, 2 threads).
constexpr int64_t kMinSplitKeys = 32;
constexpr int64_t kJobsPerThread = 4;    // jobs wanted per thread before keys get split
constexpr int64_t kPrefetchBlocks = 1;   // how many cache blocks ahead decodes prefetch
// On the amx level, bf16 jobs of this many rows per head run on tiles (attention_amx.h): prefill
// 1.6-4x the vector path's speed at 64-1024 tokens; decodes (rows = the query group) on tiles
// took 1.05-1.5x the vector path's time (bench/python/bench_attention.py --levels).
constexpr int64_t kTileFromRows = kTransposeRows;

// The query rows of tokens [q_begin, q_end) of one sequence's chunk, for the G heads of each of
// KV heads [kv_head, kv_head + num_kv_heads), against keys at positions [k_begin, k_end).
// Decode jobs take every KV head: a block's tiles of all heads are one contiguous stretch of the
// cache, read front to back.
struct Job {
  int32_t seq, kv_head, q_begin, q_end, k_begin, k_end;
  int32_t part;         // -1: covers every key its rows see (writes out); else the partial-state
                        // slot of its first head
  int32_t num_kv_heads = 1;
  int32_t part_stride = 0;  // slots between the partial states of consecutive heads
};

// A tile whose keys were split over `num_parts` jobs with consecutive partial slots.
struct SplitTile {
  int32_t seq, kv_head, q_begin, q_end, first_part, num_parts;
};

struct Geometry {
  int64_t group;        // query heads per KV head
  int64_t head_size;
  int64_t block_size;
  int64_t padded_block; // block_size rounded up to whole vectors
  int64_t max_rows;     // rows of the largest tile
  int64_t part_floats;  // floats of one partial state: max_rows * (head_size + 2)
};

// Decodes stream K and V from DRAM one block at a time, and hardware prefetchers stop at page
// boundaries, so while key j of a block is scored we ask for row j of the next block's K and V:
// the requests are spread over the block's work instead of queueing up at once.
struct Prefetch {
  const char* k = nullptr;  // next block's keys, or null on the last block
  const char* v = nullptr;
  int64_t row_bytes = 0;

  void row(int64_t j) const {
    if (!k) return;
    for (int64_t i = j * row_bytes; i < (j + 1) * row_bytes; i += 64) {
      __builtin_prefetch(k + i);
      __builtin_prefetch(v + i);
    }
  }
};

// ---- per-block math; N rows at a time so a K or V vector is loaded once for N rows ----------

// s[i * ld] = dot(q row i, k row): N rows of S for one key.
template <int N, typename T>
inline void dot_rows(const float* q, int64_t d, const T* krow, float* s, int64_t ld) {
  VecF a[N];
  for (int i = 0; i < N; ++i) a[i] = VecF::zero();
  for (int64_t c = 0; c < d; c += kW) {
    const VecF k = VecF::load(krow + c);
    for (int i = 0; i < N; ++i) a[i] = fma(VecF::load(q + i * d + c), k, a[i]);
  }
  for (int i = 0; i < N; ++i) s[i * ld] = reduce_add(a[i]);
}

#if defined(__AVX512F__)
// Lane i of the result = the sum of a[i]'s 16 lanes, i < 8: pairs, then quads, are added within
// 128-bit lanes, then the 128-bit lanes (24 instructions where eight reduce_adds take about 70).
inline __m256 reduce8(const __m512 a[8]) {
  __m512 b[4], c[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] of a[2i], a[2i + 1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit lane: one partial sum of each of a[4i .. 4i + 3]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 e = _mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(2, 3, 0, 1)));  // lanes 0, 2: totals
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm512_castps512_ps128(e)), _mm512_extractf32x4_ps(e, 2), 1);
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// The same for bfloat16 query and keys with vdpbf16ps: 32 products per instruction, summed in
// pairs into float32, with no conversion of the keys. q holds the raw (unscaled) query rows.
template <int N>
inline void dot_rows_bf16(const bf16* q, int64_t d, const bf16* krow, float scale, float* s, int64_t ld) {
  __m512 a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(krow + c);
    for (int i = 0; i < N; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(q + i * d + c), k);
  }
  for (int i = 0; i < N; ++i) s[i * ld] = _mm512_reduce_add_ps(a[i]) * scale;
}

// s[i * ld + j0 .. + 8) = scale * dot(q row i, key j) for N rows and 8 keys [j0, j0 + 8): the
// query rows stay in registers and each sum is reduced once per 8 keys (decode scores).
template <int N>
inline void dot_8_keys_bf16(const bf16* q, int64_t d, const bf16* kblk, int64_t j0, float scale, float* s,
                            int64_t ld) {
  __m512 acc[N][8];
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < 8; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512bh qv[N];
    for (int i = 0; i < N; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q + i * d + c);
    for (int j = 0; j < 8; ++j) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kblk + (j0 + j) * d + c);
      for (int i = 0; i < N; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv[i], k);
    }
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(s + i * ld + j0, _mm256_mul_ps(reduce8(acc[i]), _mm256_set1_ps(scale)));
}
#else
constexpr bool kBf16Dot = false;
template <int N>
inline void dot_rows_bf16(const bf16*, int64_t, const bf16*, float, float*, int64_t) {}
template <int N>
inline void dot_8_keys_bf16(const bf16*, int64_t, const bf16*, int64_t, float, float*, int64_t) {}
#endif

#if defined(__AVX512F__)
constexpr bool kFloat8Keys = true;
// The same for float32 query rows (already scaled) and keys of any float type (read as float32)
// with vfmadd: a decode's scores cost 4 multiply-adds per row and key of 64 plus a share of one
// reduce8, where dot_rows reduced each sum on its own (SmolLM2's 64 decodes of 190 keys: see
// bench/RESULTS.md).
template <int N, typename T>
inline void dot_8_keys(const float* q, int64_t d, const T* kblk, int64_t j0, float* s, int64_t ld) {
  __m512 acc[N][8];
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < 8; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    __m512 qv[N];
    for (int i = 0; i < N; ++i) qv[i] = _mm512_loadu_ps(q + i * d + c);
    for (int j = 0; j < 8; ++j) {
      const __m512 k = VecF::load(kblk + (j0 + j) * d + c).v;
      for (int i = 0; i < N; ++i) acc[i][j] = _mm512_fmadd_ps(qv[i], k, acc[i][j]);
    }
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(s + i * ld + j0, reduce8(acc[i]));
}
#else
constexpr bool kFloat8Keys = false;
template <int N, typename T>
inline void dot_8_keys(const float*, int64_t, const T*, int64_t, float*, int64_t) {}
#endif

// With bf16 query and keys and vdpbf16ps (or a float32 query on AVX-512), 8 keys at a time in
// every 8-key group of the block that holds a key of [j0, j1) (the others' scores are masked
// later; every row of a cache block is readable). Rows three at a time: 24 accumulators of 32 registers.
template <typename T>
inline void scores_by_8_keys(const float* q, const bf16* qb, float scale, int64_t rows, const Geometry& g,
                             const T* kblk, int64_t j0, int64_t j1, const Prefetch& next, float* s) {
  const int64_t d = g.head_size, ld = g.padded_block;
  const auto dots = [&](auto n, int64_t r, int64_t k0) {
    constexpr int N = decltype(n)::value;
    if constexpr (std::is_same<T, bf16>::value) {
      if (qb) return dot_8_keys_bf16<N>(qb + r * d, d, kblk, k0, scale, s + r * ld, ld);
    }
    dot_8_keys<N>(q + r * d, d, kblk, k0, s + r * ld, ld);
  };
  for (int64_t k0 = j0 / 8 * 8; k0 < j1; k0 += 8) {
    for (int64_t j = k0; j < k0 + 8; ++j) next.row(j);
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) dots(std::integral_constant<int, 3>{}, r, k0);
    if (rows - r == 2) dots(std::integral_constant<int, 2>{}, r, k0);
    if (rows - r == 1) dots(std::integral_constant<int, 1>{}, r, k0);
  }
}

// Few rows (decodes): one dot product per row and key straight from the cache. With `qb`
// (bfloat16 keys on the avx512_bf16 and amx levels), the bf16 dot products of 8 keys at a time.
template <typename T>
void scores_by_rows(const float* q, const bf16* qb, float scale, int64_t rows, const Geometry& g, const T* kblk,
                    int64_t j0, int64_t j1, const Prefetch& next, float* s) {
  const int64_t d = g.head_size, ld = g.padded_block;
  if constexpr (std::is_same<T, bf16>::value) {
    if (qb && g.block_size % 8 == 0) return scores_by_8_keys(q, qb, scale, rows, g, kblk, j0, j1, next, s);
  }
  if (kFloat8Keys && g.block_size % 8 == 0 && d % 16 == 0)
    return scores_by_8_keys(q, static_cast<const bf16*>(nullptr), scale, rows, g, kblk, j0, j1, next, s);
  for (int64_t j = j0; j < j1; ++j) {
    next.row(j);
    const T* krow = kblk + j * d;
    if constexpr (std::is_same<T, bf16>::value) {
      if (qb) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) dot_rows_bf16<4>(qb + r * d, d, krow, scale, s + r * ld + j, ld);
        for (; r < rows; ++r) dot_rows_bf16<1>(qb + r * d, d, krow, scale, s + r * ld + j, ld);
        continue;
      }
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dot_rows<4>(q + r * d, d, krow, s + r * ld + j, ld);
    switch (rows - r) {
      case 3: dot_rows<3>(q + r * d, d, krow, s + r * ld + j, ld); break;
      case 2: dot_rows<2>(q + r * d, d, krow, s + r * ld + j, ld); break;
      case 1: dot_rows<1>(q + r * d, d, krow, s + r * ld + j, ld); break;
      default: break;
    }
  }
}

// kt[c * ld + j] = k[j][c] as float for the valid keys, 0 for the others.
template <typename T>
void transpose_keys(const T* kblk, const Geometry& g, int64_t j0, int64_t j1, float* kt) {
  const int64_t d = g.head_size, ld = g.padded_block;
  for (int64_t c = 0; c < d; ++c) {
    float* row = kt + c * ld;
    for (int64_t j = 0; j < ld; ++j) row[j] = (j >= j0 && j < j1) ? to_float(kblk[j * d + c]) : 0.0f;
  }
}

// N rows of S for a whole block: broadcast q[i][c] against a vector of keys' c-th components.
template <int N>
inline void dot_rows_transposed(const float* q, int64_t d, const float* kt, int64_t ld, float* s) {
  for (int64_t jc = 0; jc < ld; jc += kW) {
    VecF a[N];
    for (int i = 0; i < N; ++i) a[i] = VecF::zero();
    for (int64_t c = 0; c < d; ++c) {
      const VecF k = VecF::load(kt + c * ld + jc);
      for (int i = 0; i < N; ++i) a[i] = fma(VecF::set1(q[i * d + c]), k, a[i]);
    }
    for (int i = 0; i < N; ++i) a[i].store(s + i * ld + jc);
  }
}

// Many rows (prefill): the block's keys are transposed once and shared by every row.
void scores_transposed(const float* q, int64_t rows, const Geometry& g, const float* kt, float* s) {
  const int64_t d = g.head_size, ld = g.padded_block;
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) dot_rows_transposed<8>(q + r * d, d, kt, ld, s + r * ld);
  for (; r < rows; ++r) dot_rows_transposed<1>(q + r * d, d, kt, ld, s + r * ld);
}

// Accumulators the whole-row form of pv_rows may hold in registers (of 32 on AVX-512, 16 below).
constexpr int kValueAccumulators = kW == 16 ? 24 : 12;

// pv_rows for rows of C vectors: every accumulator of the N rows stays in a register across the
// keys, so the multiply-adds of one key are independent (keys innermost, each row's chain of
// multiply-adds waited on the last one's latency: a fifth of a 64-decode step's attention). The
// same multiply-adds in the same order per element as the chunked form.
template <int N, int C, typename T>
inline void pv_whole_rows(const float* p, int64_t ld, const T* vblk, int64_t j0, int64_t j1, float* acc) {
  constexpr int64_t d = int64_t{C} * kW;
  VecF a[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = VecF::load(acc + i * d + c * kW);
  for (int64_t j = j0; j < j1; ++j) {
    for (int c = 0; c < C; ++c) {
      const VecF v = VecF::load(vblk + j * d + c * kW);
      for (int i = 0; i < N; ++i) a[i][c] = fma(VecF::set1(p[i * ld + j]), v, a[i][c]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) a[i][c].store(acc + i * d + c * kW);
}

// acc[i] += sum_j p[i][j] * v[j] for N rows.
template <int N, typename T>
inline void pv_rows(const float* p, int64_t ld, const T* vblk, int64_t j0, int64_t j1, int64_t d, float* acc) {
  if constexpr (N * (64 / kW) <= kValueAccumulators) {
    if (d == 64) return pv_whole_rows<N, 64 / kW>(p, ld, vblk, j0, j1, acc);
  }
  if constexpr (N * (128 / kW) <= kValueAccumulators) {
    if (d == 128) return pv_whole_rows<N, 128 / kW>(p, ld, vblk, j0, j1, acc);
  }
  for (int64_t c = 0; c < d; c += kW) {
    VecF a[N];
    for (int i = 0; i < N; ++i) a[i] = VecF::load(acc + i * d + c);
    for (int64_t j = j0; j < j1; ++j) {
      const VecF v = VecF::load(vblk + j * d + c);
      for (int i = 0; i < N; ++i) a[i] = fma(VecF::set1(p[i * ld + j]), v, a[i]);
    }
    for (int i = 0; i < N; ++i) a[i].store(acc + i * d + c);
  }
}

template <typename T>
void accumulate_values(const float* p, int64_t rows, const Geometry& g, const T* vblk, int64_t j0, int64_t j1,
                       float* acc) {
  const int64_t d = g.head_size, ld = g.padded_block;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<4>(p + r * ld, ld, vblk, j0, j1, d, acc + r * d);
  switch (rows - r) {
    case 3: pv_rows<3>(p + r * ld, ld, vblk, j0, j1, d, acc + r * d); break;
    case 2: pv_rows<2>(p + r * ld, ld, vblk, j0, j1, d, acc + r * d); break;
    case 1: pv_rows<1>(p + r * ld, ld, vblk, j0, j1, d, acc + r * d); break;
    default: break;
  }
}

template <typename T>
void to_float_rows(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) VecF::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// ---- one job -------------------------------------------------------------------------------

struct JobScratch {
  float *q, *acc, *s, *m, *l, *kt, *vf;
  bf16* qb;        // raw query rows, for the bf16 dot products
  bf16* pb;        // probabilities as bf16 (the AMX path)
  uint8_t* tiles;  // a block's keys and values as tiles (the AMX path)
};

// acc, s, qb and pb hold `rows` rounded up to whole 16-row tiles, and s rows of at least 64
// scores: the AMX path reads and writes whole tiles (its pad rows are zeros or ignored) and scores
// a chunk of 64 keys at a time.
constexpr int64_t kChunkKeys = 64;

JobScratch job_scratch(const Geometry& g, int64_t rows) {
  const int64_t d = g.head_size, rows16 = (rows + 15) / 16 * 16;
  const int64_t ld = std::max(g.padded_block, kChunkKeys);
  const int64_t tile_bytes = 2 * kChunkKeys * d * 2;  // a chunk's keys and values, as tiles
  const int64_t floats = rows * d + rows16 * d + rows16 * ld + 2 * rows + d * g.padded_block + g.block_size * d +
                         rows16 * d / 2 + rows16 * ld / 2 + tile_bytes / 4;
  JobScratch js;
  js.q = static_cast<float*>(thread_scratch(0, sizeof(float) * floats));
  js.acc = js.q + rows * d;
  js.s = js.acc + rows16 * d;
  js.m = js.s + rows16 * ld;
  js.l = js.m + rows;
  js.kt = js.l + rows;
  js.vf = js.kt + d * g.padded_block;
  js.qb = reinterpret_cast<bf16*>(js.vf + g.block_size * d);
  js.pb = js.qb + rows16 * d;
  js.tiles = reinterpret_cast<uint8_t*>(js.pb + rows16 * ld);
  return js;
}

// Position of the first query token of sequence b's chunk.
inline int64_t first_query_position(const PagedAttentionParams& p, int64_t b) {
  return p.seq_lens[b] - (p.query_start_loc[b + 1] - p.query_start_loc[b]);
}

// Query rows as float, pre-multiplied by the softmax scale; row r = token r / G, head r % G.
template <typename Q>
void load_queries(const PagedAttentionParams& p, const Geometry& g, const Job& job, float* q) {
  const Q* query = static_cast<const Q*>(p.query);
  const int64_t d = g.head_size;
  const VecF scale = VecF::set1(p.scale);
  for (int64_t t = job.q_begin; t < job.q_end; ++t) {
    const int64_t token = p.query_start_loc[job.seq] + t;
    for (int64_t h = 0; h < g.group; ++h) {
      const Q* src = query + token * p.query_stride + (job.kv_head * g.group + h) * d;
      float* dst = q + ((t - job.q_begin) * g.group + h) * d;
      for (int64_t c = 0; c < d; c += kW) (VecF::load(src + c) * scale).store(dst + c);
    }
  }
}

// Max of a fully visible row (the common case: every key of the block is in range).
inline float row_max(const float* s, int64_t ld) {
  VecF m = VecF::load(s);
  for (int64_t j = kW; j < ld; j += kW) m = max(m, VecF::load(s + j));
  return reduce_max(m);
}

// Soft-caps the visible scores [lo, hi), sets the others to -inf, and returns the max.
inline float mask_row(const PagedAttentionParams& p, float* s, int64_t ld, int64_t lo, int64_t hi) {
  float block_max = kNegInf;
  for (int64_t j = 0; j < ld; ++j) {
    if (j < lo || j >= hi) {
      s[j] = kNegInf;
      continue;
    }
    if (p.softcap > 0) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
    block_max = std::max(block_max, s[j]);
  }
  return block_max;
}

// Query rows as they are (bfloat16, unscaled), in the row order of load_queries.
inline void copy_query_rows(const PagedAttentionParams& p, const Geometry& g, const Job& job, bf16* qb) {
  const bf16* query = static_cast<const bf16*>(p.query);
  const int64_t d = g.head_size;
  for (int64_t t = job.q_begin; t < job.q_end; ++t) {
    const int64_t token = p.query_start_loc[job.seq] + t;
    const bf16* src = query + token * p.query_stride + job.kv_head * g.group * d;
    std::copy(src, src + g.group * d, qb + (t - job.q_begin) * g.group * d);
  }
}

// Masks row r's scores to the keys it may see, folds them into the running max / sum, turns them
// into probabilities (in place) and rescales the row's accumulator.
void online_softmax(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t kbase, int64_t j0,
                    int64_t j1, int64_t rows, const JobScratch& js) {
  const int64_t ld = g.padded_block, d = g.head_size;
  const int64_t pos0 = first_query_position(p, job.seq) + job.q_begin;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = js.s + r * ld;
    const int64_t pos = pos0 + r / g.group;
    const int64_t lo_pos = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
    const int64_t lo = std::max(lo_pos - kbase, j0), hi = std::min(pos - kbase + 1, j1);  // [lo, hi)
    const float block_max = (lo == 0 && hi == ld && p.softcap == 0) ? row_max(s, ld) : mask_row(p, s, ld, lo, hi);
    if (block_max == kNegInf) {
      for (int64_t j = 0; j < ld; ++j) s[j] = 0.0f;
      continue;
    }
    const float m_new = std::max(js.m[r], block_max);
    const float correction = std::exp(js.m[r] - m_new);  // 0 on the row's first block
    const VecF shift = VecF::set1(m_new);
    VecF sum = VecF::zero();
    for (int64_t j = 0; j < ld; j += kW) {
      const VecF e = exp(VecF::load(s + j) - shift);
      e.store(s + j);
      sum = sum + e;
    }
    js.l[r] = js.l[r] * correction + reduce_add(sum);
    js.m[r] = m_new;
    if (correction != 1.0f) {
      const VecF c = VecF::set1(correction);
      float* acc = js.acc + r * d;
      for (int64_t k = 0; k < d; k += kW) (VecF::load(acc + k) * c).store(acc + k);
    }
  }
}

// Element offset of (block, kv_head) in either cache.
inline int64_t block_offset(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t kblock) {
  const int32_t* table = p.block_tables + job.seq * p.block_table_stride;
  return (static_cast<int64_t>(table[kblock]) * p.num_kv_heads + job.kv_head) * g.block_size * g.head_size;
}

// Whether the bf16 dot products (vdpbf16ps) score the keys: bfloat16 queries and caches.
template <typename Q, typename T>
constexpr bool bf16_dots() {
  return kBf16Dot && std::is_same<Q, bf16>::value && std::is_same<T, bf16>::value;
}

// Whether a job runs on AMX tiles (attention_amx.h): prefill rows of bfloat16 queries and caches.
template <typename Q, typename T>
bool tile_job(const Geometry& g, int64_t rows) {
#if defined(__AMX_BF16__)
  return bf16_dots<Q, T>() && rows >= kTileFromRows && attention_tiles::takes(rows, g.block_size, g.head_size);
#else
  (void)g, (void)rows;
  return false;
#endif
}

// One cache block of keys [kbase + j0, kbase + j1) for every row of the job.
// An fp8 cache's block whose keys [j0, j1) hold no NaN code takes fp8_256_finite's cheaper loads.
template <typename Q, typename T>
void attend_block(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t kblock, int64_t j0,
                  int64_t j1, int64_t rows, const Prefetch& next, const JobScratch& js) {
  const int64_t offset = block_offset(p, g, job, kblock);
  const T* kblk = static_cast<const T*>(p.key_cache) + offset;
  const T* vblk = static_cast<const T*>(p.value_cache) + offset;
  if constexpr (std::is_same<T, fp8_256>::value) {
    const int64_t first = j0 * g.head_size, n = (j1 - j0) * g.head_size;
    if (!holds_nan_code(&kblk[first].bits, n) && !holds_nan_code(&vblk[first].bits, n))
      return attend_block<Q, fp8_256_finite>(p, g, job, kblock, j0, j1, rows, next, js);
  }
  if (rows >= kTransposeRows) {
    transpose_keys(kblk, g, j0, j1, js.kt);
    scores_transposed(js.q, rows, g, js.kt, js.s);
  } else {
    const bool bf16_dot = bf16_dots<Q, T>() && g.head_size % 32 == 0;
    scores_by_rows(js.q, bf16_dot ? js.qb : nullptr, p.scale, rows, g, kblk, j0, j1, next, js.s);
  }
  online_softmax(p, g, job, kblock * g.block_size, j0, j1, rows, js);
  if (rows > 4 && !std::is_same<T, float>::value) {
    // Many rows re-read each value vector: convert the block to float once.
    to_float_rows(vblk + j0 * g.head_size, (j1 - j0) * g.head_size, js.vf + j0 * g.head_size);
    accumulate_values(js.s, rows, g, static_cast<const float*>(js.vf), j0, j1, js.acc);
  } else {
    accumulate_values(js.s, rows, g, vblk, j0, j1, js.acc);
  }
}

template <typename Q>
void write_output(const PagedAttentionParams& p, const Geometry& g, const Job& job, const float* acc,
                  const float* l) {
  Q* out = static_cast<Q*>(p.out);
  const int64_t d = g.head_size;
  for (int64_t t = job.q_begin; t < job.q_end; ++t) {
    const int64_t token = p.query_start_loc[job.seq] + t;
    for (int64_t h = 0; h < g.group; ++h) {
      const int64_t r = (t - job.q_begin) * g.group + h;
      const VecF inv = VecF::set1(p.v_scale / l[r]);
      Q* dst = out + token * p.out_stride + (job.kv_head * g.group + h) * d;
      for (int64_t c = 0; c < d; c += kW) (VecF::load(acc + r * d + c) * inv).store(dst + c);
    }
  }
}

// Partial state layout: m[max_rows], l[max_rows], acc[max_rows][head_size].
void save_partial(const Geometry& g, int64_t rows, const JobScratch& js, float* part) {
  std::copy(js.m, js.m + rows, part);
  std::copy(js.l, js.l + rows, part + g.max_rows);
  std::copy(js.acc, js.acc + rows * g.head_size, part + 2 * g.max_rows);
}

// Head h's share of a job's scratch (rows per head each); the per-block temporaries are shared.
JobScratch head_scratch(const JobScratch& all, const Geometry& g, int64_t rows, int64_t h) {
  JobScratch js = all;
  js.q += h * rows * g.head_size;
  js.acc += h * rows * g.head_size;
  js.s += h * rows * g.padded_block;
  js.m += h * rows;
  js.l += h * rows;
  js.qb += h * rows * g.head_size;
  return js;
}

// The job restricted to its h-th KV head.
Job head_job(const Job& job, int64_t h) {
  Job one = job;
  one.kv_head = static_cast<int32_t>(job.kv_head + h);
  one.num_kv_heads = 1;
  one.part = job.part < 0 ? -1 : static_cast<int32_t>(job.part + h * job.part_stride);
  return one;
}

// On tiles (`tiles`) only the bfloat16 query copy is read, its rows padded to a whole tile with zeros.
template <typename Q, typename T>
void start_head(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t rows, const JobScratch& js,
                bool tiles = false) {
  if (!tiles) load_queries<Q>(p, g, job, js.q);
  if constexpr (bf16_dots<Q, T>()) copy_query_rows(p, g, job, js.qb);
  if (tiles) std::fill(js.qb + rows * g.head_size, js.qb + (rows + 15) / 16 * 16 * g.head_size, bf16{});
  std::fill(js.m, js.m + rows, kNegInf);
  std::fill(js.l, js.l + rows, 0.0f);
  std::fill(js.acc, js.acc + rows * g.head_size, 0.0f);
}

// Where the prefetches for block kb go while head `job.kv_head` works on an earlier block.
template <typename T>
Prefetch prefetch_for(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t kb, int64_t last) {
  Prefetch next;
  next.row_bytes = g.head_size * static_cast<int64_t>(sizeof(T));
  if (kb <= last) {
    const int64_t offset = block_offset(p, g, job, kb);
    next.k = reinterpret_cast<const char*>(static_cast<const T*>(p.key_cache) + offset);
    next.v = reinterpret_cast<const char*>(static_cast<const T*>(p.value_cache) + offset);
  }
  return next;
}

#if defined(__AMX_BF16__)
// A one-head job's keys on AMX tiles, a chunk of up to four cache blocks at a time: the online
// softmax then sees rows of 64 scores (positions kbase.. of the chunk) instead of 16.
void run_tile_job(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t rows,
                  const JobScratch& js) {
  namespace at = attention_tiles;
  static_assert(at::kChunkKeys == kChunkKeys, "job_scratch sizes score rows for the tiles' chunk");
  const int64_t d = g.head_size;
  Geometry chunk = g;
  chunk.padded_block = at::kChunkKeys;  // online_softmax's score row stride and mask range
  uint8_t* keys = js.tiles;
  uint8_t* values = js.tiles + at::key_bytes(d);
  const bf16* key_cache = static_cast<const bf16*>(p.key_cache);
  const bf16* value_cache = static_cast<const bf16*>(p.value_cache);
  const int64_t last_block = (job.k_end - 1) / g.block_size;
  at::begin();
  for (int64_t kb = job.k_begin / g.block_size; kb <= last_block; kb += at::kChunkBlocks) {
    const int64_t blocks = std::min<int64_t>(at::kChunkBlocks, last_block - kb + 1);
    const int64_t kbase = kb * g.block_size;
    const int64_t j0 = std::max<int64_t>(job.k_begin - kbase, 0);
    const int64_t j1 = std::min<int64_t>(job.k_end - kbase, blocks * g.block_size);
    for (int64_t b = 0; b < (blocks + 1) / 2 * 2; ++b) {  // value tiles hold blocks in pairs
      const int64_t offset = b < blocks ? block_offset(p, g, job, kb + b) : 0;
      if (b < blocks) at::pack_keys(key_cache + offset, b, d, keys);
      at::pack_values(b < blocks ? value_cache + offset : nullptr, b, d, j0 - b * g.block_size,
                      j1 - b * g.block_size, values);
    }
    at::scores(js.qb, rows, d, keys, blocks, p.scale, js.s);
    online_softmax(p, chunk, job, kbase, j0, j1, rows, js);
    at::values(js.s, rows, values, blocks, d, js.pb, js.acc);
  }
  at::end();
}
#endif

template <typename Q>
void finish_head(const PagedAttentionParams& p, const Geometry& g, const Job& one, int64_t rows, const JobScratch& js,
                 float* partials) {
  if (one.part < 0) write_output<Q>(p, g, one, js.acc, js.l);
  else save_partial(g, rows, js, partials + one.part * g.part_floats);
}

// On AMX tiles the heads of a job run one after the other, each with the whole scratch (its
// query rows padded to a tile).
template <typename Q, typename T>
void run_tile_heads(const PagedAttentionParams& p, const Geometry& g, const Job& job, int64_t rows, float* partials) {
#if defined(__AMX_BF16__)
  for (int64_t h = 0; h < job.num_kv_heads; ++h) {
    const Job one = head_job(job, h);
    const JobScratch js = job_scratch(g, rows);
    start_head<Q, T>(p, g, one, rows, js, /*tiles=*/true);
    run_tile_job(p, g, one, rows, js);
    finish_head<Q>(p, g, one, rows, js, partials);
  }
#else
  (void)p, (void)g, (void)job, (void)rows, (void)partials;
#endif
}

template <typename Q, typename T>
void run_job(const PagedAttentionParams& p, const Geometry& g, const Job& job, float* partials) {
  const int64_t rows = (job.q_end - job.q_begin) * g.group;  // per KV head
  if (tile_job<Q, T>(g, rows)) return run_tile_heads<Q, T>(p, g, job, rows, partials);
  const JobScratch all = job_scratch(g, rows * job.num_kv_heads);
  for (int64_t h = 0; h < job.num_kv_heads; ++h)
    start_head<Q, T>(p, g, head_job(job, h), rows, head_scratch(all, g, rows, h));
  const int64_t last_block = (job.k_end - 1) / g.block_size;
  for (int64_t kb = job.k_begin / g.block_size; kb <= last_block; ++kb) {
    const int64_t kbase = kb * g.block_size;
    const int64_t j0 = std::max<int64_t>(job.k_begin - kbase, 0);
    const int64_t j1 = std::min<int64_t>(job.k_end - kbase, g.block_size);
    for (int64_t h = 0; h < job.num_kv_heads; ++h) {
      const Job one = head_job(job, h);
      const Prefetch next = prefetch_for<T>(p, g, one, kb + kPrefetchBlocks, last_block);
      attend_block<Q, T>(p, g, one, kb, j0, j1, rows, next, head_scratch(all, g, rows, h));
    }
  }
  for (int64_t h = 0; h < job.num_kv_heads; ++h)
    finish_head<Q>(p, g, head_job(job, h), rows, head_scratch(all, g, rows, h), partials);
}

// Combines the partial states of a split tile: weights exp(m_s - M) put them on one scale.
template <typename Q>
void merge_tile(const PagedAttentionParams& p, const Geometry& g, const SplitTile& tile, const float* partials) {
  const int64_t rows = (tile.q_end - tile.q_begin) * g.group, d = g.head_size;
  JobScratch js = job_scratch(g, rows);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (int32_t s = 0; s < tile.num_parts; ++s) m = std::max(m, partials[(tile.first_part + s) * g.part_floats + r]);
    float l = 0.0f;
    float* acc = js.acc + r * d;
    std::fill(acc, acc + d, 0.0f);
    for (int32_t s = 0; s < tile.num_parts; ++s) {
      const float* part = partials + (tile.first_part + s) * g.part_floats;
      if (part[r] == kNegInf) continue;  // this split held no key the row may see
      const float w = std::exp(part[r] - m);
      l += w * part[g.max_rows + r];
      const VecF wv = VecF::set1(w);
      const float* src = part + 2 * g.max_rows + r * d;
      for (int64_t c = 0; c < d; c += kW) fma(wv, VecF::load(src + c), VecF::load(acc + c)).store(acc + c);
    }
    js.l[r] = l;
  }
  const Job whole{tile.seq, tile.kv_head, tile.q_begin, tile.q_end, 0, 0, -1};
  write_output<Q>(p, g, whole, js.acc, js.l);
}

// ---- planning ------------------------------------------------------------------------------

struct Plan {
  Job* jobs;
  int64_t num_jobs;
  SplitTile* splits;
  int64_t num_splits;
  float* partials;
};

// Calls fn(seq, q_begin, q_end, k_begin, k_end) for every tile of the batch (one KV head).
template <typename Fn>
void for_each_tile(const PagedAttentionParams& p, int64_t tokens_per_tile, const Fn& fn) {
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t n_q = p.query_start_loc[b + 1] - p.query_start_loc[b];
    const int64_t pos0 = first_query_position(p, b);
    for (int64_t q0 = 0; q0 < n_q; q0 += tokens_per_tile) {
      const int64_t q1 = std::min(n_q, q0 + tokens_per_tile);
      const int64_t k_end = pos0 + q1;  // the last row's own position + 1
      const int64_t k_begin = p.sliding_window > 0 ? std::max<int64_t>(0, pos0 + q0 - p.sliding_window + 1) : 0;
      fn(b, q0, q1, k_begin, k_end);
    }
  }
}

// Decode-like tiles (few rows per head) become one job over every KV head; larger tiles get a
// job per head.
bool all_heads_in_one_job(const Geometry& g, int64_t q0, int64_t q1) { return (q1 - q0) * g.group < kTransposeRows; }

// Adds the jobs of one tile for KV heads [h, h + heads), its keys split `splits` ways.
void add_tile_jobs(Plan& plan, const Geometry& g, int64_t b, int64_t h, int64_t heads, int64_t q0, int64_t q1,
                   int64_t kb, int64_t ke, int64_t splits, int64_t& num_parts) {
  const auto job = [&](int64_t k_begin, int64_t k_end, int64_t part) {
    Job j{int32_t(b), int32_t(h), int32_t(q0), int32_t(q1), int32_t(k_begin), int32_t(k_end), int32_t(part)};
    j.num_kv_heads = static_cast<int32_t>(heads);
    j.part_stride = static_cast<int32_t>(splits);
    return j;
  };
  if (splits == 1) {
    plan.jobs[plan.num_jobs++] = job(kb, ke, -1);
    return;
  }
  // Split on block boundaries so no two jobs share a cache block. Head i's partial states take
  // slots [first + i * splits, first + (i + 1) * splits).
  const int64_t span = (ke - kb + splits - 1) / splits;
  const int64_t step = (span + g.block_size - 1) / g.block_size * g.block_size;
  const int64_t first = num_parts;
  int64_t used = 0;
  for (int64_t k = kb; k < ke; k += step) plan.jobs[plan.num_jobs++] = job(k, std::min(ke, k + step), first + used++);
  for (int64_t i = 0; i < heads; ++i) {
    plan.splits[plan.num_splits++] = SplitTile{int32_t(b), int32_t(h + i), int32_t(q0), int32_t(q1),
                                               int32_t(first + i * splits), int32_t(used)};
  }
  num_parts += heads * splits;
}

Plan make_plan(const PagedAttentionParams& p, const Geometry& g, int64_t tokens_per_tile) {
  // Units of work before splitting keys: one per decode-like tile, one per head otherwise.
  int64_t units = 0, num_tiles = 0;
  for_each_tile(p, tokens_per_tile, [&](int64_t, int64_t q0, int64_t q1, int64_t, int64_t) {
    units += all_heads_in_one_job(g, q0, q1) ? 1 : p.num_kv_heads;
    ++num_tiles;
  });
  const int64_t wanted = kJobsPerThread * get_num_threads();
  const int64_t split_factor = units >= wanted ? 1 : (wanted + units - 1) / std::max<int64_t>(units, 1);
  const auto splits_of = [&](int64_t kb, int64_t ke) {
    return std::min(split_factor, std::max<int64_t>(1, (ke - kb) / kMinSplitKeys));
  };

  // Upper bounds first, so the arrays come from scratch in one piece each.
  int64_t max_jobs = 0;
  for_each_tile(p, tokens_per_tile, [&](int64_t, int64_t q0, int64_t q1, int64_t kb, int64_t ke) {
    max_jobs += splits_of(kb, ke) * (all_heads_in_one_job(g, q0, q1) ? 1 : p.num_kv_heads);
  });
  Plan plan{};
  plan.jobs = static_cast<Job*>(thread_scratch(1, sizeof(Job) * max_jobs));
  plan.splits = static_cast<SplitTile*>(thread_scratch(2, sizeof(SplitTile) * num_tiles * p.num_kv_heads));
  int64_t num_parts = 0;
  // Heads innermost: threads that take consecutive jobs read neighbouring (block, head) tiles of
  // the same blocks, which keeps DRAM pages open.
  for_each_tile(p, tokens_per_tile, [&](int64_t b, int64_t q0, int64_t q1, int64_t kb, int64_t ke) {
    if (all_heads_in_one_job(g, q0, q1)) {
      add_tile_jobs(plan, g, b, 0, p.num_kv_heads, q0, q1, kb, ke, splits_of(kb, ke), num_parts);
      return;
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) add_tile_jobs(plan, g, b, h, 1, q0, q1, kb, ke, splits_of(kb, ke), num_parts);
  });
  plan.partials = num_parts ? static_cast<float*>(thread_scratch(3, sizeof(float) * num_parts * g.part_floats)) : nullptr;
  return plan;
}

// Q: the query's and out's type; T: the caches'.
template <typename Q, typename T>
void attention(const PagedAttentionParams& params) {
  PagedAttentionParams p = params;
  p.scale *= p.k_scale;  // q . (k_scale k) = k_scale (q . k)
  if constexpr (std::is_same<T, fp8_256>::value) {  // it reads 2^-8 times each value: exact powers of two
    p.scale *= 256.0f;
    p.v_scale *= 256.0f;
  }
  Geometry g{};
  g.group = p.num_heads / p.num_kv_heads;
  g.head_size = p.head_size;
  g.block_size = p.block_size;
  g.padded_block = (p.block_size + kW - 1) / kW * kW;
  const int64_t tokens_per_tile = std::max<int64_t>(1, kTileRows / g.group);
  g.max_rows = tokens_per_tile * g.group;
  g.part_floats = g.max_rows * (g.head_size + 2);
  const Plan plan = make_plan(p, g, tokens_per_tile);
  parallel_for(plan.num_jobs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run_job<Q, T>(p, g, plan.jobs[i], plan.partials);
  });
  parallel_for(plan.num_splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) merge_tile<Q>(p, g, plan.splits[i], plan.partials);
  });
}

template <typename Q>
void attention_on(const PagedAttentionParams& p) {
  switch (p.cache_dtype) {
    case DType::kFloat32: return attention<Q, float>(p);
    case DType::kBFloat16: return attention<Q, bf16>(p);
    case DType::kFloat8E4M3: return attention<Q, fp8_256>(p);
    default: return attention<Q, f16>(p);
  }
}

}  // namespace

void paged_attention(const PagedAttentionParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return attention_on<float>(p);
    case DType::kBFloat16: return attention_on<bf16>(p);
    default: return attention_on<f16>(p);
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
