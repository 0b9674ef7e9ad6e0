#include "octavo/block_pool.h"

#include <algorithm>
#include <cstring>

#include "octavo/status.h"

namespace octavo {

namespace {

// Finalizer that spreads every input bit over the whole word (the MurmurHash3 fmix64 constants).
uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t rotate_left(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

}  // namespace

uint64_t hash_block_tokens(uint64_t parent_hash, const int32_t* tokens, int num_tokens, uint64_t extra_key) {
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ULL;  // odd, from the golden ratio
  uint64_t h = avalanche(parent_hash ^ 0x6f637461766f0001ULL);
  int i = 0;
  for (; i + 1 < num_tokens; i += 2) {
    const uint64_t pair = static_cast<uint32_t>(tokens[i]) | (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = rotate_left(h ^ (pair * kMul), 29) * kMul;
  }
  if (i < num_tokens) h = rotate_left(h ^ (static_cast<uint32_t>(tokens[i]) * kMul), 29) * kMul;
  return avalanche(h ^ avalanche(extra_key + static_cast<uint64_t>(num_tokens)));
}

BlockPool::BlockPool(int num_blocks, int block_size, bool enable_caching)
    : num_blocks_(num_blocks), block_size_(block_size), enable_caching_(enable_caching) {
  OCTAVO_CHECK(num_blocks >= 2, "num_blocks must be at least 2 (block 0 is the reserved null block), got " << num_blocks);
  OCTAVO_CHECK(block_size >= 1 && block_size <= 1024, "block_size must be in [1, 1024], got " << block_size);
  const size_t n = static_cast<size_t>(num_blocks);
  ref_.assign(n, 0);
  prev_free_.assign(n + 1, -1);
  next_free_.assign(n + 1, -1);
  cached_.assign(n, 0);
  hash_.assign(n, 0);
  extra_key_.assign(n, 0);
  parent_.assign(n, kNullBlock);
  parent_gen_.assign(n, 0);
  generation_.assign(n, 0);
  next_same_hash_.assign(n, -1);
  length_.assign(n, 0);
  group_.assign(n, 0);
  if (enable_caching) tokens_.assign(n * static_cast<size_t>(block_size), 0);
  const int32_t sentinel = num_blocks_;
  prev_free_[sentinel] = next_free_[sentinel] = sentinel;
  ref_[kNullBlock] = 1;  // permanently held, so it is never freed or counted as free
  for (int32_t id = 1; id < num_blocks_; ++id) push_back_free(id);
  hash_head_.reserve(n);
}

double BlockPool::usage() const { return static_cast<double>(num_used_blocks()) / num_usable_blocks(); }

void BlockPool::push_back_free(int32_t id) {
  const int32_t sentinel = num_blocks_;
  const int32_t last = prev_free_[sentinel];
  next_free_[last] = id;
  prev_free_[id] = last;
  next_free_[id] = sentinel;
  prev_free_[sentinel] = id;
  ++num_free_;
}

void BlockPool::unlink_free(int32_t id) {
  next_free_[prev_free_[id]] = next_free_[id];
  prev_free_[next_free_[id]] = prev_free_[id];
  prev_free_[id] = next_free_[id] = -1;
  --num_free_;
}

void BlockPool::allocate(int n, std::vector<int32_t>& out) {
  OCTAVO_CHECK(n <= num_free_, "cannot allocate " << n << " KV blocks: only " << num_free_ << " are free");
  for (int i = 0; i < n; ++i) {
    const int32_t id = next_free_[num_blocks_];
    unlink_free(id);
    uncache_block(id);  // evict: the block is about to hold other tokens
    ref_[id] = 1;
    out.push_back(id);
  }
}

void BlockPool::touch(const int32_t* ids, int n) {
  for (int i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (ref_[id] == 0) unlink_free(id);
    ++ref_[id];
  }
}

void BlockPool::release(const int32_t* ids, int n) {
  for (int i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    OCTAVO_CHECK(id != kNullBlock && ref_[id] > 0, "released KV block " << id << " that is not in use");
    if (--ref_[id] == 0) push_back_free(id);
  }
}

void BlockPool::cache_block(int32_t id, uint64_t hash, const int32_t* tokens, uint64_t extra_key, int32_t parent,
                            int num_tokens, int group) {
  if (!enable_caching_ || cached_[id]) return;
  const int n = num_tokens < 0 ? block_size_ : num_tokens;
  OCTAVO_CHECK(n >= 1 && n <= block_size_, "a cached block holds 1 to " << block_size_ << " tokens, got " << n);
  cached_[id] = 1;
  hash_[id] = hash;
  extra_key_[id] = extra_key;
  parent_[id] = parent;
  parent_gen_[id] = generation_[parent];
  length_[id] = n;
  group_[id] = group;
  std::memcpy(&tokens_[static_cast<size_t>(id) * block_size_], tokens, sizeof(int32_t) * n);
  auto [it, inserted] = hash_head_.try_emplace(hash, id);
  next_same_hash_[id] = inserted ? -1 : it->second;
  it->second = id;
  ++num_cached_;
}

void BlockPool::uncache_block(int32_t id) {
  if (!cached_[id]) return;
  auto it = hash_head_.find(hash_[id]);
  if (it->second == id) {
    if (next_same_hash_[id] < 0) hash_head_.erase(it);
    else it->second = next_same_hash_[id];
  } else {
    int32_t prev = it->second;
    while (next_same_hash_[prev] != id) prev = next_same_hash_[prev];
    next_same_hash_[prev] = next_same_hash_[id];
  }
  next_same_hash_[id] = -1;
  cached_[id] = 0;
  ++generation_[id];  // children recorded the old generation, so they stop matching
  --num_cached_;
}

bool BlockPool::holds(int32_t id, const int32_t* tokens, uint64_t extra_key, int num_tokens, int group) const {
  return extra_key_[id] == extra_key && length_[id] == num_tokens && group_[id] == group &&
         std::memcmp(&tokens_[static_cast<size_t>(id) * block_size_], tokens, sizeof(int32_t) * num_tokens) == 0;
}

bool BlockPool::parent_matches(int32_t id, const std::vector<int32_t>& parents) const {
  const int32_t parent = parent_[id];
  if (parent_gen_[id] != generation_[parent]) return false;
  return std::find(parents.begin(), parents.end(), parent) != parents.end();
}

void BlockPool::find_cached(uint64_t hash, const int32_t* tokens, uint64_t extra_key,
                            const std::vector<int32_t>& parents, std::vector<int32_t>& out, int num_tokens,
                            int group) const {
  if (!enable_caching_) return;
  auto it = hash_head_.find(hash);
  if (it == hash_head_.end()) return;
  const int n = num_tokens < 0 ? block_size_ : num_tokens;
  for (int32_t id = it->second; id >= 0; id = next_same_hash_[id]) {
    if (hash_[id] == hash && holds(id, tokens, extra_key, n, group) && parent_matches(id, parents)) out.push_back(id);
  }
}

bool BlockPool::reset_prefix_cache() {
  if (num_used_blocks() > 0) return false;
  for (int32_t id = 1; id < num_blocks_; ++id) uncache_block(id);
  return true;
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> order;
  for (int32_t id = next_free_[num_blocks_]; id != num_blocks_; id = next_free_[id]) order.push_back(id);
  return order;
}

}  // namespace octavo
