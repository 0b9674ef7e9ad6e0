#include "octavo/kv_cache_manager.h"

#include <algorithm>

#include "octavo/status.h"

namespace octavo {

namespace {
const std::vector<int32_t> kNullParent{BlockPool::kNullBlock};  // the parent of every first block
}  // namespace

KVCacheManager::KVCacheManager(int num_blocks, int block_size, int max_model_len, bool enable_caching,
                               std::vector<int32_t> group_windows)
    : pool_(num_blocks, block_size, enable_caching), max_model_len_(max_model_len), windows_(std::move(group_windows)) {
  OCTAVO_CHECK(max_model_len >= 1, "max_model_len must be positive, got " << max_model_len);
  if (windows_.empty()) windows_.push_back(0);
  OCTAVO_CHECK(windows_[0] == 0, "KV group 0 must have full attention (window 0), got window " << windows_[0]);
  for (int32_t w : windows_) OCTAVO_CHECK(w >= 0, "a KV group's sliding window must be >= 0, got " << w);
  group_found_.resize(windows_.size());
}

int KVCacheManager::max_blocks_per_request(int num_tokens, int max_step_tokens) const {
  const int all = num_blocks_for(num_tokens);
  int total = 0;
  for (int32_t w : windows_) {
    // A sliding group holds the blocks over the window before a step's first token, one more
    // where the window starts inside a block, and those the step's tokens fill.
    total += w == 0 ? all : std::min(all, num_blocks_for(w - 1 + max_step_tokens) + 1);
  }
  return total;
}

ComputedBlocks KVCacheManager::get_computed_blocks(Request& request) {
  ComputedBlocks result;
  if (!pool_.enable_caching() || request.params().skip_reading_prefix_cache) return result;
  const int bs = block_size();
  // The last token is recomputed even on a full hit, so at most num_tokens - 1 tokens count.
  const int max_blocks = (request.num_tokens() - 1) / bs;
  const bool hybrid = num_groups() > 1;
  if (hybrid && static_cast<int>(level_matches_.size()) < max_blocks) level_matches_.resize(max_blocks);
  parents_.assign(1, BlockPool::kNullBlock);
  for (int i = 0; i < max_blocks; ++i) {
    matches_.clear();
    const int32_t* tokens = request.token_ids().data() + static_cast<size_t>(i) * bs;
    pool_.find_cached(request.block_hash(i, bs), tokens, request.params().cache_extra_key, parents_, matches_);
    if (matches_.empty()) break;
    result.block_ids.push_back(matches_.front());
    if (hybrid) level_matches_[i] = matches_;
    // Every match holds the same verified prefix, so any of them may parent the next block.
    parents_.swap(matches_);
  }
  result.num_computed_tokens = static_cast<int>(result.block_ids.size()) * bs;
  if (hybrid) {
    find_group_hits(request, result);
  } else {
    find_partial_block(request, result);
  }
  return result;
}

void KVCacheManager::find_group_hits(Request& request, ComputedBlocks& result) {
  int m = static_cast<int>(result.block_ids.size());
  for (int g = 1; g < num_groups(); ++g) group_found_[g].assign(m, -2);
  // The longest hit every group has. A group missing block i at hit length m misses it at every
  // length between i and m too (their windows start no later), so the search goes on from i.
  for (bool covered = false; !covered && m > 0;) {
    covered = true;
    for (int g = 1; g < num_groups() && covered; ++g) {
      const int miss = last_group_miss(request, g, m);
      if (miss >= 0) m = miss, covered = false;
    }
  }
  result.block_ids.resize(m);
  result.num_computed_tokens = m * block_size();
  result.group_block_ids.assign(num_groups() - 1, {});
  for (int g = 1; g < num_groups(); ++g) {
    std::vector<int32_t>& ids = result.group_block_ids[g - 1];
    ids.assign(m, BlockPool::kNullBlock);
    for (int i = first_needed_block(g, result.num_computed_tokens); i < m; ++i) ids[i] = group_found_[g][i];
  }
}

int KVCacheManager::last_group_miss(Request& request, int group, int num_blocks) {
  for (int i = num_blocks - 1; i >= first_needed_block(group, num_blocks * block_size()); --i) {
    if (find_group_block(request, group, i) < 0) return i;
  }
  return -1;
}

int32_t KVCacheManager::find_group_block(Request& request, int group, int i) {
  int32_t& found = group_found_[group][i];
  if (found != -2) return found;
  const int bs = block_size();
  matches_.clear();
  // Cached with group 0's block before it as parent, which the verified chain found.
  pool_.find_cached(request.block_hash(i, bs), request.token_ids().data() + static_cast<size_t>(i) * bs,
                    request.params().cache_extra_key, i == 0 ? kNullParent : level_matches_[i - 1], matches_, -1,
                    group);
  found = matches_.empty() ? -1 : matches_.front();
  return found;
}

void KVCacheManager::find_partial_block(Request& request, ComputedBlocks& result) {
  // parents_ holds the candidates for the parent of the block after the matched ones.
  const int bs = block_size();
  const int i = static_cast<int>(result.block_ids.size());
  const int32_t* tokens = request.token_ids().data() + static_cast<size_t>(i) * bs;
  for (int n = std::min(bs - 1, request.num_tokens() - 1 - i * bs); n >= 1; --n) {
    matches_.clear();
    pool_.find_cached(request.partial_block_hash(i, n, bs), tokens, request.params().cache_extra_key, parents_,
                      matches_, n);
    if (!matches_.empty()) {
      result.partial_block = matches_.front();
      result.num_partial_tokens = n;
      result.num_computed_tokens += n;
      return;
    }
  }
}

bool KVCacheManager::allocate_slots(Request& request, int num_new_tokens, const ComputedBlocks* new_computed,
                                    int num_lookahead_tokens) {
  OCTAVO_CHECK(num_new_tokens >= 0 && num_lookahead_tokens >= 0,
               "allocate_slots needs non-negative token counts, got " << num_new_tokens << " and " << num_lookahead_tokens);
  const int num_hit_blocks = new_computed ? static_cast<int>(new_computed->block_ids.size()) : 0;
  const int num_computed = request.num_computed_tokens + (new_computed ? new_computed->num_computed_tokens : 0);
  const int num_slots = std::min(num_computed + num_new_tokens + num_lookahead_tokens, max_model_len_);
  const int num_held = static_cast<int>(request.block_ids.size()) + num_hit_blocks;
  const int length = std::max(num_held, num_blocks_for(num_slots));  // of every block table after
  if (num_groups() > 1) {
    request.group_block_ids.resize(num_groups() - 1);
    if (request.num_steps_in_flight == 0) release_out_of_window(request, num_computed);
  }
  int num_to_allocate = length - num_held;
  for (int g = 1; g < num_groups(); ++g) {
    num_to_allocate += std::max(0, length - std::max(num_held, first_needed_block(g, num_computed)));
  }
  // Cache hits sitting in the free queue stop being free once touched.
  const int32_t partial = new_computed ? new_computed->partial_block : -1;
  const int num_hits_free = new_computed ? num_hits_in_free_queue(*new_computed) : 0;
  if (num_to_allocate > pool_.num_free_blocks() - num_hits_free) return false;

  if (new_computed && pool_.enable_caching()) {
    // Counted here, once per admission, not per lookup: a request at the head of the waiting
    // queue may be looked up every step until it fits.
    PrefixCacheStats& stats = pool_.stats();
    stats.requests += 1;
    stats.queries += request.num_tokens();
    stats.hits += new_computed->num_computed_tokens;
  }
  if (new_computed) adopt_hits(request, *new_computed);  // held before allocating, which could evict them
  const size_t first_new = request.block_ids.size();
  pool_.allocate(length - static_cast<int>(first_new), request.block_ids);
  if (partial >= 0) request.copy_dst = request.block_ids[first_new];
  extend_group_tables(request, length, num_computed);
  cache_full_blocks(request, std::min(num_computed + num_new_tokens, request.num_tokens()));
  return true;
}

int KVCacheManager::num_hits_in_free_queue(const ComputedBlocks& hits) const {
  int n = hits.partial_block >= 0 && pool_.ref_count(hits.partial_block) == 0;
  for (int32_t id : hits.block_ids) n += pool_.ref_count(id) == 0;
  for (const std::vector<int32_t>& ids : hits.group_block_ids) {
    for (int32_t id : ids) n += id != BlockPool::kNullBlock && pool_.ref_count(id) == 0;
  }
  return n;
}

void KVCacheManager::adopt_hits(Request& request, const ComputedBlocks& hits) {
  const int n = static_cast<int>(hits.block_ids.size());
  pool_.touch(hits.block_ids.data(), n);
  request.block_ids.insert(request.block_ids.end(), hits.block_ids.begin(), hits.block_ids.end());
  request.num_cached_blocks += n;
  for (size_t g = 0; g < hits.group_block_ids.size(); ++g) {
    std::vector<int32_t>& table = request.group_block_ids[g];
    for (int32_t id : hits.group_block_ids[g]) {
      if (id != BlockPool::kNullBlock) pool_.touch(&id, 1);
      table.push_back(id);
    }
  }
  if (hits.partial_block >= 0) {
    pool_.touch(&hits.partial_block, 1);
    request.copy_src = hits.partial_block;
    request.copy_dst = -1;
  }
}

void KVCacheManager::extend_group_tables(Request& request, int length, int num_computed) {
  for (int g = 1; g < num_groups(); ++g) {
    std::vector<int32_t>& ids = request.block_table(g);
    // Blocks before the window are never written or read: the null block stands for them.
    const int first = std::min(first_needed_block(g, num_computed), length);
    while (static_cast<int>(ids.size()) < first) ids.push_back(BlockPool::kNullBlock);
    pool_.allocate(length - static_cast<int>(ids.size()), ids);
  }
}

void KVCacheManager::release_out_of_window(Request& request, int num_computed) {
  for (int g = 1; g < num_groups(); ++g) {
    std::vector<int32_t>& ids = request.block_table(g);
    const int end = std::min(first_needed_block(g, num_computed), static_cast<int>(ids.size()));
    // The null blocks are a prefix of the table: walk back from the window's start to them.
    int begin = end;
    while (begin > 0 && ids[begin - 1] != BlockPool::kNullBlock) --begin;
    if (begin == end) continue;
    // Oldest first: released blocks stay cached, and the oldest is evicted first.
    pool_.release(ids.data() + begin, end - begin);
    std::fill(ids.begin() + begin, ids.begin() + end, BlockPool::kNullBlock);
  }
}

void KVCacheManager::cache_full_blocks(Request& request, int num_tokens) {
  if (!pool_.enable_caching()) return;
  const int bs = block_size();
  const int num_full = num_tokens / bs;
  const uint64_t extra_key = request.params().cache_extra_key;
  for (int i = request.num_cached_blocks; i < num_full; ++i) {
    const int32_t parent = i == 0 ? BlockPool::kNullBlock : request.block_ids[i - 1];
    const int32_t* tokens = request.token_ids().data() + static_cast<size_t>(i) * bs;
    const uint64_t hash = request.block_hash(i, bs);
    pool_.cache_block(request.block_ids[i], hash, tokens, extra_key, parent);
    for (int g = 1; g < num_groups(); ++g) {
      const int32_t id = request.block_table(g)[i];
      if (id != BlockPool::kNullBlock) pool_.cache_block(id, hash, tokens, extra_key, parent, -1, g);
    }
  }
  request.num_cached_blocks = std::max(request.num_cached_blocks, num_full);
}

void KVCacheManager::cache_partial_block(Request& request, int num_valid_tokens) {
  const int bs = block_size();
  const int i = num_valid_tokens / bs, n = num_valid_tokens % bs;
  if (n == 0 || i >= static_cast<int>(request.block_ids.size())) return;
  const int32_t parent = i == 0 ? BlockPool::kNullBlock : request.block_ids[i - 1];
  if (i > 0 && !pool_.is_cached(parent)) return;  // unreachable by any lookup
  pool_.cache_block(request.block_ids[i], request.partial_block_hash(i, n, bs),
                    request.token_ids().data() + static_cast<size_t>(i) * bs, request.params().cache_extra_key, parent,
                    n);
}

void KVCacheManager::free(Request& request, int num_valid_tokens) {
  const int groups = std::min(num_groups(), 1 + static_cast<int>(request.group_block_ids.size()));
  const int length = static_cast<int>(request.block_ids.size());
  if (num_valid_tokens >= 0) {
    for (int g = 0; g < groups; ++g) {
      const std::vector<int32_t>& ids = request.block_table(g);
      for (int i = num_valid_tokens / block_size(); i < length; ++i) {
        if (ids[i] != BlockPool::kNullBlock) pool_.uncache_block(ids[i]);
      }
    }
  }
  if (pool_.enable_caching()) {
    const int valid = std::min(num_valid_tokens < 0 ? request.num_computed_tokens : num_valid_tokens,
                               request.num_computed_tokens);
    cache_full_blocks(request, valid);  // accepted draft tokens fill blocks that no schedule() has hashed
    if (num_groups() == 1) cache_partial_block(request, valid);
  }
  to_release_.clear();
  for (int i = length - 1; i >= 0; --i) {
    for (int g = 0; g < groups; ++g) {
      const int32_t id = request.block_table(g)[i];
      if (id != BlockPool::kNullBlock) to_release_.push_back(id);
    }
  }
  pool_.release(to_release_.data(), static_cast<int>(to_release_.size()));
  request.block_ids.clear();
  for (std::vector<int32_t>& ids : request.group_block_ids) ids.clear();
  request.num_cached_blocks = 0;
}

}  // namespace octavo
