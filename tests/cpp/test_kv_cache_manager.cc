// KVCacheManager: prefix lookup in whole blocks, all-or-nothing slot allocation, hashing of
// blocks as they fill (generated tokens included), and freeing.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "octavo/kv_cache_manager.h"
#include "octavo/request.h"
#include "test_util.h"

namespace {

using octavo::BlockPool;
using octavo::ComputedBlocks;
using octavo::KVCacheManager;
using octavo::Request;
using octavo_test::concat;
using octavo_test::expect_all_blocks_free;
using octavo_test::expect_pool_consistent;
using octavo_test::make_params;
using octavo_test::token_range;

Request make_request(const std::vector<int32_t>& prompt, uint64_t extra_key = 0) {
  static int64_t next = 1;
  octavo::RequestParams p = make_params("r" + std::to_string(next), prompt, 16);
  p.cache_extra_key = extra_key;
  const int64_t handle = next++;
  return Request(std::move(p), handle, handle);
}

// Looks up the prefix cache and allocates the rest of the request's known tokens, as the
// scheduler does for a new request; returns the number of computed (hit) tokens.
int admit(KVCacheManager& kv, Request& r) {
  ComputedBlocks hits = kv.get_computed_blocks(r);
  const bool ok = kv.allocate_slots(r, r.num_tokens() - hits.num_computed_tokens, &hits);
  EXPECT_TRUE(ok);
  if (!ok) return -1;
  r.num_computed_tokens = r.num_tokens();
  return hits.num_computed_tokens;
}

TEST(KVCacheManager, EmptyCacheHasNoHits) {
  KVCacheManager kv(10, 16, 256);
  Request r = make_request(token_range(40));
  ComputedBlocks hits = kv.get_computed_blocks(r);
  EXPECT_EQ(hits.num_computed_tokens, 0);
  EXPECT_TRUE(hits.block_ids.empty());
  expect_all_blocks_free(kv.pool());
}

// Stats count admissions (allocate_slots with a lookup result), in tokens; lookups alone and
// failed allocations count nothing.
TEST(KVCacheManager, StatsCountAdmittedLookupsInTokens) {
  KVCacheManager kv(6, 16, 256);  // 5 usable blocks
  const std::vector<int32_t> prompt = token_range(32);
  Request a = make_request(prompt);
  EXPECT_EQ(admit(kv, a), 0);
  Request b = make_request(concat(prompt, {7}));
  EXPECT_EQ(admit(kv, b), 32);
  EXPECT_EQ(kv.pool().stats().requests, 2);
  EXPECT_EQ(kv.pool().stats().queries, 32 + 33);
  EXPECT_EQ(kv.pool().stats().hits, 0 + 32);
  // A lookup alone records nothing.
  Request c = make_request(prompt);
  ComputedBlocks hc = kv.get_computed_blocks(c);
  EXPECT_EQ(hc.num_computed_tokens, 16);
  EXPECT_EQ(kv.pool().stats().requests, 2);
  EXPECT_EQ(kv.pool().stats().queries, 65);
  EXPECT_EQ(kv.pool().stats().hits, 32);
  // Neither does an allocation that fails (d needs 4 blocks, 2 are free).
  Request d = make_request(token_range(64, 5000));
  ComputedBlocks hd = kv.get_computed_blocks(d);
  EXPECT_FALSE(kv.allocate_slots(d, 64, &hd));
  EXPECT_EQ(kv.pool().stats().requests, 2);
  EXPECT_EQ(kv.pool().stats().queries, 65);
  // Allocations without a lookup result (decode steps) record nothing either.
  a.append_output_token(1);
  ASSERT_TRUE(kv.allocate_slots(a, 1));
  EXPECT_EQ(kv.pool().stats().requests, 2);
}

TEST(KVCacheManager, NumBlocksFor) {
  KVCacheManager kv(10, 16, 256);
  EXPECT_EQ(kv.num_blocks_for(0), 0);
  EXPECT_EQ(kv.num_blocks_for(1), 1);
  EXPECT_EQ(kv.num_blocks_for(16), 1);
  EXPECT_EQ(kv.num_blocks_for(17), 2);
  EXPECT_EQ(kv.block_size(), 16);
  EXPECT_EQ(kv.max_model_len(), 256);
}

TEST(KVCacheManager, FullHitNeverReportsEveryToken) {
  KVCacheManager kv(10, 16, 256);
  const std::vector<int32_t> prompt = token_range(32);
  Request a = make_request(prompt);
  EXPECT_EQ(admit(kv, a), 0);
  ASSERT_EQ(a.block_ids.size(), 2u);
  EXPECT_TRUE(kv.pool().is_cached(a.block_ids[0]));
  EXPECT_TRUE(kv.pool().is_cached(a.block_ids[1]));

  // Same 32 tokens: the last token must be recomputed, so only the first block counts.
  Request b = make_request(prompt);
  ComputedBlocks hb = kv.get_computed_blocks(b);
  EXPECT_EQ(hb.num_computed_tokens, 16);
  EXPECT_EQ(hb.block_ids, (std::vector<int32_t>{a.block_ids[0]}));
  // 33 tokens with the same first 32: both blocks count.
  Request c = make_request(concat(prompt, {7}));
  ComputedBlocks hc = kv.get_computed_blocks(c);
  EXPECT_EQ(hc.num_computed_tokens, 32);
  EXPECT_EQ(hc.block_ids, a.block_ids);
  // Lookups take no references.
  EXPECT_EQ(kv.pool().ref_count(a.block_ids[0]), 1);
  EXPECT_EQ(kv.pool().ref_count(a.block_ids[1]), 1);
  expect_pool_consistent(kv.pool());
}

TEST(KVCacheManager, ShortPromptsNeverHit) {
  KVCacheManager kv(10, 4, 64);
  Request a = make_request(token_range(4));
  admit(kv, a);
  EXPECT_TRUE(kv.pool().is_cached(a.block_ids[0]));
  Request b = make_request(token_range(4));
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
  Request c = make_request(token_range(1));
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 0);
}

TEST(KVCacheManager, SecondRequestSharesCachedBlocks) {
  KVCacheManager kv(10, 16, 256);
  const std::vector<int32_t> prompt = token_range(40);
  Request a = make_request(prompt);
  admit(kv, a);
  ASSERT_EQ(a.block_ids.size(), 3u);
  const int free_before = kv.pool().num_free_blocks();

  Request b = make_request(prompt);
  EXPECT_EQ(admit(kv, b), 32);
  ASSERT_EQ(b.block_ids.size(), 3u);
  EXPECT_EQ(b.block_ids[0], a.block_ids[0]);
  EXPECT_EQ(b.block_ids[1], a.block_ids[1]);
  EXPECT_NE(b.block_ids[2], a.block_ids[2]) << "a partial block must never be shared";
  EXPECT_EQ(kv.pool().ref_count(a.block_ids[0]), 2);
  EXPECT_EQ(kv.pool().ref_count(a.block_ids[1]), 2);
  EXPECT_EQ(kv.pool().ref_count(b.block_ids[2]), 1);
  EXPECT_EQ(kv.pool().num_free_blocks(), free_before - 1);
  expect_pool_consistent(kv.pool());

  kv.free(a);
  EXPECT_TRUE(a.block_ids.empty());
  EXPECT_EQ(kv.pool().ref_count(b.block_ids[0]), 1);
  EXPECT_EQ(kv.pool().ref_count(b.block_ids[1]), 1);
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, ExtraKeySeparatesCaches) {
  KVCacheManager kv(10, 16, 256);
  const std::vector<int32_t> prompt = token_range(40);
  Request a = make_request(prompt, /*extra_key=*/1);
  admit(kv, a);
  Request b = make_request(prompt, /*extra_key=*/2);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
  Request c = make_request(prompt, /*extra_key=*/0);
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 0);
  Request d = make_request(prompt, /*extra_key=*/1);
  EXPECT_EQ(kv.get_computed_blocks(d).num_computed_tokens, 32);
}


// A request that skips reading the cache computes its whole prompt, yet its blocks are still
// cached for the requests after it.
TEST(KVCacheManager, SkipReadingPrefixCacheStillWritesIt) {
  KVCacheManager kv(10, 16, 256);
  const std::vector<int32_t> prompt = token_range(40);
  Request a = make_request(prompt);
  admit(kv, a);
  octavo::RequestParams p = make_params("skipper", prompt, 16);
  p.skip_reading_prefix_cache = true;
  Request b(std::move(p), 1000, 1000);
  EXPECT_EQ(admit(kv, b), 0);
  kv.free(a);
  kv.free(b);
  Request c = make_request(prompt);
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 32);
}
TEST(KVCacheManager, HitStopsAtFirstDifferingBlock) {
  KVCacheManager kv(16, 4, 256);
  const std::vector<int32_t> prompt = token_range(13);  // 3 full blocks + 1
  Request a = make_request(prompt);
  admit(kv, a);
  std::vector<int32_t> second_differs = prompt;
  second_differs[5] = 9;  // block 1 differs; blocks 0 and 2 are equal to a's
  Request b = make_request(second_differs);
  ComputedBlocks hb = kv.get_computed_blocks(b);
  EXPECT_EQ(hb.num_computed_tokens, 4);
  EXPECT_EQ(hb.block_ids, (std::vector<int32_t>{a.block_ids[0]}));
  std::vector<int32_t> first_differs = prompt;
  first_differs[0] = 9;
  Request c = make_request(first_differs);
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 0);
}

TEST(KVCacheManager, AllocateSlotsCoversComputedNewAndLookahead) {
  KVCacheManager kv(32, 4, 256);
  Request r = make_request(token_range(10));
  ASSERT_TRUE(kv.allocate_slots(r, 6));  // first chunk: tokens 0..5
  EXPECT_EQ(r.block_ids.size(), 2u);
  EXPECT_EQ(r.num_cached_blocks, 1);
  EXPECT_TRUE(kv.pool().is_cached(r.block_ids[0]));
  EXPECT_FALSE(kv.pool().is_cached(r.block_ids[1]));
  r.num_computed_tokens = 6;
  ASSERT_TRUE(kv.allocate_slots(r, 2));  // tokens 6..7 fill block 1
  EXPECT_EQ(r.block_ids.size(), 2u);
  EXPECT_TRUE(kv.pool().is_cached(r.block_ids[1]));
  EXPECT_EQ(r.num_cached_blocks, 2);
  r.num_computed_tokens = 8;
  ASSERT_TRUE(kv.allocate_slots(r, 2, nullptr, /*num_lookahead_tokens=*/3));  // 13 slots
  EXPECT_EQ(r.block_ids.size(), 4u);
  EXPECT_FALSE(kv.pool().is_cached(r.block_ids[2])) << "block of unknown tokens was cached";
  EXPECT_EQ(r.num_cached_blocks, 2);
  for (int32_t id : r.block_ids) {
    EXPECT_NE(id, BlockPool::kNullBlock);
    EXPECT_EQ(kv.pool().ref_count(id), 1);
  }
  // Nothing new needed: no allocation.
  r.num_computed_tokens = 10;
  const int free_before = kv.pool().num_free_blocks();
  ASSERT_TRUE(kv.allocate_slots(r, 0));
  EXPECT_EQ(kv.pool().num_free_blocks(), free_before);
  EXPECT_EQ(r.block_ids.size(), 4u);
  kv.free(r);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, SlotsAreCappedAtMaxModelLen) {
  KVCacheManager kv(32, 4, /*max_model_len=*/12);
  Request r = make_request(token_range(10));
  ASSERT_TRUE(kv.allocate_slots(r, 10, nullptr, /*num_lookahead_tokens=*/8));
  EXPECT_EQ(r.block_ids.size(), 3u);
}

TEST(KVCacheManager, AllocateFailureChangesNothing) {
  KVCacheManager kv(5, 4, 64);  // usable blocks: 4
  Request a = make_request(token_range(9));
  admit(kv, a);  // 3 blocks, the first two cached
  ASSERT_EQ(a.block_ids.size(), 3u);
  const std::vector<int32_t> a_blocks = a.block_ids;
  kv.free(a);  // queue: [4, a2, a1, a0]

  Request other = make_request(token_range(3, 5000));
  admit(kv, other);  // takes block 4
  EXPECT_EQ(kv.pool().num_free_blocks(), 3);

  // b shares a's two cached blocks, then needs two more blocks (13 tokens): the hits sit in the
  // free queue, so only one block is really available.
  Request b = make_request(concat(token_range(8), token_range(5, 7000)));
  ComputedBlocks hits = kv.get_computed_blocks(b);
  ASSERT_EQ(hits.num_computed_tokens, 8);
  ASSERT_EQ(hits.block_ids, (std::vector<int32_t>{a_blocks[0], a_blocks[1]}));

  const std::vector<int32_t> queue_before = kv.pool().free_queue();
  const int cached_before = kv.pool().num_cached_blocks();
  EXPECT_FALSE(kv.allocate_slots(b, 5, &hits));
  EXPECT_EQ(kv.pool().free_queue(), queue_before);
  EXPECT_EQ(kv.pool().num_free_blocks(), 3);
  EXPECT_EQ(kv.pool().num_cached_blocks(), cached_before);
  EXPECT_TRUE(b.block_ids.empty());
  EXPECT_EQ(b.num_cached_blocks, 0);
  EXPECT_EQ(kv.pool().ref_count(a_blocks[0]), 0);
  EXPECT_EQ(kv.pool().ref_count(a_blocks[1]), 0);
  EXPECT_TRUE(kv.pool().is_cached(a_blocks[0]));
  EXPECT_TRUE(kv.pool().is_cached(a_blocks[1]));
  expect_pool_consistent(kv.pool());

  // With `other` gone there is exactly enough: two hits revived plus two new blocks.
  kv.free(other);
  ASSERT_TRUE(kv.allocate_slots(b, 5, &hits));
  EXPECT_EQ(b.block_ids.size(), 4u);
  EXPECT_EQ(b.block_ids[0], a_blocks[0]);
  EXPECT_EQ(b.block_ids[1], a_blocks[1]);
  EXPECT_EQ(kv.pool().num_free_blocks(), 0);
  expect_pool_consistent(kv.pool());
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, AllocateFailureOfRunningRequestChangesNothing) {
  KVCacheManager kv(4, 4, 64);  // usable blocks: 3
  Request a = make_request(token_range(8));
  admit(kv, a);  // 2 blocks
  Request b = make_request(token_range(4, 100));
  admit(kv, b);  // 1 block: pool full
  a.append_output_token(1);
  const std::vector<int32_t> a_blocks = a.block_ids;
  EXPECT_FALSE(kv.allocate_slots(a, 1));
  EXPECT_EQ(a.block_ids, a_blocks);
  EXPECT_EQ(kv.pool().num_free_blocks(), 0);
  for (int32_t id : a_blocks) EXPECT_EQ(kv.pool().ref_count(id), 1);
  expect_pool_consistent(kv.pool());
}

TEST(KVCacheManager, GeneratedTokensAreCachedAsBlocksFill) {
  KVCacheManager kv(32, 4, 256);
  const std::vector<int32_t> prompt = token_range(10);
  Request a = make_request(prompt);
  admit(kv, a);  // 10 computed; blocks 0, 1 cached
  EXPECT_EQ(a.num_cached_blocks, 2);
  // Decode: the sampled token is fed back in the next step.
  std::vector<int32_t> outputs;
  for (int32_t t : {501, 502, 503, 504}) {
    a.append_output_token(t);
    outputs.push_back(t);
    ASSERT_TRUE(kv.allocate_slots(a, 1));
    a.num_computed_tokens += 1;
  }
  // 14 tokens computed: blocks 0..2 hold known tokens 0..11.
  EXPECT_EQ(a.num_computed_tokens, 14);
  EXPECT_EQ(a.num_cached_blocks, 3);
  EXPECT_TRUE(kv.pool().is_cached(a.block_ids[2]));
  EXPECT_FALSE(kv.pool().is_cached(a.block_ids[3]));
  const std::vector<int32_t> a_blocks = a.block_ids;
  kv.free(a);

  // A new prompt equal to a's prompt + outputs hits the block that was filled by outputs.
  Request b = make_request(concat(prompt, outputs));
  ComputedBlocks hb = kv.get_computed_blocks(b);
  EXPECT_EQ(hb.num_computed_tokens, 12);
  EXPECT_EQ(hb.block_ids, (std::vector<int32_t>{a_blocks[0], a_blocks[1], a_blocks[2]}));
  // Different outputs share only the prompt's full blocks.
  Request c = make_request(concat(prompt, {501, 999, 503, 504}));
  EXPECT_EQ(kv.get_computed_blocks(c).num_computed_tokens, 8);
}

TEST(KVCacheManager, FreeReleasesLastBlockFirst) {
  KVCacheManager kv(8, 4, 64);
  Request r = make_request(token_range(11));
  admit(kv, r);
  const std::vector<int32_t> blocks = r.block_ids;
  ASSERT_EQ(blocks.size(), 3u);
  kv.free(r);
  EXPECT_TRUE(r.block_ids.empty());
  EXPECT_EQ(r.num_cached_blocks, 0);
  const std::vector<int32_t> queue = kv.pool().free_queue();
  ASSERT_GE(queue.size(), 3u);
  EXPECT_EQ(std::vector<int32_t>(queue.end() - 3, queue.end()), (std::vector<int32_t>{blocks[2], blocks[1], blocks[0]}));
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, EvictionTakesTailBeforeSharedPrefix) {
  KVCacheManager kv(5, 4, 64);  // usable blocks: 4
  const std::vector<int32_t> prompt = token_range(13);
  Request a = make_request(prompt);
  admit(kv, a);  // 4 blocks, 3 cached
  kv.free(a);
  Request x = make_request(token_range(2, 8000));
  admit(kv, x);  // takes a's uncached last block
  Request y = make_request(token_range(2, 9000));
  admit(kv, y);  // evicts a's third block
  Request b = make_request(prompt);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 8);
  kv.free(x);
  kv.free(y);
  EXPECT_EQ(admit(kv, b), 8);
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, EvictedPrefixIsNotFound) {
  KVCacheManager kv(4, 4, 64);  // usable blocks: 3
  const std::vector<int32_t> prompt = token_range(9);
  Request a = make_request(prompt);
  admit(kv, a);
  kv.free(a);
  Request x = make_request(token_range(12, 8000));
  admit(kv, x);  // every block, a's included, is rewritten
  kv.free(x);
  Request b = make_request(prompt);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
}

TEST(KVCacheManager, FreeWithValidTokensUncachesTheRest) {
  KVCacheManager kv(16, 4, 64);
  Request r = make_request(token_range(12));
  ASSERT_TRUE(kv.allocate_slots(r, 12));  // all 3 blocks cached at allocation
  const std::vector<int32_t> blocks = r.block_ids;
  for (int32_t id : blocks) EXPECT_TRUE(kv.pool().is_cached(id));
  kv.free(r, /*num_valid_tokens=*/5);  // only block 0 was actually computed
  EXPECT_TRUE(kv.pool().is_cached(blocks[0]));
  EXPECT_FALSE(kv.pool().is_cached(blocks[1]));
  EXPECT_FALSE(kv.pool().is_cached(blocks[2]));
  Request b = make_request(concat(token_range(12), {1}));
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 4);

  Request s = make_request(token_range(12, 300));
  ASSERT_TRUE(kv.allocate_slots(s, 12));
  const std::vector<int32_t> s_blocks = s.block_ids;
  kv.free(s, /*num_valid_tokens=*/8);  // block boundary: blocks 0 and 1 stay
  EXPECT_TRUE(kv.pool().is_cached(s_blocks[0]));
  EXPECT_TRUE(kv.pool().is_cached(s_blocks[1]));
  EXPECT_FALSE(kv.pool().is_cached(s_blocks[2]));
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, CachingDisabledNeverHits) {
  KVCacheManager kv(16, 4, 64, /*enable_caching=*/false);
  Request a = make_request(token_range(12));
  admit(kv, a);
  for (int32_t id : a.block_ids) EXPECT_FALSE(kv.pool().is_cached(id));
  Request b = make_request(token_range(12));
  ComputedBlocks hb = kv.get_computed_blocks(b);
  EXPECT_EQ(hb.num_computed_tokens, 0);
  EXPECT_TRUE(hb.block_ids.empty());
  kv.free(a);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, HitOnFreedBlocksRevivesThem) {
  KVCacheManager kv(8, 4, 64);
  const std::vector<int32_t> prompt = token_range(9);
  Request a = make_request(prompt);
  admit(kv, a);
  const std::vector<int32_t> a_blocks = a.block_ids;
  kv.free(a);
  const int free_before = kv.pool().num_free_blocks();
  Request b = make_request(prompt);
  EXPECT_EQ(admit(kv, b), 8);
  EXPECT_EQ(b.block_ids[0], a_blocks[0]);
  EXPECT_EQ(b.block_ids[1], a_blocks[1]);
  EXPECT_EQ(kv.pool().ref_count(a_blocks[0]), 1);
  EXPECT_EQ(kv.pool().ref_count(a_blocks[1]), 1);
  // Two revived from the free queue plus one new block.
  EXPECT_EQ(kv.pool().num_free_blocks(), free_before - 3);
  const std::vector<int32_t> queue = kv.pool().free_queue();
  EXPECT_EQ(std::count(queue.begin(), queue.end(), a_blocks[0]), 0);
  EXPECT_EQ(std::count(queue.begin(), queue.end(), a_blocks[1]), 0);
  expect_pool_consistent(kv.pool());
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

TEST(KVCacheManager, ResetPrefixCacheAfterAllFreed) {
  KVCacheManager kv(8, 4, 64);
  Request a = make_request(token_range(9));
  admit(kv, a);
  EXPECT_FALSE(kv.pool().reset_prefix_cache());
  kv.free(a);
  EXPECT_TRUE(kv.pool().reset_prefix_cache());
  Request b = make_request(token_range(9));
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
}

}  // namespace
