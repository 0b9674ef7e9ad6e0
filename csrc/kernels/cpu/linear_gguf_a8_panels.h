// linear for GGUF block weights times int8 inputs on batches (from kPanelsFromRows input rows, on
// the levels with AVX512-VNNI), and the entry that picks it or linear_gguf_a8.h's rows kernel;
// included by linear.cc in every ISA level.
//
// The rows kernel converts and scales each (weight row, input row) pair's eight lanes per block of
// 32: three instructions for 32 products, and the block is decoded again for every 4 input rows.
// Here a panel of 32 weight rows is decoded once per call (per chunk of input rows) into bytes in
// vpdpbusd's layout: per block, two groups of 16 rows, and for each of the 8 steps of 4 inputs a
// zmm whose 32-bit lane r holds row r's 4 bytes. One vpdpbusd of that vector against input row
// c's 4 bytes broadcast adds 4 products to each of 16 rows' sums, so a lane is one output's whole
// block sum after 8 steps: one conversion and scaling per 16 rows x 32 products. Each block's
// sums start at -o * (sum of the row's inputs) (o the format's offset; signed formats enter as
// u + 128 with o = 128), so u8 x s8 products give sum (u - o) * a exactly. The formats with a
// scale per half block (Q3_K, Q6_K) convert after each half. On an AMD EPYC (Zen 4 class), 2.2-2.8x
// the float path's speed at 64 and 1024 rows (bench/RESULTS.md); the zmm form was 1.05x the ymm
// one (Zen 4 runs a zmm vpdpbusd at about the rate of a ymm one: the broadcasts and the per-block
// conversions share the vector pipes with it).
//
// The results are those of the inputs rounded as the rows kernel rounds them, up to float32
// rounding of the per-block terms, which are added in another order than there: a row's bits
// do not depend on the rows beside it on either side of kPanelsFromRows, but may differ across it.
#pragma once

#include "linear_gguf_a8.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace gguf_a8 {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define OCTAVO_GGUF_A8_PANELS 1
namespace panels {

constexpr int64_t kPanelsFromRows = 16;
constexpr int kGroupRows = 16;                    // weight rows per group: a 32-bit lane of a zmm each
constexpr int kGroups = 2;                        // groups per panel
constexpr int kPanelRows = kGroupRows * kGroups;  // weight rows per panel
constexpr int kSteps = kBlock / 4;                // vpdpbusd steps of 4 inputs per block
constexpr int kStepBytes = 64;
constexpr int kBlockBytes = kGroups * kSteps * kStepBytes;
constexpr int kInputRows = 4;                      // input rows per pass over a panel
constexpr int64_t kChunkBytes = int64_t{1} << 18;  // rounded input rows kept in L2 across panels
constexpr int64_t kSplitRowsFrom = 128;             // input rows per thread from which threads split rows

// The offset the panels' unsigned bytes carry: signed values enter as u = w + 128.
template <WeightFormat F>
constexpr int offset() {
  return Bytes<F>::kSigned ? 128 : Bytes<F>::kOffset;
}

// A decoded panel: per block, the bytes (groups, steps, 64 bytes) and per weight row the scale of
// the first (or only) half, of the second half, and the signed minimum.
struct Panel {
  uint8_t* q;
  float* first;
  float* second;
  float* minimum;
  static size_t bytes(int64_t blocks) { return static_cast<size_t>(blocks * (kBlockBytes + 3 * kPanelRows * 4)); }
  Panel(void* base, int64_t blocks)
      : q(static_cast<uint8_t*>(base)),
        first(reinterpret_cast<float*>(q + blocks * kBlockBytes)),
        second(first + blocks * kPanelRows),
        minimum(second + blocks * kPanelRows) {}
};

// Rows v[r] of 8 dwords become columns: v[s] lane r = dword s of row r.
OCTAVO_ALWAYS_INLINE void transpose8x8(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);
    t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int s = 0; s < 4; ++s) {
    v[s] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x20);
    v[s + 4] = _mm256_permute2x128_si256(u[s], u[s + 4], 0x31);
  }
}

// The panel rows' scales (and minimums, second halves' scales) per block.
template <WeightFormat F>
void decode_scales(const uint8_t* const (&rows)[kPanelRows], int64_t blocks, const Panel& panel) {
  using B = Bytes<F>;
  if constexpr (gguf::Gguf<F>::kWeights == kBlock) {
    // A block's float16 d and m lead it: one gather per 16 rows and block stores them as the
    // panel holds them (per row, a read_scales and 32 scalar stores per block took a fifth of a
    // 64-row product's time).
    __m512i offsets[2];
    for (int h = 0; h < 2; ++h) {
      alignas(64) int32_t at[16];
      for (int t = 0; t < 16; ++t) at[t] = static_cast<int32_t>(rows[16 * h + t] - rows[0]);
      offsets[h] = _mm512_load_si512(at);
    }
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int h = 0; h < 2; ++h) {
        const __m512i dm = _mm512_i32gather_epi32(offsets[h], rows[0] + blk * gguf::Gguf<F>::kBytes, 1);
        const int64_t at = blk * kPanelRows + 16 * h;
        _mm512_storeu_ps(panel.first + at, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
        if constexpr (B::kMin != 0) {
          const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
          _mm512_storeu_ps(panel.minimum + at, B::kMin > 0 ? m : _mm512_sub_ps(_mm512_setzero_ps(), m));
        }
      }
    }
  } else {
    for (int t = 0; t < kPanelRows; ++t) {
      for (int64_t first = 0; first < blocks; first += kScaleBatch) {
        const int count = static_cast<int>(std::min<int64_t>(kScaleBatch, blocks - first));
        alignas(64) float s[kScaleBatch], m[kScaleBatch];
        gguf::read_scales<F>(rows[t], first, count, s, m);
        for (int k = 0; k < count; ++k) {
          const int64_t at = (first + k) * kPanelRows + t;
          panel.first[at] = s[k];
          if constexpr (B::kHalves) panel.second[at] = m[k];
          if constexpr (B::kMin != 0) panel.minimum[at] = B::kMin > 0 ? m[k] : -m[k];
        }
      }
    }
  }
}

// Weight rows n.. n + nr - 1 into the panel (rows past them repeat row n; their results are dropped).
template <WeightFormat F>
void decode_panel(const LinearParams& p, int64_t n, int nr, int64_t blocks, const Panel& panel) {
  using B = Bytes<F>;
  using Format = gguf::Gguf<F>;
  constexpr int kSub = Format::kWeights / kBlock;
  const int64_t row_bytes = p.in_features / Format::kWeights * Format::kBytes;
  const uint8_t* rows[kPanelRows];
  for (int t = 0; t < kPanelRows; ++t)
    rows[t] = static_cast<const uint8_t*>(p.weight) + (n + (t < nr ? t : 0)) * row_bytes;
  decode_scales<F>(rows, blocks, panel);
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int sub = static_cast<int>(blk % kSub);
    for (int g = 0; g < kGroups; ++g) {
      // Each half of the group's rows transposed on its own: lanes 0-7 and 8-15 of each step.
      for (int half = 0; half < 2; ++half) {
        __m256i v[8];
        for (int r = 0; r < 8; ++r) {
          v[r] = B::load(rows[g * kGroupRows + 8 * half + r] + blk / kSub * Format::kBytes, sub);
          if constexpr (B::kSigned) v[r] = _mm256_xor_si256(v[r], sign);
        }
        transpose8x8(v);
        uint8_t* out = panel.q + blk * kBlockBytes + g * kSteps * kStepBytes + 32 * half;
        for (int s = 0; s < kSteps; ++s) _mm256_store_si256(reinterpret_cast<__m256i*>(out + s * kStepBytes), v[s]);
      }
    }
  }
}

// acc[c][g] lane r = weight row 8g + r of the panel against input row i + c, c < C.
template <WeightFormat F, int C>
OCTAVO_ALWAYS_INLINE void multiply(const Panel& panel, const RoundedInputs& r, int64_t i, int64_t K,
                                   __m512 (&acc)[C][kGroups]) {
  using B = Bytes<F>;
  constexpr int kParts = B::kHalves ? 2 : 1;
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < kGroups; ++g) acc[c][g] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < r.blocks; ++blk) {
    const uint8_t* q = panel.q + blk * kBlockBytes;
    for (int part = 0; part < kParts; ++part) {
      __m512i sums[C][kGroups];
      for (int c = 0; c < C; ++c) {
        const __m512i start = _mm512_set1_epi32(r.half_offsets[((i + c) * r.blocks + blk) * 2 + part]);
        for (int g = 0; g < kGroups; ++g) sums[c][g] = start;
      }
      for (int s = part * kSteps / kParts; s < (part + 1) * kSteps / kParts; ++s) {
        __m512i w[kGroups];
        for (int g = 0; g < kGroups; ++g) w[g] = _mm512_load_si512(q + (g * kSteps + s) * kStepBytes);
        for (int c = 0; c < C; ++c) {
          int32_t four;
          std::memcpy(&four, r.a + (i + c) * K + blk * kBlock + 4 * s, 4);
          const __m512i a = _mm512_set1_epi32(four);
          for (int g = 0; g < kGroups; ++g) sums[c][g] = _mm512_dpbusd_epi32(sums[c][g], w[g], a);
        }
      }
      const float* scales = (part == 0 ? panel.first : panel.second) + blk * kPanelRows;
      for (int c = 0; c < C; ++c) {
        const __m512 d = _mm512_set1_ps(r.d[(i + c) * r.padded + blk]);
        for (int g = 0; g < kGroups; ++g) {
          const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scales + g * kGroupRows), d);
          acc[c][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c][g]), s, acc[c][g]);
        }
      }
    }
    if constexpr (B::kMin != 0) {
      for (int c = 0; c < C; ++c) {
        const __m512 dsum = _mm512_set1_ps(r.dsum[(i + c) * r.padded + blk]);
        for (int g = 0; g < kGroups; ++g)
          acc[c][g] = _mm512_fmadd_ps(_mm512_loadu_ps(panel.minimum + blk * kPanelRows + g * kGroupRows), dsum,
                                      acc[c][g]);
      }
    }
  }
}

// Outputs of at least this many bytes are written around the caches (non-temporal stores): an LM
// head's logits (Gemma 3's 64 x 262144 floats are 67 MB a step) are read once, by the sampler,
// long after the cache would have dropped them, and a plain store first reads each line in.
constexpr int64_t kStreamBytes = int64_t{16} << 20;

inline bool streams(const LinearParams& p) {
  return p.rows * p.out_features * 4 >= kStreamBytes && p.bias == nullptr &&
         reinterpret_cast<uintptr_t>(p.out) % 64 == 0 && p.out_stride % 16 == 0;
}

template <typename T, int C>
void store(const LinearParams& p, int64_t i, int64_t n, int nr, const __m512 (&acc)[C][kGroups], bool stream) {
  for (int c = 0; c < C; ++c) {
    if constexpr (std::is_same<T, float>::value) {
      if (stream && nr == kPanelRows) {
        float* out = static_cast<float*>(p.out) + (i + c) * p.out_stride + n;
        for (int g = 0; g < kGroups; ++g) _mm512_stream_ps(out + g * kGroupRows, acc[c][g]);
        continue;
      }
    }
    alignas(64) float y[kPanelRows];
    for (int g = 0; g < kGroups; ++g) _mm512_store_ps(y + g * kGroupRows, acc[c][g]);
    T* out = static_cast<T*>(p.out) + (i + c) * p.out_stride + n;
    const T* bias = p.bias != nullptr ? static_cast<const T*>(p.bias) + n : nullptr;
    for (int t = 0; t < nr; ++t) out[t] = from_float<T>(bias != nullptr ? y[t] + to_float(bias[t]) : y[t]);
  }
}

// Panels [first, last) against input rows [begin, end), each panel decoded once.
template <WeightFormat F, typename T>
void multiply_panels(const LinearParams& p, const RoundedInputs& r, const Panel& panel, int64_t first, int64_t last,
                     int64_t begin, int64_t end) {
  const bool stream = streams(p);
  for (int64_t pn = first; pn < last; ++pn) {
    const int64_t n = pn * kPanelRows;
    const int nr = static_cast<int>(std::min<int64_t>(kPanelRows, p.out_features - n));
    decode_panel<F>(p, n, nr, r.blocks, panel);
    int64_t i = begin;
    for (; i + kInputRows <= end; i += kInputRows) {
      __m512 acc[kInputRows][kGroups];
      multiply<F, kInputRows>(panel, r, i, p.in_features, acc);
      store<T, kInputRows>(p, i, n, nr, acc, stream);
    }
    for (; i < end; ++i) {  // a row's sums do not depend on the rows it runs with
      __m512 acc[1][kGroups];
      multiply<F, 1>(panel, r, i, p.in_features, acc);
      store<T, 1>(p, i, n, nr, acc, stream);
    }
  }
}

// Input rows per chunk kept in L2 while the panels pass over it; each chunk decodes the panels
// again (32 weight rows against at least 64 input rows per decode).
inline int64_t chunk_rows(const LinearParams& p) {
  return std::max<int64_t>(64, kChunkBytes / p.in_features / kInputRows * kInputRows);
}

// Few rows: the threads split the panels, and every thread passes over all the rows.
template <WeightFormat F, typename T>
void split_panels(const LinearParams& p, const RoundedInputs& r) {
  const int64_t panels = (p.out_features + kPanelRows - 1) / kPanelRows, threads = get_num_threads();
  const int64_t chunk = chunk_rows(p);
  parallel_for(panels, (panels + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    const Panel panel(thread_scratch(0, Panel::bytes(r.blocks)), r.blocks);
    for (int64_t m_begin = 0; m_begin < p.rows; m_begin += chunk)
      multiply_panels<F, T>(p, r, panel, begin, end, m_begin, std::min(p.rows, m_begin + chunk));
    _mm_sfence();  // the streamed stores, before the pool's release of this chunk
  });
}

// Many rows: the threads split the rows, and each one rounds its own chunks and passes every
// panel over them, so the rounded inputs stay in the core that wrote them. Splitting the panels
// instead, each thread read the half of the inputs the other had rounded from the other core's
// cache: Q6_K 960 x 512 at 1024 rows took 2.25 ms that way on two threads, 1.97 ms this way.
template <WeightFormat F, typename T>
void split_rows(const LinearParams& p, RoundedInputs& r) {
  layout_inputs(p, r);
  const int64_t panels = (p.out_features + kPanelRows - 1) / kPanelRows, threads = get_num_threads();
  // Whole rounds of chunks over the threads, so none waits on a last odd chunk.
  int64_t chunks = (p.rows + chunk_rows(p) - 1) / chunk_rows(p);
  chunks = (chunks + threads - 1) / threads * threads;
  const int64_t rows = ((p.rows + chunks - 1) / chunks + kInputRows - 1) / kInputRows * kInputRows;
  parallel_for((p.rows + rows - 1) / rows, 1, [&](int64_t begin, int64_t end) {
    const Panel panel(thread_scratch(0, Panel::bytes(r.blocks)), r.blocks);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t m_begin = c * rows, m_end = std::min(p.rows, m_begin + rows);
      round_rows<T>(p, true, offset<F>(), Bytes<F>::kHalves, m_begin, m_end, r);
      multiply_panels<F, T>(p, r, panel, 0, panels, m_begin, m_end);
    }
    _mm_sfence();  // the streamed stores, before the pool's release of this chunk
  });
}

}  // namespace panels
#endif

template <WeightFormat F, typename T>
void linear_typed(const LinearParams& p) {
  RoundedInputs r;
#if defined(OCTAVO_GGUF_A8_PANELS)
  if (p.rows >= panels::kPanelsFromRows) {
    if (p.rows >= panels::kSplitRowsFrom * get_num_threads()) return panels::split_rows<F, T>(p, r);
    round_inputs<T>(p, true, panels::offset<F>(), Bytes<F>::kHalves, r);
    return panels::split_panels<F, T>(p, r);
  }
#endif
  round_inputs<T>(p, false, Bytes<F>::kOffset, Bytes<F>::kHalves, r);
  linear_rows<F, T>(p, r);
}

template <typename T>
void linear(const LinearParams& p) {
  switch (p.weight_format) {
    case WeightFormat::kQ8_0: return linear_typed<WeightFormat::kQ8_0, T>(p);
    case WeightFormat::kQ4_0: return linear_typed<WeightFormat::kQ4_0, T>(p);
    case WeightFormat::kQ4_1: return linear_typed<WeightFormat::kQ4_1, T>(p);
    case WeightFormat::kQ5_0: return linear_typed<WeightFormat::kQ5_0, T>(p);
    case WeightFormat::kQ5_1: return linear_typed<WeightFormat::kQ5_1, T>(p);
    case WeightFormat::kIQ4_NL: return linear_typed<WeightFormat::kIQ4_NL, T>(p);
    case WeightFormat::kQ3_K: return linear_typed<WeightFormat::kQ3_K, T>(p);
    case WeightFormat::kQ4_K: return linear_typed<WeightFormat::kQ4_K, T>(p);
    case WeightFormat::kQ5_K: return linear_typed<WeightFormat::kQ5_K, T>(p);
    case WeightFormat::kQ6_K: return linear_typed<WeightFormat::kQ6_K, T>(p);
    default: OCTAVO_CHECK(false, "int8 inputs need a GGUF block format, got " << weight_format_name(p.weight_format));
  }
}

}  // namespace gguf_a8
}  // namespace octavo::cpu::OCTAVO_ISA
