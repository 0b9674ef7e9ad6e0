// Per-request KV block bookkeeping over a BlockPool: prefix-cache lookup, slot allocation that
// either fully succeeds or changes nothing, hashing blocks as they fill, and freeing.
#pragma once

#include <cstdint>
#include <vector>

#include "octavo/block_pool.h"
#include "octavo/request.h"

namespace octavo {

struct ComputedBlocks {
  std::vector<int32_t> block_ids;  // cached full blocks covering the first block_ids.size() blocks
  int32_t partial_block = -1;      // a cached partial block holding the next num_partial_tokens
  int num_partial_tokens = 0;      //   tokens (copied into a block of the request's own), or -1
  int num_computed_tokens = 0;     // full blocks' tokens + num_partial_tokens, < request.num_tokens()
};

class KVCacheManager {
 public:
  KVCacheManager(int num_blocks, int block_size, int max_model_len, bool enable_caching = true);

  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }
  int block_size() const { return pool_.block_size(); }
  int max_model_len() const { return max_model_len_; }
  int num_blocks_for(int num_tokens) const { return (num_tokens + block_size() - 1) / block_size(); }

  // Longest verified cached prefix of the request's tokens: full blocks, then the longest cached
  // partial block after them. The last token is never counted as computed, even when the whole
  // sequence is cached: its logits are needed. Takes no references and records nothing:
  // allocate_slots does both when the request is admitted.
  ComputedBlocks get_computed_blocks(Request& request);

  // Makes room for `num_new_tokens` tokens after the request's computed ones (plus
  // `num_lookahead_tokens` slots for speculative tokens), adopting `new_computed` cache hits
  // first. Returns false and changes nothing when too few blocks are free. On success the
  // request's full blocks of known tokens up to the new computed length are registered in the
  // prefix cache, and a lookup result (`new_computed` given) counts in the prefix-cache stats. A
  // partial hit gets its own block (request.copy_dst) to copy the cached one (request.copy_src,
  // held: the caller releases it with release_copy_source once the copy has run).
  bool allocate_slots(Request& request, int num_new_tokens, const ComputedBlocks* new_computed = nullptr,
                      int num_lookahead_tokens = 0);

  // Returns the request's blocks to the pool, last block first so that its tail is evicted
  // before its shared prefix. Blocks holding tokens at or past `num_valid_tokens` lose their
  // cache entries (their KV was never computed); -1 keeps every entry. A last block partly
  // filled with valid KV is cached as a partial block, and full ones not cached yet are cached.
  void free(Request& request, int num_valid_tokens = -1);
  void release_copy_source(int32_t block_id) { pool_.release(&block_id, 1); }

 private:
  void cache_full_blocks(Request& request, int num_tokens);
  void cache_partial_block(Request& request, int num_valid_tokens);
  void find_partial_block(Request& request, ComputedBlocks& result);

  BlockPool pool_;
  int max_model_len_;
  std::vector<int32_t> parents_, matches_;  // scratch of get_computed_blocks, kept to avoid allocations
};

}  // namespace octavo
