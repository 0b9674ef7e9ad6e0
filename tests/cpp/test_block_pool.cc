// BlockPool: reference counts, LRU free queue, prefix cache with verified hits.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "octavo/block_pool.h"
#include "test_util.h"

namespace {

using octavo::BlockPool;
using octavo::ErrorKind;
using octavo_test::expect_all_blocks_free;
using octavo_test::expect_pool_consistent;
using octavo_test::token_range;

constexpr int kBs = 4;

std::vector<int32_t> find(const BlockPool& pool, uint64_t hash, const std::vector<int32_t>& tokens, uint64_t extra,
                          const std::vector<int32_t>& parents) {
  std::vector<int32_t> out;
  pool.find_cached(hash, tokens.data(), extra, parents, out);
  return out;
}

std::vector<int32_t> alloc(BlockPool& pool, int n) {
  std::vector<int32_t> out;
  pool.allocate(n, out);
  return out;
}

TEST(BlockPool, FreshPoolExcludesNullBlock) {
  BlockPool pool(8, kBs);
  EXPECT_EQ(pool.num_blocks(), 8);
  EXPECT_EQ(pool.block_size(), kBs);
  EXPECT_EQ(pool.num_usable_blocks(), 7);
  EXPECT_EQ(pool.num_free_blocks(), 7);
  EXPECT_EQ(pool.num_used_blocks(), 0);
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  EXPECT_DOUBLE_EQ(pool.usage(), 0.0);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7}));
  expect_all_blocks_free(pool);
}

TEST(BlockPool, RejectsBadConstruction) {
  EXPECT_OCTAVO_ERROR(BlockPool(1, kBs), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(BlockPool(8, 0), ErrorKind::kValue);
}

TEST(BlockPool, AllocatingEveryBlockNeverHandsOutNull) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> ids = alloc(pool, 5);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 3, 4, 5}));
  for (int32_t id : ids) EXPECT_EQ(pool.ref_count(id), 1);
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_EQ(pool.num_used_blocks(), 5);
  EXPECT_DOUBLE_EQ(pool.usage(), 1.0);
  EXPECT_TRUE(pool.free_queue().empty());
  expect_pool_consistent(pool);
}

TEST(BlockPool, AllocateMoreThanFreeThrowsWithoutSideEffects) {
  BlockPool pool(4, kBs);
  std::vector<int32_t> out = alloc(pool, 2);
  EXPECT_OCTAVO_ERROR(pool.allocate(2, out), ErrorKind::kValue);
  EXPECT_EQ(out.size(), 2u);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{3}));
  expect_pool_consistent(pool);
}

TEST(BlockPool, AllocateAppendsToOutput) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> out = {42};
  pool.allocate(2, out);
  EXPECT_EQ(out, (std::vector<int32_t>{42, 1, 2}));
  pool.allocate(0, out);
  EXPECT_EQ(out.size(), 3u);
}

TEST(BlockPool, ReleaseAppendsInGivenOrderAndAllocateTakesFront) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> ids = alloc(pool, 5);
  const std::vector<int32_t> order = {4, 2, 5, 1, 3};
  pool.release(order.data(), static_cast<int>(order.size()));
  EXPECT_EQ(pool.free_queue(), order);
  expect_all_blocks_free(pool);
  // LRU: the first released is the first reused.
  EXPECT_EQ(alloc(pool, 2), (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{5, 1, 3}));
}

TEST(BlockPool, SharedBlockReturnsToQueueOnlyAtZero) {
  BlockPool pool(4, kBs);
  std::vector<int32_t> ids = alloc(pool, 1);
  const int32_t b = ids[0];
  pool.touch(&b, 1);
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.release(&b, 1);
  EXPECT_EQ(pool.ref_count(b), 1);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.release(&b, 1);
  EXPECT_EQ(pool.ref_count(b), 0);
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.free_queue().back(), b);
  expect_all_blocks_free(pool);
}

TEST(BlockPool, ReleasingUnusedBlockThrows) {
  BlockPool pool(4, kBs);
  const int32_t free_block = 2;
  EXPECT_OCTAVO_ERROR(pool.release(&free_block, 1), ErrorKind::kValue);
  const int32_t null_block = BlockPool::kNullBlock;
  EXPECT_OCTAVO_ERROR(pool.release(&null_block, 1), ErrorKind::kValue);
  expect_all_blocks_free(pool);
}

TEST(BlockPool, TouchRemovesZeroCountBlockFromQueueMiddle) {
  BlockPool pool(5, kBs);
  std::vector<int32_t> ids = alloc(pool, 4);
  const std::vector<int32_t> order = {2, 1, 4, 3};
  pool.release(order.data(), 4);
  const int32_t hit = 4;  // in the middle of the queue
  pool.touch(&hit, 1);
  EXPECT_EQ(pool.ref_count(4), 1);
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{2, 1, 3}));
  expect_pool_consistent(pool);
  // Released again it goes to the back: most recently used.
  pool.release(&hit, 1);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{2, 1, 3, 4}));
  // Touching front and back keeps the list intact.
  const std::vector<int32_t> ends = {2, 4};
  pool.touch(ends.data(), 2);
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(alloc(pool, 2), (std::vector<int32_t>{1, 3}));
  EXPECT_TRUE(pool.free_queue().empty());
  expect_pool_consistent(pool);
}

TEST(BlockPool, HashIsDeterministicAndChained) {
  const std::vector<int32_t> t = token_range(kBs, 7);
  const uint64_t h = octavo::hash_block_tokens(0, t.data(), kBs, 0);
  EXPECT_EQ(h, octavo::hash_block_tokens(0, t.data(), kBs, 0));
  EXPECT_NE(h, octavo::hash_block_tokens(1, t.data(), kBs, 0)) << "parent hash ignored";
  EXPECT_NE(h, octavo::hash_block_tokens(h, t.data(), kBs, 0)) << "parent hash ignored";
  EXPECT_NE(h, octavo::hash_block_tokens(0, t.data(), kBs, 1)) << "extra key ignored";
  for (int i = 0; i < kBs; ++i) {
    std::vector<int32_t> changed = t;
    changed[static_cast<size_t>(i)] += 1;
    EXPECT_NE(h, octavo::hash_block_tokens(0, changed.data(), kBs, 0)) << "token " << i << " ignored";
  }
  // Order matters, and the sign bit of a token matters.
  std::vector<int32_t> swapped = {t[1], t[0], t[2], t[3]};
  EXPECT_NE(h, octavo::hash_block_tokens(0, swapped.data(), kBs, 0));
  std::vector<int32_t> neg = t;
  neg[0] = -neg[0];
  EXPECT_NE(h, octavo::hash_block_tokens(0, neg.data(), kBs, 0));
}

TEST(BlockPool, HashHasNoCollisionsOnSmallVariations) {
  std::set<uint64_t> seen;
  int n = 0;
  for (int32_t a = 0; a < 40; ++a) {
    for (int32_t b = 0; b < 40; ++b) {
      const int32_t tokens[2] = {a, b};
      seen.insert(octavo::hash_block_tokens(0, tokens, 2, 0));
      seen.insert(octavo::hash_block_tokens(static_cast<uint64_t>(a), tokens, 2, static_cast<uint64_t>(b) + 1));
      n += 2;
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), n);
}

TEST(BlockPool, CacheAndFindVerifiesTokensExtraKeyAndParent) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> t0 = token_range(kBs, 100), t1 = token_range(kBs, 200);
  const uint64_t h0 = octavo::hash_block_tokens(0, t0.data(), kBs, 9);
  const uint64_t h1 = octavo::hash_block_tokens(h0, t1.data(), kBs, 9);
  pool.cache_block(ids[0], h0, t0.data(), 9, BlockPool::kNullBlock);
  pool.cache_block(ids[1], h1, t1.data(), 9, ids[0]);
  EXPECT_TRUE(pool.is_cached(ids[0]));
  EXPECT_TRUE(pool.is_cached(ids[1]));
  EXPECT_EQ(pool.num_cached_blocks(), 2);

  EXPECT_EQ(find(pool, h0, t0, 9, {BlockPool::kNullBlock}), (std::vector<int32_t>{ids[0]}));
  EXPECT_EQ(find(pool, h1, t1, 9, {ids[0]}), (std::vector<int32_t>{ids[1]}));
  // Wrong extra key, wrong tokens, wrong parent, unknown hash: no hit.
  EXPECT_TRUE(find(pool, h0, t0, 8, {BlockPool::kNullBlock}).empty());
  std::vector<int32_t> other = t0;
  other[3] += 1;
  EXPECT_TRUE(find(pool, h0, other, 9, {BlockPool::kNullBlock}).empty());
  EXPECT_TRUE(find(pool, h1, t1, 9, {BlockPool::kNullBlock}).empty());
  EXPECT_TRUE(find(pool, h1, t1, 9, {ids[1]}).empty());
  EXPECT_TRUE(find(pool, h0, t0, 9, {ids[0]}).empty()) << "a first block matched a non-null parent";
  EXPECT_TRUE(find(pool, h0 ^ 1, t0, 9, {BlockPool::kNullBlock}).empty());
  // Any of several candidate parents may match.
  EXPECT_EQ(find(pool, h1, t1, 9, {5, ids[0]}), (std::vector<int32_t>{ids[1]}));
  // find_cached appends.
  std::vector<int32_t> out = {77};
  pool.find_cached(h0, t0.data(), 9, {BlockPool::kNullBlock}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{77, ids[0]}));
}

TEST(BlockPool, ForcedHashCollisionNeverConfusesBlocks) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> ids = alloc(pool, 3);
  const std::vector<int32_t> a = token_range(kBs, 1), b = token_range(kBs, 50), c = token_range(kBs, 90);
  const uint64_t h = 12345;  // the same hash for three different contents
  pool.cache_block(ids[0], h, a.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], h, b.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[2], h, c.data(), 0, BlockPool::kNullBlock);
  EXPECT_EQ(pool.num_cached_blocks(), 3);
  EXPECT_EQ(find(pool, h, a, 0, {0}), (std::vector<int32_t>{ids[0]}));
  EXPECT_EQ(find(pool, h, b, 0, {0}), (std::vector<int32_t>{ids[1]}));
  EXPECT_EQ(find(pool, h, c, 0, {0}), (std::vector<int32_t>{ids[2]}));
  const std::vector<int32_t> d = token_range(kBs, 500);
  EXPECT_TRUE(find(pool, h, d, 0, {0}).empty());

  // Removing the middle, then the first entry of the chain keeps the others findable.
  pool.uncache_block(ids[1]);
  EXPECT_TRUE(find(pool, h, b, 0, {0}).empty());
  EXPECT_EQ(find(pool, h, a, 0, {0}), (std::vector<int32_t>{ids[0]}));
  EXPECT_EQ(find(pool, h, c, 0, {0}), (std::vector<int32_t>{ids[2]}));
  pool.uncache_block(ids[0]);
  pool.uncache_block(ids[0]);  // no entry: no-op
  EXPECT_TRUE(find(pool, h, a, 0, {0}).empty());
  EXPECT_EQ(find(pool, h, c, 0, {0}), (std::vector<int32_t>{ids[2]}));
  pool.uncache_block(ids[2]);
  EXPECT_TRUE(find(pool, h, c, 0, {0}).empty());
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  // The hash is usable again.
  pool.cache_block(ids[1], h, b.data(), 0, BlockPool::kNullBlock);
  EXPECT_EQ(find(pool, h, b, 0, {0}), (std::vector<int32_t>{ids[1]}));
}

TEST(BlockPool, IdenticalContentInTwoBlocksFindsBoth) {
  BlockPool pool(6, kBs);
  std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> t = token_range(kBs, 3);
  const uint64_t h = octavo::hash_block_tokens(0, t.data(), kBs, 0);
  pool.cache_block(ids[0], h, t.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], h, t.data(), 0, BlockPool::kNullBlock);
  std::vector<int32_t> hits = find(pool, h, t, 0, {0});
  std::sort(hits.begin(), hits.end());
  EXPECT_EQ(hits, ids);
}

TEST(BlockPool, CachedBlockStaysFindableAtZeroUntilEvicted) {
  BlockPool pool(4, kBs);  // usable: 1, 2, 3
  std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> t0 = token_range(kBs, 10), t1 = token_range(kBs, 20);
  const uint64_t h0 = octavo::hash_block_tokens(0, t0.data(), kBs, 0);
  const uint64_t h1 = octavo::hash_block_tokens(h0, t1.data(), kBs, 0);
  pool.cache_block(ids[0], h0, t0.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], h1, t1.data(), 0, ids[0]);
  pool.release(ids.data(), 2);  // queue: 3, 1, 2
  EXPECT_EQ(pool.free_queue(), (std::vector<int32_t>{3, 1, 2}));
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.num_cached_blocks(), 2);
  EXPECT_EQ(find(pool, h0, t0, 0, {0}), (std::vector<int32_t>{1}));
  EXPECT_EQ(find(pool, h1, t1, 0, {1}), (std::vector<int32_t>{2}));

  // Block 3 is uncached: allocating it evicts nothing.
  EXPECT_EQ(alloc(pool, 1), (std::vector<int32_t>{3}));
  EXPECT_EQ(pool.num_cached_blocks(), 2);
  // Block 1 (the parent) is evicted next.
  EXPECT_EQ(alloc(pool, 1), (std::vector<int32_t>{1}));
  EXPECT_FALSE(pool.is_cached(1));
  EXPECT_EQ(pool.num_cached_blocks(), 1);
  EXPECT_TRUE(find(pool, h0, t0, 0, {0}).empty());
  // The child keeps its entry but no longer matches its evicted parent, even when the parent
  // block is re-registered with the same tokens (its KV was rewritten: a new generation).
  EXPECT_TRUE(pool.is_cached(2));
  EXPECT_TRUE(find(pool, h1, t1, 0, {1}).empty());
  pool.cache_block(1, h0, t0.data(), 0, BlockPool::kNullBlock);
  EXPECT_EQ(find(pool, h0, t0, 0, {0}), (std::vector<int32_t>{1}));
  EXPECT_TRUE(find(pool, h1, t1, 0, {1}).empty()) << "child matched a parent from a later generation";
  expect_pool_consistent(pool);
}

TEST(BlockPool, UncacheParentInvalidatesChild) {
  BlockPool pool(4, kBs);
  std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> t0 = token_range(kBs, 10), t1 = token_range(kBs, 20);
  pool.cache_block(ids[0], 1, t0.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], 2, t1.data(), 0, ids[0]);
  pool.uncache_block(ids[0]);
  EXPECT_TRUE(find(pool, 2, t1, 0, {ids[0]}).empty());
}

TEST(BlockPool, TouchRevivesCachedBlockBeforeEviction) {
  BlockPool pool(3, kBs);  // usable: 1, 2
  std::vector<int32_t> ids = alloc(pool, 1);
  const std::vector<int32_t> t = token_range(kBs, 10);
  pool.cache_block(ids[0], 5, t.data(), 0, BlockPool::kNullBlock);
  pool.release(ids.data(), 1);  // queue: 2, 1
  std::vector<int32_t> hit = find(pool, 5, t, 0, {0});
  ASSERT_EQ(hit, ids);
  pool.touch(hit.data(), 1);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  // The remaining free block is handed out; the revived one keeps its entry.
  EXPECT_EQ(alloc(pool, 1), (std::vector<int32_t>{2}));
  EXPECT_TRUE(pool.is_cached(ids[0]));
  EXPECT_EQ(pool.ref_count(ids[0]), 1);
  expect_pool_consistent(pool);
}

TEST(BlockPool, CacheBlockTwiceKeepsFirstEntry) {
  BlockPool pool(4, kBs);
  std::vector<int32_t> ids = alloc(pool, 1);
  const std::vector<int32_t> a = token_range(kBs, 10), b = token_range(kBs, 20);
  pool.cache_block(ids[0], 1, a.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[0], 2, b.data(), 0, BlockPool::kNullBlock);
  EXPECT_EQ(pool.num_cached_blocks(), 1);
  EXPECT_EQ(find(pool, 1, a, 0, {0}), ids);
  EXPECT_TRUE(find(pool, 2, b, 0, {0}).empty());
}

TEST(BlockPool, ResetPrefixCacheRefusedWhileInUse) {
  BlockPool pool(4, kBs);
  std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> t0 = token_range(kBs, 10), t1 = token_range(kBs, 20);
  pool.cache_block(ids[0], 1, t0.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], 2, t1.data(), 0, ids[0]);
  EXPECT_FALSE(pool.reset_prefix_cache());
  EXPECT_EQ(pool.num_cached_blocks(), 2);
  EXPECT_EQ(find(pool, 1, t0, 0, {0}), (std::vector<int32_t>{ids[0]}));
  pool.release(&ids[0], 1);
  EXPECT_FALSE(pool.reset_prefix_cache()) << "one block is still in use";
  pool.release(&ids[1], 1);
  EXPECT_TRUE(pool.reset_prefix_cache());
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  EXPECT_FALSE(pool.is_cached(ids[0]));
  EXPECT_FALSE(pool.is_cached(ids[1]));
  EXPECT_TRUE(find(pool, 1, t0, 0, {0}).empty());
  EXPECT_TRUE(find(pool, 2, t1, 0, {ids[0]}).empty());
  expect_all_blocks_free(pool);
}

TEST(BlockPool, CachingDisabledFindsNothing) {
  BlockPool pool(4, kBs, /*enable_caching=*/false);
  EXPECT_FALSE(pool.enable_caching());
  std::vector<int32_t> ids = alloc(pool, 1);
  const std::vector<int32_t> t = token_range(kBs, 10);
  pool.cache_block(ids[0], 1, t.data(), 0, BlockPool::kNullBlock);
  EXPECT_FALSE(pool.is_cached(ids[0]));
  EXPECT_EQ(pool.num_cached_blocks(), 0);
  EXPECT_TRUE(find(pool, 1, t, 0, {0}).empty());
  pool.release(ids.data(), 1);
  expect_all_blocks_free(pool);
}

TEST(BlockPool, ChurnKeepsInvariants) {
  // Pseudo-random allocate / touch / release / cache mixture against a reference count model.
  BlockPool pool(17, kBs);
  std::vector<int> model(17, 0);
  std::vector<int32_t> held;  // one entry per reference we hold
  uint64_t state = 0x1234567;
  auto next = [&state](uint64_t n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % n);
  };
  for (int step = 0; step < 3000; ++step) {
    const int op = next(4);
    if (op == 0 && pool.num_free_blocks() > 0) {
      const int n = 1 + next(static_cast<uint64_t>(pool.num_free_blocks()));
      const std::vector<int32_t> front = pool.free_queue();
      std::vector<int32_t> got = alloc(pool, n);
      ASSERT_EQ(got, std::vector<int32_t>(front.begin(), front.begin() + n)) << "not LRU order";
      for (int32_t id : got) {
        ASSERT_EQ(model[static_cast<size_t>(id)], 0);
        model[static_cast<size_t>(id)] = 1;
        held.push_back(id);
        ASSERT_FALSE(pool.is_cached(id)) << "allocated block kept a stale cache entry";
        if (next(2)) {
          const std::vector<int32_t> t = token_range(kBs, id * 10 + step);
          pool.cache_block(id, static_cast<uint64_t>(next(3)), t.data(), 0, BlockPool::kNullBlock);
        }
      }
    } else if (op == 1 && !held.empty()) {
      const int32_t id = held[static_cast<size_t>(next(held.size()))];
      pool.touch(&id, 1);
      model[static_cast<size_t>(id)] += 1;
      held.push_back(id);
    } else if (!held.empty()) {
      const size_t k = static_cast<size_t>(next(held.size()));
      const int32_t id = held[k];
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      pool.release(&id, 1);
      model[static_cast<size_t>(id)] -= 1;
      if (model[static_cast<size_t>(id)] == 0) {
        ASSERT_EQ(pool.free_queue().back(), id);
      }
    }
    for (int32_t id = 1; id < 17; ++id) ASSERT_EQ(pool.ref_count(id), model[static_cast<size_t>(id)]) << "block " << id;
    expect_pool_consistent(pool);
    if (testing::Test::HasFailure()) return;
  }
  for (int32_t id : held) pool.release(&id, 1);
  expect_all_blocks_free(pool);
}

}  // namespace

namespace {

TEST(BlockPool, PartialBlocksMatchOnlyTheirExactTokens) {
  BlockPool pool(8, kBs);
  const std::vector<int32_t> ids = alloc(pool, 2);
  const std::vector<int32_t> full = {1, 2, 3, 4}, tail = {5, 6};
  const uint64_t h0 = octavo::hash_block_tokens(0, full.data(), kBs, 0);
  const uint64_t h1 = octavo::hash_block_tokens(h0, tail.data(), 2, 0);
  pool.cache_block(ids[0], h0, full.data(), 0, BlockPool::kNullBlock);
  pool.cache_block(ids[1], h1, tail.data(), 0, ids[0], 2);
  std::vector<int32_t> out;
  pool.find_cached(h1, tail.data(), 0, {ids[0]}, out, 2);
  EXPECT_EQ(out, (std::vector<int32_t>{ids[1]}));
  // The same hash asked for another length, another token, or as a full block: no match.
  const std::vector<int32_t> other = {5, 7}, longer = {5, 6, 9, 9};
  out.clear();
  pool.find_cached(h1, other.data(), 0, {ids[0]}, out, 2);
  pool.find_cached(h1, longer.data(), 0, {ids[0]}, out, 3);
  pool.find_cached(h1, longer.data(), 0, {ids[0]}, out);
  EXPECT_TRUE(out.empty());
  // A partial block is nobody's parent: a lookup that names it finds nothing after it.
  EXPECT_TRUE(find(pool, h0, full, 0, {ids[1]}).empty());
  EXPECT_EQ(find(pool, h0, full, 0, {BlockPool::kNullBlock}), (std::vector<int32_t>{ids[0]}));
  EXPECT_OCTAVO_ERROR(pool.cache_block(alloc(pool, 1)[0], 1, tail.data(), 0, BlockPool::kNullBlock, kBs + 1),
                      ErrorKind::kValue);
  expect_pool_consistent(pool);
}

}  // namespace
