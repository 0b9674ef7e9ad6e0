// propose_ngram (prompt lookup): hand cases, limits, and a random comparison against a plain
// search over every n-gram occurrence.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "octavo/ngram_proposer.h"
#include "test_util.h"

namespace {

using octavo::NgramConfig;
using Tokens = std::vector<int32_t>;

Tokens propose(const Tokens& t, int min_n, int max_n, int k, int max_model_len = 0) {
  return octavo::propose_ngram(t.data(), static_cast<int>(t.size()), NgramConfig{min_n, max_n, k, max_model_len});
}

TEST(NgramProposer, ProposesWhatFollowedTheSuffixEarlier) {
  // A B C D A B -> the suffix "A B" occurred at 0, followed by C D A B.
  EXPECT_EQ(propose({1, 2, 3, 4, 1, 2}, 1, 3, 3), (Tokens{3, 4, 1}));
  EXPECT_EQ(propose({1, 2, 3, 4, 1, 2}, 1, 3, 10), (Tokens{3, 4, 1, 2}));  // up to the end of the context
  EXPECT_TRUE(propose({1, 2, 3, 4, 5}, 1, 3, 3).empty());                  // no suffix occurs earlier
}

TEST(NgramProposer, PrefersTheLongestSuffixThenTheEarliestPlace) {
  // "2" alone occurs at 1 and 5; "9 2" only at 4: the longer one wins.
  EXPECT_EQ(propose({7, 2, 8, 8, 9, 2, 6, 9, 2}, 1, 2, 2), (Tokens{6, 9}));
  // Two places for "2": the earliest.
  EXPECT_EQ(propose({5, 2, 3, 1, 2, 4, 2}, 1, 1, 1), (Tokens{3}));
  // min_n bounds it below: a one-token match is not enough.
  EXPECT_TRUE(propose({5, 2, 3, 1, 2}, 2, 3, 2).empty());
}

TEST(NgramProposer, StopsAtMaxModelLen) {
  EXPECT_EQ(propose({1, 2, 3, 1, 2}, 1, 2, 5, 7), (Tokens{3, 1}));
  EXPECT_TRUE(propose({1, 2, 3, 1, 2}, 1, 2, 5, 5).empty());
}

TEST(NgramProposer, RefusesBadConfigs) {
  EXPECT_OCTAVO_ERROR((NgramConfig{0, 3, 5, 0}.validate()), octavo::ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR((NgramConfig{3, 2, 5, 0}.validate()), octavo::ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR((NgramConfig{1, 2, 0, 0}.validate()), octavo::ErrorKind::kValue);
}

// Every (n, p) occurrence, then the largest n and, for it, the smallest p.
Tokens reference(const Tokens& t, int min_n, int max_n, int k) {
  const int count = static_cast<int>(t.size());
  int best_n = 0, best_p = -1;
  for (int n = min_n; n <= max_n && n < count; ++n) {
    for (int p = count - n - 1; p >= 0; --p) {
      if (std::equal(t.end() - n, t.end(), t.begin() + p) && n >= best_n) {
        best_n = n;
        best_p = p;
      }
    }
  }
  if (best_p < 0) return {};
  const int begin = best_p + best_n;
  return Tokens(t.begin() + begin, t.begin() + std::min(count, begin + k));
}

TEST(NgramProposer, MatchesAPlainSearch) {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 2000; ++trial) {
    Tokens t(gen() % 40);
    for (int32_t& x : t) x = static_cast<int32_t>(gen() % 4);
    const int min_n = 1 + static_cast<int>(gen() % 3), max_n = min_n + static_cast<int>(gen() % 4);
    const int k = 1 + static_cast<int>(gen() % 6);
    ASSERT_EQ(propose(t, min_n, max_n, k), reference(t, min_n, max_n, k)) << "trial " << trial;
  }
}

}  // namespace
