// The pool of paged KV blocks: reference counts, an LRU free queue and the prefix cache.
//
// Block 0 is the null block. It is never handed out and never cached; padded block-table
// entries point at it so that a kernel reading past a request's last block stays in bounds
// (the padding tokens themselves get slot -1 and are never written).
//
// Prefix cache. A full block is registered under a 64-bit hash chained from its parent block's
// hash, its tokens and the request's extra key. The hash only finds candidates: every hit is
// verified against the block's stored tokens, extra key and parent block (id plus a generation
// number that changes whenever that block leaves the cache), so by induction from the first
// block the whole prefix is checked token by token. A hash collision can cost a lookup, never
// a wrong answer.
//
// Partial blocks. A request's last block, when it holds fewer than block_size tokens of valid
// KV, is registered as it is freed, under the hash of its n tokens (chained from its full
// parent). A later request whose tokens continue past those n copies the block into one of its
// own rather than computing the n tokens again (copy on write: the block is never shared). Beam
// search's beams extend one sequence each step, so each finds its parent's tail this way.
//
// Free queue. Blocks with reference count 0 sit in a doubly linked list in LRU order; allocation
// takes from the front. A cached block that reaches count 0 keeps its cache entry until it is
// taken from the front (evicted) or touched by a cache hit (removed from the queue in O(1)).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace octavo {

struct PrefixCacheStats {
  int64_t queries = 0;   // prompt tokens looked up
  int64_t hits = 0;      // of those, tokens found in the cache
  int64_t requests = 0;  // lookups made
};

// 64-bit chained hash of one block of tokens; the parent of the first block has hash 0.
uint64_t hash_block_tokens(uint64_t parent_hash, const int32_t* tokens, int num_tokens, uint64_t extra_key);

class BlockPool {
 public:
  static constexpr int32_t kNullBlock = 0;

  BlockPool(int num_blocks, int block_size = 16, bool enable_caching = true);

  int num_blocks() const { return num_blocks_; }        // including the null block
  int block_size() const { return block_size_; }
  bool enable_caching() const { return enable_caching_; }
  int num_usable_blocks() const { return num_blocks_ - 1; }
  int num_free_blocks() const { return num_free_; }      // count 0, cached or not
  int num_used_blocks() const { return num_usable_blocks() - num_free_; }
  int num_cached_blocks() const { return num_cached_; }  // with a cache entry, any count
  double usage() const;                                  // used / usable, in [0, 1]

  // Takes n blocks from the front of the free queue (evicting their cache entries) and appends
  // them to out with count 1. Throws if fewer than n are free; callers check first.
  void allocate(int n, std::vector<int32_t>& out);
  // Adds a reference to each block (cache hits); a block at count 0 leaves the free queue.
  void touch(const int32_t* ids, int n);
  // Drops a reference from each block; blocks reaching 0 join the back of the free queue in the
  // order given, so the first of them is evicted first.
  void release(const int32_t* ids, int n);

  // Registers a block that holds `tokens` (num_tokens of them; -1: a full block) after `parent`
  // (kNullBlock for the first block of a sequence), as KV of layer group `group` (hybrid models:
  // the same tokens' blocks of different groups hold different layers' KV).
  void cache_block(int32_t id, uint64_t hash, const int32_t* tokens, uint64_t extra_key, int32_t parent,
                   int num_tokens = -1, int group = 0);
  // Removes a block's cache entry (its KV is not valid), if it has one.
  void uncache_block(int32_t id);
  // Appends to out every cached block under `hash` that holds exactly `tokens` (num_tokens of
  // them; -1: a full block) with `extra_key`, of layer group `group`, and whose recorded parent is
  // one of `parents` (still cached); parents = {kNullBlock} for the first block.
  void find_cached(uint64_t hash, const int32_t* tokens, uint64_t extra_key, const std::vector<int32_t>& parents,
                   std::vector<int32_t>& out, int num_tokens = -1, int group = 0) const;
  // Drops every cache entry. Refused (returns false) while any block is in use, as in vLLM.
  bool reset_prefix_cache();

  int ref_count(int32_t id) const { return ref_[id]; }
  bool is_cached(int32_t id) const { return cached_[id] != 0; }
  // Free-queue order, front first (for tests and debugging; O(num_free)).
  std::vector<int32_t> free_queue() const;

  PrefixCacheStats& stats() { return stats_; }
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  void push_back_free(int32_t id);
  void unlink_free(int32_t id);
  bool holds(int32_t id, const int32_t* tokens, uint64_t extra_key, int num_tokens, int group) const;
  bool parent_matches(int32_t id, const std::vector<int32_t>& parents) const;

  int num_blocks_;
  int block_size_;
  bool enable_caching_;
  int num_free_ = 0;
  int num_cached_ = 0;

  std::vector<int32_t> ref_;        // [num_blocks] reference count
  std::vector<int32_t> prev_free_;  // [num_blocks + 1] free queue links; index num_blocks is the sentinel
  std::vector<int32_t> next_free_;
  // Prefix-cache entry of each block.
  std::vector<uint8_t> cached_;          // [num_blocks] has an entry
  std::vector<uint64_t> hash_;           // [num_blocks]
  std::vector<uint64_t> extra_key_;      // [num_blocks]
  std::vector<int32_t> parent_;          // [num_blocks] parent block id, or kNullBlock
  std::vector<uint32_t> parent_gen_;     // [num_blocks] generation of parent when cached
  std::vector<uint32_t> generation_;     // [num_blocks] bumped when the block leaves the cache
  std::vector<int32_t> next_same_hash_;  // [num_blocks] chain of blocks sharing a hash, -1 ends
  std::vector<int32_t> tokens_;          // [num_blocks, block_size] tokens of cached blocks
  std::vector<int32_t> length_;          // [num_blocks] how many of them (block_size: a full block)
  std::vector<int32_t> group_;           // [num_blocks] layer group whose KV the block holds
  std::unordered_map<uint64_t, int32_t> hash_head_;  // hash -> first block of its chain
  PrefixCacheStats stats_;
};

}  // namespace octavo
