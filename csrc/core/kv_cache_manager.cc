#include "octavo/kv_cache_manager.h"

#include <algorithm>

#include "octavo/status.h"

namespace octavo {

KVCacheManager::KVCacheManager(int num_blocks, int block_size, int max_model_len, bool enable_caching)
    : pool_(num_blocks, block_size, enable_caching), max_model_len_(max_model_len) {
  OCTAVO_CHECK(max_model_len >= 1, "max_model_len must be positive, got " << max_model_len);
}

ComputedBlocks KVCacheManager::get_computed_blocks(Request& request) {
  ComputedBlocks result;
  if (!pool_.enable_caching() || request.params().skip_reading_prefix_cache) return result;
  const int bs = block_size();
  // The last token is recomputed even on a full hit, so at most num_tokens - 1 tokens count.
  const int max_blocks = (request.num_tokens() - 1) / bs;
  parents_.assign(1, BlockPool::kNullBlock);
  for (int i = 0; i < max_blocks; ++i) {
    matches_.clear();
    const int32_t* tokens = request.token_ids().data() + static_cast<size_t>(i) * bs;
    pool_.find_cached(request.block_hash(i, bs), tokens, request.params().cache_extra_key, parents_, matches_);
    if (matches_.empty()) break;
    result.block_ids.push_back(matches_.front());
    // Every match holds the same verified prefix, so any of them may parent the next block.
    parents_.swap(matches_);
  }
  result.num_computed_tokens = static_cast<int>(result.block_ids.size()) * bs;
  find_partial_block(request, result);
  return result;
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
  const int num_to_allocate = std::max(0, num_blocks_for(num_slots) - num_held);

  // Cache hits sitting in the free queue stop being free once touched.
  const int32_t partial = new_computed ? new_computed->partial_block : -1;
  int num_hits_in_free_queue = partial >= 0 && pool_.ref_count(partial) == 0;
  for (int i = 0; i < num_hit_blocks; ++i) num_hits_in_free_queue += pool_.ref_count(new_computed->block_ids[i]) == 0;
  if (num_to_allocate > pool_.num_free_blocks() - num_hits_in_free_queue) return false;

  if (new_computed && pool_.enable_caching()) {
    // Counted here, once per admission, not per lookup: a request at the head of the waiting
    // queue may be looked up every step until it fits.
    PrefixCacheStats& stats = pool_.stats();
    stats.requests += 1;
    stats.queries += request.num_tokens();
    stats.hits += new_computed->num_computed_tokens;
  }
  if (num_hit_blocks > 0) {
    pool_.touch(new_computed->block_ids.data(), num_hit_blocks);
    request.block_ids.insert(request.block_ids.end(), new_computed->block_ids.begin(), new_computed->block_ids.end());
    request.num_cached_blocks += num_hit_blocks;
  }
  if (partial >= 0) {  // held before allocating, which could otherwise evict it
    pool_.touch(&partial, 1);
    request.copy_src = partial;
    request.copy_dst = -1;
  }
  const size_t first_new = request.block_ids.size();
  pool_.allocate(num_to_allocate, request.block_ids);
  if (partial >= 0) request.copy_dst = request.block_ids[first_new];
  cache_full_blocks(request, std::min(num_computed + num_new_tokens, request.num_tokens()));
  return true;
}

void KVCacheManager::cache_full_blocks(Request& request, int num_tokens) {
  if (!pool_.enable_caching()) return;
  const int bs = block_size();
  const int num_full = num_tokens / bs;
  const uint64_t extra_key = request.params().cache_extra_key;
  for (int i = request.num_cached_blocks; i < num_full; ++i) {
    const int32_t parent = i == 0 ? BlockPool::kNullBlock : request.block_ids[i - 1];
    const int32_t* tokens = request.token_ids().data() + static_cast<size_t>(i) * bs;
    pool_.cache_block(request.block_ids[i], request.block_hash(i, bs), tokens, extra_key, parent);
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
  auto& ids = request.block_ids;
  if (num_valid_tokens >= 0) {
    for (size_t i = static_cast<size_t>(num_valid_tokens / block_size()); i < ids.size(); ++i) pool_.uncache_block(ids[i]);
  }
  if (pool_.enable_caching()) {
    const int valid = std::min(num_valid_tokens < 0 ? request.num_computed_tokens : num_valid_tokens,
                               request.num_computed_tokens);
    cache_full_blocks(request, valid);  // accepted draft tokens fill blocks that no schedule() has hashed
    cache_partial_block(request, valid);
  }
  std::reverse(ids.begin(), ids.end());
  pool_.release(ids.data(), static_cast<int>(ids.size()));
  ids.clear();
  request.num_cached_blocks = 0;
}

}  // namespace octavo
