// The kernel template behind launch_prefill_attention (prefill_attention.cuh); included only by
// the per-head-size files that instantiate it.
//
// A block takes kPrefillRows (token, query head) rows of one KV head; warp w owns kM m-tiles of
// 16 of them and runs the warp-level steps of attention_mma.cuh over every tile of keys its rows
// can see. Only the copies of Q, K and V into shared memory need the whole block.
//
// An fp8 cache is staged and converted as in the grouped decode kernel (its header says how):
// staging rows of bytes two tiles deep, one 16-bit K and V tile; k_scale joins the softmax
// scale, v_scale the output.
#pragma once

#include <type_traits>

#include "attention_mma.cuh"
#include "paged_kv.cuh"
#include "prefill_attention.cuh"

namespace octavo::cuda {
namespace prefill_detail {

// Two m-tiles per warp where registers allow (each K / V fragment read from shared memory then
// serves 32 rows); one for head size 256, whose outputs alone take 128 registers per m-tile.
// Keys per tile: 32 where 64 would not fit in registers (head size 128 spills with 64) or, for
// head size 256, in an A100's 163 KiB of shared memory. Shared memory: Q, then K and V twice
// (the next tile is copied while this one is used); the keys' flags ride in the K rows' padding.
// With an fp8 cache (kFp8) one 16-bit K and V tile, then its staging rows (Fp8Stage).
template <int kD, int kKeysPerTile = kD == 64 ? 64 : 32, bool kFp8 = false>
struct Shape {
  static constexpr int kM = kD == 256 ? 1 : 2;
  static constexpr int kWarps = kPrefillRows / (16 * kM);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeys = kKeysPerTile;
  static constexpr int kLd = kD + 8;
  static constexpr int kTile = kKeys * kLd;  // elements of one K or V tile
  static constexpr int kBuffers = kFp8 ? 1 : 2;
  static constexpr int kK = kPrefillRows * kLd, kV = kK + kBuffers * kTile, kEnd = kV + kBuffers * kTile;
  using Stage = Fp8Stage<kD, kKeys>;
  static constexpr size_t kBytes = sizeof(uint16_t) * kEnd + (kFp8 ? Stage::kBytes : 0);
  static_assert(kD % 16 == 0 && kKeys % 16 == 0 && kPrefillRows % (16 * kM) == 0, "whole fragments");
};
// Head size 256 takes 132 KiB of shared memory with 32-key tiles: an A100's or H100's opt-in
// allows it, but RTX 30xx / 40xx cards (sm_86 / sm_89) allow 99 KiB per block. There a shape
// that needs more takes 16-key tiles, which fit exactly.
constexpr size_t kSmallDeviceBytes = 99 * 1024;
constexpr int kNarrowKeys = 16;
static_assert(Shape<256, kNarrowKeys>::kBytes <= kSmallDeviceBytes, "head size 256 fits a 99 KiB device");

// Where the block's rows come from: sequence, token range and positions.
struct PrefillTile {
  int seq;
  int64_t first_token;  // the tile's first query token
  int64_t q_count;      // query tokens in the tile
  int64_t pos0;         // position of the tile's first token
};

__device__ inline PrefillTile prefill_tile(const PagedAttentionParams& p, const int32_t* tile_offsets, int tile,
                                           int group) {
  const int seq = last_at_most(tile_offsets, static_cast<int>(p.num_seqs), tile);
  const int tokens_per_tile = kPrefillRows / group;
  const int64_t n_query = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  const int64_t q_begin = static_cast<int64_t>(tile - tile_offsets[seq]) * tokens_per_tile;
  PrefillTile t;
  t.seq = seq;
  t.first_token = p.query_start_loc[seq] + q_begin;
  t.q_count = min64(tokens_per_tile, n_query - q_begin);
  t.pos0 = p.seq_lens[seq] - n_query + q_begin;
  return t;
}

// out = o / sum for the thread's real rows, two adjacent elements per store; a row that saw no
// key gets zeros.
// (v_scale: an fp8 cache's, else 1.)
template <typename T, int kD>
__device__ void write_rows(const PagedAttentionParams& p, const PrefillTile& t, int kv_head, int group, int row0,
                           int lane, const mma_attention::RowStats<Shape<kD>::kM>& rows,
                           const mma_attention::Outputs<Shape<kD>::kM, kD>& o) {
#pragma unroll
  for (int i = 0; i < Shape<kD>::kM; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = rows.total(i, h);
      const int r = row0 + 16 * i + 8 * h;
      if (r / group >= t.q_count) continue;
      const float inv = sum > 0 ? p.v_scale / sum : 0.0f;
      T* out = static_cast<T*>(p.out) + (t.first_token + r / group) * p.out_stride + (kv_head * group + r % group) * kD;
#pragma unroll
      for (int c = 0; c < kD / 8; ++c)
        *reinterpret_cast<uint32_t*>(out + 8 * c + 2 * (lane % 4)) =
            pack_pair<T>(o[i][c][2 * h] * inv, o[i][c][2 * h + 1] * inv);
    }
  }
}

// Starts copying keys [start, start + kKeys) into buffer `buf`: the 16-bit tiles, or with an fp8
// cache (C) the staging rows. Returns copy_kv_tile's: whether a key this thread flagged is not real.
template <typename T, int kD, int kKeys, typename C>
__device__ bool copy_tile(const PagedKv& kv, int64_t start, int buf, T* k_s, T* v_s,
                          const Fp8Stage<kD, kKeys>& stage) {
  using S = Shape<kD, kKeys, !std::is_same_v<T, C>>;
  if constexpr (std::is_same_v<T, C>) {
    return copy_kv_tile<T, kD, kKeys, S::kLd>(kv, start, k_s + buf * S::kTile, v_s + buf * S::kTile, nullptr,
                                              threadIdx.x, S::kThreads);
  } else {
    return stage.copy(kv, start, buf, S::kThreads);
  }
}

// T: the query's and output's type; C: the cache's (T, or fp8e4m3).
template <typename T, int kD, int kKeys, typename C>
__global__ void __launch_bounds__(Shape<kD, kKeys>::kThreads) prefill_kernel(PagedAttentionParams p,
                                                                            const int32_t* tile_offsets) {
  constexpr bool kFp8 = !std::is_same_v<T, C>;
  using S = Shape<kD, kKeys, kFp8>;
  constexpr int kM = S::kM;
  unsigned char* const smem = dynamic_shared_memory();
  T* q_s = reinterpret_cast<T*>(smem);  // [kPrefillRows][kLd]
  T* k_s = q_s + S::kK;                 // [kBuffers][kKeys][kLd]
  T* v_s = q_s + S::kV;                 // [kBuffers][kKeys][kLd]
  const Fp8Stage<kD, kKeys> stage{reinterpret_cast<uint8_t*>(q_s + S::kEnd)};  // fp8 only

  // Blocks run roughly in index order; the last tiles of a sequence see the most keys, so they
  // go first, and the short ones fill in at the end. Tiles are numbered from tile_offsets[0]: 0,
  // or where a batch's leading decodes end when they run apart (attention.cu).
  const int tile = tile_offsets[0] + static_cast<int>(gridDim.x - 1 - blockIdx.x), kv_head = blockIdx.y;
  if (tile >= tile_offsets[p.num_seqs]) return;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const PrefillTile t = prefill_tile(p, tile_offsets, tile, group);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = warp * 16 * kM + lane / 4;  // the thread's rows: row0 + 16i + 8h
  // A warp whose rows are all padding skips the math (it still copies and meets the barriers):
  // a decode in a mixed batch fills `group` of the tile's rows, so most warps have none.
  const bool warp_has_rows = warp * 16 * kM < static_cast<int>(t.q_count) * group;
  int pos[kM][2];  // their positions (contexts fit 32 bits)
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) pos[i][h] = static_cast<int>(t.pos0 + (row0 + 16 * i + 8 * h) / group);

  // Keys [k_begin, k_end): what the tile's first and last tokens can see between them.
  const int64_t last_pos = t.pos0 + t.q_count - 1;
  const int64_t k_end = min64(last_pos + 1, p.max_blocks_per_seq * p.block_size);
  const int64_t k_begin = p.sliding_window > 0 ? max64(0, t.pos0 - p.sliding_window + 1) : 0;
  const int window = static_cast<int>(p.sliding_window);
  const PagedKv kv = paged_kv<C, kD>(p, t.seq, kv_head, k_end);
  PagedAttentionParams scaled = p;
  scaled.scale *= p.k_scale;  // q . (k_scale k) = k_scale (q . k); 1 but for an fp8 cache

  mma_attention::copy_query_rows<T, kD, kPrefillRows, S::kLd>(p, t.first_token, t.q_count, kv_head, group, q_s,
                                                            S::kThreads);
  bool next_masked = k_begin < k_end && copy_tile<T, kD, kKeys, C>(kv, k_begin, 0, k_s, v_s, stage);
  copy_async_commit();  // the query rows and the first tile

  mma_attention::Outputs<kM, kD> o = {};
  mma_attention::RowStats<kM> rows;
  int buf = 0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += S::kKeys, buf ^= 1) {
    bool masked = next_masked;
    if (k0 + S::kKeys < k_end) {  // the next tile's copy runs while this one is used
      next_masked = copy_tile<T, kD, kKeys, C>(kv, k0 + S::kKeys, buf ^ 1, k_s, v_s, stage);
      copy_async_commit();
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    // Every thread's copies into `buf` are done. Masks are needed where a key is not real, or
    // where some row does not see the whole tile (the diagonal, the window's edge).
    masked = __syncthreads_or(masked) || k0 + S::kKeys - 1 > t.pos0 ||
             (window > 0 && k0 <= last_pos - window);
    int at = buf * S::kTile;  // the 16-bit tiles' offset
    if constexpr (kFp8) {
      stage.template convert<T, S::kLd>(buf, k_s, v_s, S::kThreads);
      at = 0;
      __syncthreads();
    }
    const T* k_tile = k_s + at;
    const int first = static_cast<int>(k0);
    const auto visible = [&](int i, int h, int j) {
      const int key = first + j;
      return !masked ||
             (*row_flag<kD, S::kLd>(k_tile, j) && key <= pos[i][h] && (window == 0 || key > pos[i][h] - window));
    };
    if (warp_has_rows) {
      mma_attention::Scores<kM, S::kKeys> s;
      mma_attention::score_tile<T, kM, kD, S::kKeys, S::kLd>(q_s + warp * 16 * kM * S::kLd, k_tile, lane, s);
      mma_attention::softmax_tile<kM, kD, S::kKeys>(scaled, visible, lane, s, rows, o);
      mma_attention::accumulate_tile<T, kM, kD, S::kKeys, S::kLd>(s, v_s + at, lane, o);
    }
    __syncthreads();  // `buf` is refilled by the next iteration's copy
  }
  copy_async_wait<0>();  // with no key at all, the query's copies are still pending
  write_rows<T, kD>(p, t, kv_head, group, row0, lane, rows, o);
}

template <typename T, int kD, int kKeys, typename C>
void launch(const PagedAttentionParams& p, const int32_t* tile_offsets, int64_t max_tiles) {
  using S = Shape<kD, kKeys, !std::is_same_v<T, C>>;
  auto kernel = prefill_kernel<T, kD, kKeys, C>;
  static std::atomic<bool> opted_in[kMaxDevices] = {};
  allow_shared_memory(kernel, S::kBytes, opted_in, "paged_attention (prefill)");
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(p.num_kv_heads));
  launch_kernel(kernel, grid, S::kThreads, S::kBytes, p, tile_offsets);
  check_launch("paged_attention (prefill)");
}
}  // namespace prefill_detail

namespace prefill_detail {
// Whether `bytes` of shared memory fit a block on the current device.
inline bool fits(size_t bytes) { return bytes <= static_cast<size_t>(shared_memory_optin()); }
}  // namespace prefill_detail

template <typename T, int kD, typename C>
bool prefill_fits() {
  using prefill_detail::Shape;
  constexpr bool kFp8 = !std::is_same_v<T, C>;
  return prefill_detail::fits(Shape<kD, Shape<kD>::kKeys, kFp8>::kBytes) ||
         prefill_detail::fits(Shape<kD, prefill_detail::kNarrowKeys, kFp8>::kBytes);
}

template <typename T, int kD, typename C>
void launch_prefill_attention(const PagedAttentionParams& p, const int32_t* tile_offsets, int64_t max_tiles) {
  using prefill_detail::Shape;
  constexpr bool kFp8 = !std::is_same_v<T, C>;
  constexpr int kKeys = Shape<kD>::kKeys;
  if constexpr (Shape<kD, kKeys, kFp8>::kBytes > prefill_detail::kSmallDeviceBytes) {
    if (!prefill_detail::fits(Shape<kD, kKeys, kFp8>::kBytes))
      return prefill_detail::launch<T, kD, prefill_detail::kNarrowKeys, C>(p, tile_offsets, max_tiles);
  }
  prefill_detail::launch<T, kD, kKeys, C>(p, tile_offsets, max_tiles);
}

#define OCTAVO_PREFILL_ATTENTION_FOR(T, D, C)                                                        \
  template bool prefill_fits<T, D, C>();                                                             \
  template void launch_prefill_attention<T, D, C>(const PagedAttentionParams&, const int32_t*, int64_t);
#define OCTAVO_INSTANTIATE_PREFILL_ATTENTION(D) \
  OCTAVO_PREFILL_ATTENTION_FOR(bf16, D, bf16)   \
  OCTAVO_PREFILL_ATTENTION_FOR(f16, D, f16)     \
  OCTAVO_PREFILL_ATTENTION_FOR(bf16, D, fp8e4m3) \
  OCTAVO_PREFILL_ATTENTION_FOR(f16, D, fp8e4m3)

}  // namespace octavo::cuda
