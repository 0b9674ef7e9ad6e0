#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "octavo/cpu_isa.h"
#include "octavo/status.h"
#include "octavo/threading.h"

namespace {

// Runs fn(begin, end) through the C-style parallel_for.
template <typename Fn>
void run(int64_t n, int64_t grain, Fn fn) {
  octavo::parallel_for(
      n, grain, [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); }, &fn);
}

class ThreadPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { threads_ = octavo::get_num_threads(); }
  void TearDown() override { octavo::set_num_threads(threads_); }
  int threads_ = 1;
};

TEST_F(ThreadPoolTest, EveryItemRunsExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    octavo::set_num_threads(threads);
    EXPECT_EQ(octavo::get_num_threads(), threads);
    for (int64_t n : {0, 1, 7, 1000}) {
      for (int64_t grain : {1, 3, 64}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        for (int repeat = 0; repeat < 20; ++repeat) {
          run(n, grain, [&](int64_t b, int64_t e) {
            EXPECT_LE(e - b, grain);
            for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
          });
        }
        for (auto& h : hits) ASSERT_EQ(h.load(), 20) << "threads " << threads << " n " << n << " grain " << grain;
      }
    }
  }
}

TEST_F(ThreadPoolTest, FirstExceptionIsRethrownToTheCaller) {
  octavo::set_num_threads(3);
  EXPECT_THROW(run(100, 1,
                   [](int64_t b, int64_t) {
                     if (b == 42) throw std::runtime_error("chunk 42");
                   }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  run(100, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum.load(), 4950);
}

// Many tiny jobs back to back, with more threads than cores: workers are often late to a job,
// and a late one must never run a chunk of a job that has returned (a chunk would then count
// for the next job, or twice).
TEST_F(ThreadPoolTest, LateWorkersNeverRunAChunkOfAJobThatReturned) {
  octavo::set_num_threads(4);
  constexpr int kJobs = 20000;
  static std::atomic<int> job{0};
  static std::vector<std::atomic<int>> hits(2 * kJobs);
  job = 0;
  for (auto& h : hits) h = 0;
  auto record = [](void*, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(2 * job.load() + i)]++;
  };
  for (int j = 0; j < kJobs; ++j) {
    octavo::parallel_for(2, 1, record, nullptr);
    job.store(j + 1);
  }
  for (int j = 0; j < kJobs; ++j) {
    ASSERT_EQ(hits[2 * j].load(), 1) << "job " << j;
    ASSERT_EQ(hits[2 * j + 1].load(), 1) << "job " << j;
  }
}

TEST_F(ThreadPoolTest, NestedCallsRunSeriallyInsideTheChunk) {
  octavo::set_num_threads(2);
  std::atomic<int64_t> inner{0};
  run(8, 1, [&](int64_t, int64_t) { run(10, 1, [&](int64_t b, int64_t e) { inner += e - b; }); });
  EXPECT_EQ(inner.load(), 80);
  EXPECT_THROW(run(2, 1, [](int64_t, int64_t) { octavo::set_num_threads(1); }), octavo::Error);
}

TEST_F(ThreadPoolTest, BadThreadCountIsRefused) { EXPECT_THROW(octavo::set_num_threads(0), octavo::Error); }

TEST(ThreadScratch, GrowsKeepsAlignmentAndChecksSlots) {
  auto* a = static_cast<char*>(octavo::thread_scratch(0, 100));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  a[99] = 1;
  EXPECT_EQ(octavo::thread_scratch(0, 50), a);  // big enough already: reused
  auto* b = static_cast<char*>(octavo::thread_scratch(0, 1 << 20));
  b[(1 << 20) - 1] = 1;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_THROW(octavo::thread_scratch(octavo::kNumScratchSlots, 8), octavo::Error);
}

TEST(CpuIsa, BestIsSupportedAndSelectable) {
  const octavo::CpuIsa before = octavo::active_cpu_isa();
  EXPECT_TRUE(octavo::cpu_isa_supported(octavo::best_cpu_isa()));
  EXPECT_TRUE(octavo::cpu_isa_supported(octavo::CpuIsa::kScalar));
  for (octavo::CpuIsa isa : octavo::kAllCpuIsas) {
    if (octavo::cpu_isa_supported(isa)) {
      octavo::set_cpu_isa(isa);
      EXPECT_EQ(octavo::active_cpu_isa(), isa);
    } else {
      EXPECT_THROW(octavo::set_cpu_isa(isa), octavo::Error);
    }
  }
  octavo::set_cpu_isa(before);
}

}  // namespace
