// Small helpers shared by the native-core unit tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "octavo/block_pool.h"
#include "octavo/request.h"
#include "octavo/status.h"

namespace octavo_test {

// n consecutive token ids starting at `first`; distinct bases give prompts that share nothing.
inline std::vector<int32_t> token_range(int n, int32_t first = 1000) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = first + i;
  return tokens;
}

inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline octavo::RequestParams make_params(std::string id, std::vector<int32_t> prompt, int32_t max_tokens = 4) {
  octavo::RequestParams p;
  p.request_id = std::move(id);
  p.prompt_token_ids = std::move(prompt);
  p.max_tokens = max_tokens;
  return p;
}

// Free + used always covers every usable block, the free queue holds exactly the count-0 blocks
// (each once, never the null block), and every other usable block is referenced.
inline void expect_pool_consistent(const octavo::BlockPool& pool) {
  EXPECT_EQ(pool.num_free_blocks() + pool.num_used_blocks(), pool.num_blocks() - 1);
  const std::vector<int32_t> queue = pool.free_queue();
  EXPECT_EQ(static_cast<int>(queue.size()), pool.num_free_blocks());
  std::set<int32_t> in_queue;
  for (int32_t id : queue) {
    EXPECT_NE(id, octavo::BlockPool::kNullBlock) << "the null block is in the free queue";
    EXPECT_TRUE(in_queue.insert(id).second) << "block " << id << " is twice in the free queue";
    EXPECT_EQ(pool.ref_count(id), 0) << "block " << id << " is in the free queue while referenced";
  }
  for (int32_t id = 1; id < pool.num_blocks(); ++id) {
    if (in_queue.count(id) == 0) {
      EXPECT_GT(pool.ref_count(id), 0) << "block " << id << " is lost";
    }
  }
  EXPECT_FALSE(pool.is_cached(octavo::BlockPool::kNullBlock)) << "the null block is cached";
}

// Every usable block is back in the pool with no reference.
inline void expect_all_blocks_free(const octavo::BlockPool& pool) {
  expect_pool_consistent(pool);
  EXPECT_EQ(pool.num_free_blocks(), pool.num_blocks() - 1);
  EXPECT_EQ(pool.num_used_blocks(), 0);
  for (int32_t id = 1; id < pool.num_blocks(); ++id) EXPECT_EQ(pool.ref_count(id), 0) << "block " << id;
}

}  // namespace octavo_test

// Expects `stmt` to throw octavo::Error of `expected_kind` (and nothing else).
#define EXPECT_OCTAVO_ERROR(stmt, expected_kind)                                       \
  do {                                                                                 \
    bool octavo_test_thrown_ = false;                                                  \
    try {                                                                              \
      stmt;                                                                            \
    } catch (const ::octavo::Error& e) {                                               \
      octavo_test_thrown_ = true;                                                      \
      EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(expected_kind)) << e.what(); \
      EXPECT_NE(std::string(e.what()), "") << "empty error message";                   \
    } catch (const std::exception& e) {                                                \
      octavo_test_thrown_ = true;                                                      \
      ADD_FAILURE() << "threw a non-octavo exception: " << e.what();                   \
    }                                                                                  \
    EXPECT_TRUE(octavo_test_thrown_) << "expected octavo::Error from: " #stmt;         \
  } while (0)
