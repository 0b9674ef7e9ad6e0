// Per-request KV block bookkeeping over a BlockPool: prefix-cache lookup, slot allocation that
// either fully succeeds or changes nothing, hashing blocks as they fill, and freeing.
//
// Hybrid models (vLLM v1's KVCacheCoordinator). Layers of one attention kind form groups of
// equal size; group 0 has full attention, the others full or sliding-window attention. Group
// j's i-th layer shares KV tensor i with the other groups' i-th layers, so one block id is one
// block of bytes whatever group holds it, and every group draws on the one pool. A request has
// one block table per group, all of the same length. A sliding group keeps only the blocks its
// window can still reach: blocks that left it become the null block in its table and go back to
// the pool (still cached, so evictable, not dropped). Prefix-cache hits are found per group:
// group 0 finds the longest verified prefix; a sliding group needs its blocks over the window
// before the hit point (cached under group 0's block before each as parent); the hit is the
// longest every group has. Partial-block hits are for one-group models only.
#pragma once

#include <algorithm>
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
  // Hybrid models: groups 1, 2, ...'s hits, as long as block_ids (the null block outside a window).
  std::vector<std::vector<int32_t>> group_block_ids;
};

class KVCacheManager {
 public:
  // group_windows: each KV group's sliding window in tokens (0: full attention); group 0's is 0.
  // Empty: one group of full attention.
  KVCacheManager(int num_blocks, int block_size, int max_model_len, bool enable_caching = true,
                 std::vector<int32_t> group_windows = {});

  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }
  int block_size() const { return pool_.block_size(); }
  int max_model_len() const { return max_model_len_; }
  int num_blocks_for(int num_tokens) const { return (num_tokens + block_size() - 1) / block_size(); }
  int num_groups() const { return static_cast<int>(windows_.size()); }
  // The first block a group still needs once `num_computed` tokens are in the cache: the next
  // token (at position num_computed) attends to keys from num_computed - window + 1 on.
  int first_needed_block(int group, int num_computed) const {
    return windows_[group] == 0 ? 0 : std::max(0, num_computed - windows_[group] + 1) / block_size();
  }
  // Blocks a request of `num_tokens` KV slots can hold at once in all groups, when a step
  // computes at most `max_step_tokens` of them.
  int max_blocks_per_request(int num_tokens, int max_step_tokens) const;

  // Longest verified cached prefix of the request's tokens: full blocks, then the longest cached
  // partial block after them. The last token is never counted as computed, even when the whole
  // sequence is cached: its logits are needed. Takes no references and records nothing:
  // allocate_slots does both when the request is admitted.
  ComputedBlocks get_computed_blocks(Request& request);

  // Makes room for `num_new_tokens` tokens after the request's computed ones (plus
  // `num_lookahead_tokens` slots for speculative tokens), adopting `new_computed` cache hits
  // first. Returns false and changes nothing when too few blocks are free (but for blocks that
  // left a sliding group's window, released first when no open step holds the request, since
  // no token can read them again). On success the
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
  void find_group_hits(Request& request, ComputedBlocks& result);
  int32_t find_group_block(Request& request, int group, int i);
  int last_group_miss(Request& request, int group, int num_blocks);  // -1: the group has them all
  int num_hits_in_free_queue(const ComputedBlocks& hits) const;
  void adopt_hits(Request& request, const ComputedBlocks& hits);
  void extend_group_tables(Request& request, int length, int num_computed);
  // Returns to the pool the blocks of sliding groups that no token after the first
  // `num_computed` can reach. Not for a request an open step holds: that step's tokens before
  // num_computed may still read them.
  void release_out_of_window(Request& request, int num_computed);

  BlockPool pool_;
  int max_model_len_;
  std::vector<int32_t> windows_;                 // [num_groups] sliding window of each group, 0: full
  std::vector<int32_t> parents_, matches_;       // scratch of get_computed_blocks, kept to avoid allocations
  std::vector<std::vector<int32_t>> level_matches_;  // hybrid lookup: group 0's matches for each block
  std::vector<std::vector<int32_t>> group_found_;    // hybrid lookup: [group][block] hit, -1 none, -2 unknown
  std::vector<int32_t> to_release_;                  // scratch of free
};

}  // namespace octavo
