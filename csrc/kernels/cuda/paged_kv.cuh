// Tiles of one sequence's keys and values, read from the paged cache into shared memory with
// cp.async: what all three attention kernels (split-KV decode, grouped decode, prefill) stream.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "params.h"

namespace octavo::cuda {

// A sequence's rows of one KV head in the cache, and the keys [0, k_end) a kernel may read.
struct PagedKv {
  const int32_t* table;     // the sequence's block table
  const void* key_cache;    // the KV head's rows (block 0, key 0)
  const void* value_cache;
  int64_t block_stride;     // elements between cache blocks
  int64_t k_end;
  int block_size;
  int block_shift;          // log2(block_size) when a power of two (the usual case: a shift, not a division), else -1
  int num_blocks;           // block ids outside [0, num_blocks) mask their keys
};

template <typename T, int kD>
__device__ PagedKv paged_kv(const PagedAttentionParams& p, int seq, int kv_head, int64_t k_end) {
  const int64_t head_stride = p.block_size * kD;  // between KV heads of one block
  PagedKv kv;
  kv.table = p.block_tables + seq * p.block_table_stride;
  kv.key_cache = static_cast<const T*>(p.key_cache) + kv_head * head_stride;
  kv.value_cache = static_cast<const T*>(p.value_cache) + kv_head * head_stride;
  kv.block_stride = p.num_kv_heads * head_stride;
  kv.k_end = k_end;
  kv.block_size = static_cast<int>(p.block_size);
  kv.block_shift = (kv.block_size & (kv.block_size - 1)) == 0 ? __ffs(kv.block_size) - 1 : -1;
  kv.num_blocks = static_cast<int>(p.num_blocks);
  return kv;
}

// What a decode kernel's block works on: its KV head's rows of the query token's sequence, and
// the keys [k_begin, kv.k_end) of its split of the token's visible keys. Splits take whole tiles
// of kTileKeys, so that only the last tile of the range is partial.
struct DecodeWork {
  PagedKv kv;
  int64_t k_begin;
};

template <typename T, int kD, int kTileKeys>
__device__ DecodeWork decode_work(const PagedAttentionParams& p, int token, int kv_head, int split, int num_splits) {
  const int seq = last_at_most(p.query_start_loc, static_cast<int>(p.num_seqs), token);
  const int64_t n_query = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  const int64_t pos = p.seq_lens[seq] - n_query + (token - p.query_start_loc[seq]);  // this query's position
  const int64_t lo = p.sliding_window > 0 ? max64(0, pos - p.sliding_window + 1) : 0;
  const int64_t hi = min64(pos + 1, p.max_blocks_per_seq * p.block_size);  // keys [lo, hi)
  const int64_t span = hi > lo ? hi - lo : 0;
  const int64_t per_split = ceil_div(ceil_div(span, num_splits), kTileKeys) * kTileKeys;
  const int64_t k_begin = lo + split * per_split;
  return {paged_kv<T, kD>(p, seq, kv_head, min64(hi, k_begin + per_split)), k_begin};
}

// Where a tile keeps key j's flag (1: a real key). Rows kLd > kD elements apart (the tensor-core
// kernels pad them against bank conflicts) carry it in their padding, which costs no shared
// memory: that is what lets head-size-256 prefill fit a 99 KiB device. Tiles of unpadded rows
// keep their flags in an array of their own.
template <int kD, int kLd, typename T>
__device__ __forceinline__ auto row_flag(T* k_tile, int j) {
  static_assert((kLd - kD) * sizeof(T) >= sizeof(int), "the row's padding holds its flag");
  using Flag = std::conditional_t<std::is_const_v<T>, const int, int>;
  return reinterpret_cast<Flag*>(k_tile + j * kLd + kD);
}

// The block ids of a tile's keys [start, start + kKeys), read from the block table once per tile
// and warp: lane l holds the id of the tile's block l (and l + 32, ... for tiles of more than 32
// blocks, which block sizes below kKeys / 32 make); -1 for blocks starting past k_end.
template <int kKeys>
struct TileBlocks {
  static constexpr int kRegs = (kKeys + 31) / 32;  // a tile spans at most kKeys blocks
  int lead;                                        // keys of the tile's first block before start
  int ids[kRegs];

  __device__ TileBlocks(const PagedKv& kv, int start, int lane) {
    const int first = kv.block_shift >= 0 ? start >> kv.block_shift : start / kv.block_size;
    lead = start - first * kv.block_size;
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int entry = first + lane + 32 * r;
      ids[r] = static_cast<int64_t>(entry) * kv.block_size < kv.k_end ? kv.table[entry] : -1;
    }
  }

  // The id of the tile's block `at`. Every lane of the warp must call it.
  __device__ int id(int at) const {
    int id = __shfl_sync(0xffffffffu, ids[0], at & 31);
#pragma unroll
    for (int r = 1; r < kRegs; ++r) {
      const int other = __shfl_sync(0xffffffffu, ids[r], at & 31);
      if (at >> 5 == r) id = other;
    }
    return id;
  }
};

// Starts copying keys [start, start + kKeys) into rows kLd elements apart at k_dst / v_dst (the
// caller commits the copy group): K and V rows, zeros for keys past k_end or in a block outside
// the cache, and each key's flag saying whether it is real (in the row's padding, else at
// ok_dst[j]; see row_flag). The block table is read once per tile (TileBlocks). Called by whole
// warps, `tid` counting the block's threads in their hardware order and `threads` a multiple of
// 32, so that every lane of a warp takes each step of the loop. Returns whether any key this
// thread flagged is not real.
template <typename T, int kD, int kKeys, int kLd>
__device__ bool copy_kv_tile(const PagedKv& kv, int64_t start, T* k_dst, T* v_dst, int* ok_dst, int tid, int threads) {
  constexpr int kPack = Pack<T>::kSize, kPacksPerRow = kD / kPack;
  static_assert(kKeys * kPacksPerRow % 32 == 0, "whole warps per step of the copy loop");
  const TileBlocks<kKeys> blocks(kv, static_cast<int>(start), tid % 32);  // contexts fit 32 bits
  const int real_keys = static_cast<int>(kv.k_end - start);  // contexts fit 32 bits
  bool any_masked = false;
  for (int c = tid; c < kKeys * kPacksPerRow; c += threads) {
    const int j = c / kPacksPerRow, d = (c % kPacksPerRow) * kPack;
    const int from_lead = blocks.lead + j;  // the key's place counted from its tile's first block
    const int at = kv.block_shift >= 0 ? from_lead >> kv.block_shift : from_lead / kv.block_size;
    const int id = blocks.id(at);  // by every lane, before the mask below
    const bool ok = j < real_keys && id >= 0 && id < kv.num_blocks;
    const int64_t offset = ok ? id * kv.block_stride + (from_lead - at * kv.block_size) * kD + d : 0;
    copy_async_16(k_dst + j * kLd + d, static_cast<const T*>(kv.key_cache) + offset, !ok);
    copy_async_16(v_dst + j * kLd + d, static_cast<const T*>(kv.value_cache) + offset, !ok);
    if (d == 0) {
      if constexpr (kLd > kD) *row_flag<kD, kLd>(k_dst, j) = ok;
      else ok_dst[j] = ok;
      any_masked |= !ok;
    }
  }
  return any_masked;
}

// An fp8 cache's tiles on their way into shared memory (kv_cache_dtype="fp8"): copy_kv_tile
// copies the bytes as they are into staging rows (K twice, then V twice: the next tile is copied
// while this one is converted), kStageLd bytes apart with the keys' flags in their padding; then
// convert() turns buffer `buf` into the query's 16-bit type in the kernel's own tiles (rows kLd
// elements apart, flags likewise). E4M3 values are exact in bfloat16 and float16.
template <int kD, int kKeys>
struct Fp8Stage {
  static constexpr int kStageLd = kD + 16;
  static constexpr int kTileBytes = kKeys * kStageLd;
  static constexpr size_t kBytes = 4 * kTileBytes;
  uint8_t* at;  // kBytes of shared memory, 16-byte aligned

  // Starts copying keys [start, start + kKeys) into buffer `buf` (see copy_kv_tile, whose result it returns).
  __device__ bool copy(const PagedKv& kv, int64_t start, int buf, int threads) const {
    auto* k = reinterpret_cast<fp8e4m3*>(at + buf * kTileBytes);
    auto* v = reinterpret_cast<fp8e4m3*>(at + (2 + buf) * kTileBytes);
    return copy_kv_tile<fp8e4m3, kD, kKeys, kStageLd>(kv, start, k, v, nullptr, threadIdx.x, threads);
  }

  template <typename T, int kLd>
  __device__ void convert(int buf, T* k_tile, T* v_tile, int threads) const {
    convert_rows<T, kLd>(at + buf * kTileBytes, k_tile, threads);
    convert_rows<T, kLd>(at + (2 + buf) * kTileBytes, v_tile, threads);
  }

  // 16 values a thread and step.
  template <typename T, int kLd>
  __device__ static void convert_rows(const uint8_t* stage, T* tile, int threads) {
    constexpr int kPacksPerRow = kD / 16;
    for (int i = threadIdx.x; i < kKeys * kPacksPerRow; i += threads) {
      const int j = i / kPacksPerRow, d = (i % kPacksPerRow) * 16;
      const Pack<uint8_t> bytes = load_pack(stage + j * kStageLd + d);
      Pack<T> lo, hi;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        lo.v[e] = from_float<T>(fp8_e4m3_to_float(bytes.v[e]));
        hi.v[e] = from_float<T>(fp8_e4m3_to_float(bytes.v[8 + e]));
      }
      store_pack(tile + j * kLd + d, lo);
      store_pack(tile + j * kLd + d + 8, hi);
      if (d == 0) *row_flag<kD, kLd>(tile, j) = *row_flag<kD, kStageLd>(stage, j);
    }
  }
};

}  // namespace octavo::cuda
