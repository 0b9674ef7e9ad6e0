// Attention of one warp's query rows against a tile of keys on tensor cores, FlashAttention-2
// style: what the prefill kernel and the grouped decode kernel are built from.
//
// A warp takes kM m-tiles of 16 query rows. It computes their scores S = Q·Kᵀ against a tile of
// kKeys keys into registers (kKeys / 8 C fragments per m-tile), masks and exponentiates them
// there, and uses them right away as the A fragments of O += P·V: the C fragments of keys
// 16u..16u+15 are, element for element, the A fragment of that k-step. O stays in registers
// (kD / 8 C fragments per m-tile). Each thread so holds two rows of each m-tile, g and g + 8
// (g = lane / 4); a row's values are spread over the 4 lanes of a quad, whose shuffles give the
// row max. The row sum is kept per thread and summed over the quad once, at the end.
//
// Q, K and V rows sit in shared memory kLd elements apart; kLd = kD + 8 pads each row by 16
// bytes, so that the 8 row addresses of an ldmatrix fall in distinct banks.
#pragma once

#include <cfloat>

#include "mma.cuh"
#include "params.h"

namespace octavo::cuda::mma_attention {

// Starts copying kRows query rows into q_s (kLd elements apart) with `threads` threads: row r is
// token first_token + r / group, query head kv_head * group + r % group; rows past `tokens`
// tokens are zeros. The prefill kernel's tile of (token, head) rows, or with tokens = 1 a decode
// token's group padded to an m-tile.
template <typename T, int kD, int kRows, int kLd>
__device__ void copy_query_rows(const PagedAttentionParams& p, int64_t first_token, int64_t tokens, int kv_head,
                                int group, T* q_s, int threads) {
  constexpr int kPack = Pack<T>::kSize, kPacksPerRow = kD / kPack;
  for (int i = threadIdx.x; i < kRows * kPacksPerRow; i += threads) {
    const int r = i / kPacksPerRow, d = (i % kPacksPerRow) * kPack;
    const bool real = r / group < tokens;
    const int64_t token = first_token + (real ? r / group : 0);
    const T* src = static_cast<const T*>(p.query) + token * p.query_stride + (kv_head * group + r % group) * kD + d;
    copy_async_16(q_s + r * kLd + d, src, !real);
  }
}

// A warp's scores for kM x 16 query rows and kKeys keys, and its outputs for the same rows:
// C fragments, m-tile i holding rows 16i..16i+15.
template <int kM, int kKeys>
using Scores = float[kM][kKeys / 8][4];
template <int kM, int kD>
using Outputs = float[kM][kD / 8][4];

// s = Q·Kᵀ for the warp's kM x 16 query rows (q_rows) and kKeys key rows (k_rows). Key row j
// holds B's column j, so K is read without a transpose: the four 8x8 matrices of one load are
// keys 16u..16u+7 and 16u+8..16u+15, each at head columns c and c + 8. Each B fragment serves
// all kM m-tiles, so more rows per warp means fewer shared-memory reads per mma.
template <typename T, int kM, int kD, int kKeys, int kLd>
__device__ __forceinline__ void score_tile(const T* q_rows, const T* k_rows, int lane, Scores<kM, kKeys>& s) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.0f;
#pragma unroll
  for (int c = 0; c < kD; c += 16) {
    uint32_t a[kM][4];
#pragma unroll
    for (int i = 0; i < kM; ++i)
      load_matrix_x4<false>(a[i], q_rows + (16 * i + lane % 16) * kLd + c + (lane / 16) * 8);
#pragma unroll
    for (int u = 0; u < kKeys / 16; ++u) {
      uint32_t b[4];
      load_matrix_x4<false>(b, k_rows + (16 * u + (lane / 16) * 8 + lane % 8) * kLd + c + (lane / 8 % 2) * 8);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        mma_16x8x16<T>(s[i][2 * u], a[i], b[0], b[1]);
        mma_16x8x16<T>(s[i][2 * u + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// o += P·V with P the tile's probabilities (s, exponentiated) as A fragments. V's rows are keys
// (B's rows), so it is read transposed: the four matrices of one load are keys 16u..16u+7 and
// 16u+8..16u+15 at head columns c..c+7, then the same keys at c+8..c+15.
template <typename T, int kM, int kD, int kKeys, int kLd>
__device__ __forceinline__ void accumulate_tile(const Scores<kM, kKeys>& s, const T* v_rows, int lane,
                                                Outputs<kM, kD>& o) {
#pragma unroll
  for (int u = 0; u < kKeys / 16; ++u) {
    uint32_t a[kM][4];
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      a[i][0] = pack_pair<T>(s[i][2 * u][0], s[i][2 * u][1]);
      a[i][1] = pack_pair<T>(s[i][2 * u][2], s[i][2 * u][3]);
      a[i][2] = pack_pair<T>(s[i][2 * u + 1][0], s[i][2 * u + 1][1]);
      a[i][3] = pack_pair<T>(s[i][2 * u + 1][2], s[i][2 * u + 1][3]);
    }
#pragma unroll
    for (int c = 0; c < kD; c += 16) {
      uint32_t b[4];
      load_matrix_x4<true>(b, v_rows + (16 * u + (lane / 8 % 2) * 8 + lane % 8) * kLd + c + (lane / 16) * 8);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        mma_16x8x16<T>(o[i][c / 8], a[i], b[0], b[1]);
        mma_16x8x16<T>(o[i][c / 8 + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// A thread's running max and sum for its two rows of each m-tile (the sum over its own columns
// only).
template <int kM>
struct RowStats {
  float m[kM][2];
  float l[kM][2];
  __device__ RowStats() {
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      m[i][0] = m[i][1] = -FLT_MAX;  // finite, so that a tile of masked keys gives alpha = e^0, not NaN
      l[i][0] = l[i][1] = 0.0f;
    }
  }
  // Row g + 8h of m-tile i's sum over the whole quad (every lane of it gets it).
  __device__ float total(int i, int h) const {
    float sum = l[i][h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
  }
};

// Scales (and caps) the tile's scores, hides those visible(i, h, j) refuses (m-tile i; h: row
// g or g + 8; j: the key's column in the tile), and turns them into probabilities against the
// rows' new maxima, rescaling the sums and o to match.
template <int kM, int kD, int kKeys, typename Visible>
__device__ __forceinline__ void softmax_tile(const PagedAttentionParams& p, const Visible& visible, int lane,
                                             Scores<kM, kKeys>& s, RowStats<kM>& rows, Outputs<kM, kD>& o) {
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][n][e] * p.scale;
        if (p.softcap > 0) x = p.softcap * tanhf(x / p.softcap);
        s[i][n][e] = visible(i, e / 2, 8 * n + 2 * (lane % 4) + e % 2) ? x : -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = rows.m[i][h];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float alpha = __expf(rows.m[i][h] - mx);
      rows.m[i][h] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        s[i][n][2 * h] = __expf(s[i][n][2 * h] - mx);  // 0 for hidden keys
        s[i][n][2 * h + 1] = __expf(s[i][n][2 * h + 1] - mx);
        sum += s[i][n][2 * h] + s[i][n][2 * h + 1];
      }
      rows.l[i][h] = rows.l[i][h] * alpha + sum;
#pragma unroll
      for (int c = 0; c < kD / 8; ++c) {
        o[i][c][2 * h] *= alpha;
        o[i][c][2 * h + 1] *= alpha;
      }
    }
  }
}

}  // namespace octavo::cuda::mma_attention
