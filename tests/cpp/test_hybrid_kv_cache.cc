// KVCacheManager with KV groups of full and sliding-window attention (hybrid models): one block
// table per group, sliding groups giving back the blocks their window left, prefix-cache hits
// that every group must have, and the scheduler's per-group block tables and slot mappings.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "octavo/kv_cache_manager.h"
#include "octavo/request.h"
#include "octavo/scheduler.h"
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

constexpr int32_t kNull = BlockPool::kNullBlock;

Request make_request(const std::vector<int32_t>& prompt) {
  static int64_t next = 1;
  const int64_t handle = next++;
  return Request(make_params("h" + std::to_string(handle), prompt, 64), handle, handle);
}

// Looks up the cache and allocates the rest of the prompt at once; returns the hit in tokens.
int admit(KVCacheManager& kv, Request& r) {
  ComputedBlocks hits = kv.get_computed_blocks(r);
  EXPECT_TRUE(kv.allocate_slots(r, r.num_tokens() - hits.num_computed_tokens, &hits));
  r.num_computed_tokens = r.num_tokens();
  return hits.num_computed_tokens;
}

// One decode step: the newest token gets its slot, then counts as computed.
void decode(KVCacheManager& kv, Request& r, int32_t token) {
  r.append_output_token(token);
  ASSERT_TRUE(kv.allocate_slots(r, 1));
  r.num_computed_tokens = r.num_tokens();
}

// Computes `prompt` as one request of a two-group cache, then frees it (its blocks stay cached);
// returns its block tables.
std::vector<std::vector<int32_t>> cache_prompt(KVCacheManager& kv, const std::vector<int32_t>& prompt) {
  Request r = make_request(prompt);
  admit(kv, r);
  std::vector<std::vector<int32_t>> tables{r.block_ids, r.block_table(1)};
  kv.free(r);
  return tables;
}

int num_held(const Request& r, int num_groups) {
  int n = 0;
  for (int g = 0; g < num_groups; ++g) {
    for (int32_t id : r.block_table(g)) n += id != kNull;
  }
  return n;
}

TEST(HybridKVCache, GroupWindowsAreChecked) {
  EXPECT_OCTAVO_ERROR(KVCacheManager(16, 16, 256, true, {32, 0}), octavo::ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(KVCacheManager(16, 16, 256, true, {0, -1}), octavo::ErrorKind::kValue);
  KVCacheManager one(16, 16, 256);
  EXPECT_EQ(one.num_groups(), 1);
}

// Every group's table is as long as group 0's; a sliding group allocates every block a prompt
// step writes, then gives back those no later token's window reaches.
TEST(HybridKVCache, SlidingGroupReleasesWhatItsWindowLeft) {
  KVCacheManager kv(64, 16, 512, true, {0, 32});
  Request r = make_request(token_range(100));
  EXPECT_EQ(admit(kv, r), 0);
  ASSERT_EQ(r.block_ids.size(), 7u);
  ASSERT_EQ(r.block_table(1).size(), 7u);
  for (int32_t id : r.block_table(1)) EXPECT_NE(id, kNull);
  const std::vector<int32_t> first = r.block_table(1);

  decode(kv, r, 5);  // token 100 attends to keys 69..100: blocks 4.. of group 1
  EXPECT_EQ(kv.first_needed_block(1, 100), 4);
  EXPECT_EQ(r.block_table(1), (std::vector<int32_t>{kNull, kNull, kNull, kNull, first[4], first[5], first[6]}));
  EXPECT_EQ(num_held(r, 2), 10);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(kv.pool().ref_count(first[i]), 0);
    EXPECT_TRUE(kv.pool().is_cached(first[i])) << "a released full block stays evictable";
  }
  // The released blocks joined the free queue oldest first: the oldest is evicted first.
  const std::vector<int32_t> queue = kv.pool().free_queue();
  EXPECT_EQ(std::vector<int32_t>(queue.end() - 4, queue.end()), std::vector<int32_t>(first.begin(), first.begin() + 4));
  expect_pool_consistent(kv.pool());
  kv.free(r);
  expect_all_blocks_free(kv.pool());
}

// Over a long generation a sliding group holds at most the window's blocks plus the newest.
TEST(HybridKVCache, SlidingGroupHoldsOnlyItsWindowWhileDecoding) {
  KVCacheManager kv(64, 16, 1024, true, {0, 40, 40});
  Request r = make_request(token_range(20));
  admit(kv, r);
  for (int t = 0; t < 300; ++t) {
    decode(kv, r, t);
    for (int g = 1; g < 3; ++g) {
      int held = 0;
      for (int32_t id : r.block_table(g)) held += id != kNull;
      EXPECT_LE(held, 40 / 16 + 2) << "group " << g << " at " << r.num_tokens() << " tokens";
      EXPECT_EQ(r.block_table(g).size(), r.block_ids.size());
    }
    expect_pool_consistent(kv.pool());
  }
  EXPECT_EQ(r.block_ids.size(), 20u);  // 320 tokens: group 0 keeps everything
  kv.free(r);
  expect_all_blocks_free(kv.pool());
}

// A later request hits group 0's chain and the sliding group's blocks over the window before
// the hit point; the sliding group's earlier blocks stay null.
TEST(HybridKVCache, PrefixHitTakesTheWindowBlocksOfEachGroup) {
  KVCacheManager kv(64, 16, 512, true, {0, 32});
  const std::vector<int32_t> prompt = token_range(100);
  const std::vector<std::vector<int32_t>> a = cache_prompt(kv, prompt);
  const std::vector<int32_t>& a0 = a[0];
  const std::vector<int32_t>& a1 = a[1];

  Request b = make_request(concat(prompt, token_range(20, 500)));
  EXPECT_EQ(admit(kv, b), 96);  // 6 full blocks; token 96 needs keys from 65: blocks 4 and 5
  EXPECT_EQ(std::vector<int32_t>(b.block_ids.begin(), b.block_ids.begin() + 6),
            std::vector<int32_t>(a0.begin(), a0.begin() + 6));
  const std::vector<int32_t>& b1 = b.block_table(1);
  EXPECT_EQ(std::vector<int32_t>(b1.begin(), b1.begin() + 6),
            (std::vector<int32_t>{kNull, kNull, kNull, kNull, a1[4], a1[5]}));
  EXPECT_EQ(b1.size(), b.block_ids.size());
  for (size_t i = 6; i < b1.size(); ++i) EXPECT_NE(b1[i], kNull);
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

// A sliding group missing a block over the window shortens the hit to where every group has
// what it needs (and its own blocks are never taken for another group's).
TEST(HybridKVCache, MissingWindowBlockShortensTheHit) {
  KVCacheManager kv(64, 16, 512, true, {0, 32});
  const std::vector<int32_t> prompt = token_range(100);
  const std::vector<int32_t> a1 = cache_prompt(kv, prompt)[1];
  kv.pool().uncache_block(a1[4]);  // as if evicted

  // 5 blocks of group 0 match; at 80 tokens the window needs group 1's blocks 3 and 4.
  Request b = make_request(concat(std::vector<int32_t>(prompt.begin(), prompt.begin() + 85), {9999}));
  ComputedBlocks hits = kv.get_computed_blocks(b);
  EXPECT_EQ(hits.num_computed_tokens, 64);  // at 64: blocks 2 and 3
  ASSERT_EQ(hits.group_block_ids.size(), 1u);
  EXPECT_EQ(hits.group_block_ids[0], (std::vector<int32_t>{kNull, kNull, a1[2], a1[3]}));
  EXPECT_EQ(hits.block_ids.size(), 4u);
  EXPECT_EQ(hits.partial_block, -1);  // partial-block hits are for one-group models

  kv.pool().uncache_block(a1[3]);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 48);  // at 48: blocks 1 and 2
  kv.pool().uncache_block(a1[1]);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 16);  // at 16: block 0
  kv.pool().uncache_block(a1[0]);
  EXPECT_EQ(kv.get_computed_blocks(b).num_computed_tokens, 0);
}

// Allocation counts every group's new blocks against the free ones, and a refusal leaves the
// tables as they were.
TEST(HybridKVCache, AllocationCountsEveryGroup) {
  KVCacheManager kv(16, 16, 512, true, {0, 16, 16});  // 15 usable blocks
  Request a = make_request(token_range(80));  // 5 blocks in each of 3 groups
  admit(kv, a);
  EXPECT_EQ(kv.pool().num_free_blocks(), 0);
  Request b = make_request(token_range(8, 900));
  ComputedBlocks hits = kv.get_computed_blocks(b);
  EXPECT_FALSE(kv.allocate_slots(b, 8, &hits));
  EXPECT_TRUE(b.block_ids.empty());
  // a's next step gives back 4 blocks in each sliding group and needs 1 in every group.
  decode(kv, a, 1);
  EXPECT_EQ(kv.pool().num_free_blocks(), 8 - 3);
  EXPECT_TRUE(kv.allocate_slots(b, 8, &hits));
  kv.free(a);
  kv.free(b);
  expect_all_blocks_free(kv.pool());
}

// Freeing with valid tokens uncaches every group's blocks past them.
TEST(HybridKVCache, FreeUncachesEveryGroupPastValidTokens) {
  KVCacheManager kv(64, 16, 512, true, {0, 64});
  Request a = make_request(token_range(64));
  admit(kv, a);
  const std::vector<int32_t> a0 = a.block_ids, a1 = a.block_table(1);
  kv.free(a, 32);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(kv.pool().is_cached(a0[i]), i < 2) << i;
    EXPECT_EQ(kv.pool().is_cached(a1[i]), i < 2) << i;
  }
  expect_all_blocks_free(kv.pool());
}

// The scheduler's output: group 1's block table and slot mapping beside group 0's; admission
// counts what a request holds at most in all groups.
TEST(HybridKVCache, SchedulerFillsEveryGroupsTables) {
  octavo::SchedulerConfig config;
  config.num_blocks = 40;
  config.block_size = 4;
  config.max_model_len = 256;
  config.max_num_batched_tokens = 8;
  config.kv_group_windows = {0, 6};
  octavo::Scheduler s(config);
  s.add_request(make_params("a", token_range(21), 30));
  for (int step = 0; step < 12; ++step) {
    const octavo::SchedulerOutput& out = s.schedule();
    ASSERT_EQ(out.num_kv_groups, 2);
    ASSERT_EQ(out.num_reqs(), 1);
    const int width = out.block_table_width, tokens = out.total_num_scheduled_tokens();
    ASSERT_EQ(static_cast<int>(out.group_block_tables.size()), width);
    ASSERT_EQ(static_cast<int>(out.group_slot_mappings.size()), tokens);
    for (int t = 0; t < tokens; ++t) {
      const int pos = out.positions[t];
      const int32_t id = out.group_block_tables[pos / 4];
      EXPECT_NE(id, kNull) << "position " << pos;
      EXPECT_EQ(out.group_slot_mappings[t], id * 4 + pos % 4);
      EXPECT_EQ(out.slot_mapping[t], out.block_table[pos / 4] * 4 + pos % 4);
    }
    // Keys from position - 5 on are in blocks the table still holds.
    const int first_key = std::max(0, out.positions[0] - 5);
    for (int i = first_key / 4; i < width; ++i) EXPECT_NE(out.group_block_tables[i], kNull);
    const int32_t token = 7;
    s.update_from_output(&token);
  }
  // Admission counts every group: 38 blocks of group 0 fit the 39 usable, not with group 1's 5.
  EXPECT_OCTAVO_ERROR(s.add_request(make_params("b", token_range(150), 1)), octavo::ErrorKind::kValue);
}

}  // namespace
