// The scheduler with more than one step open (pipeline parallel keeps a batch per stage in
// flight): random workloads driven through a queue of open steps, closed oldest first, some of
// them failing. A fake model samples a token that depends only on the sequence and a fake KV
// cache holds, in each slot, a fingerprint of the prefix it was computed for; each step is
// "run" as it is scheduled (stages run steps in order), so a step that reads KV no earlier step
// wrote, or a request that samples twice or out of turn, shows up as a failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "octavo/scheduler.h"
#include "test_util.h"

namespace {

using octavo::FinishReason;
using octavo::Request;
using octavo::RequestParams;
using octavo::Scheduler;
using octavo::SchedulerConfig;
using octavo::SchedulerOutput;
using octavo::SchedulingPolicy;
using octavo_test::expect_all_blocks_free;
using octavo_test::expect_pool_consistent;
using octavo_test::make_params;

uint64_t fingerprint(const std::vector<int32_t>& tokens, int end) {  // of tokens[0 .. end]
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i <= end; ++i) h = (h ^ static_cast<uint32_t>(tokens[static_cast<size_t>(i)])) * 0x100000001b3ULL;
  return h | 1;
}

int32_t model_token(const std::vector<int32_t>& tokens, int vocab) {
  return 1 + static_cast<int32_t>((fingerprint(tokens, static_cast<int>(tokens.size()) - 1) >> 13) % vocab);
}

// Blocks of 4 tokens, 64-token requests at most.
SchedulerConfig config(int num_blocks, int budget) {
  SchedulerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = 4;
  c.max_model_len = 64;
  c.max_num_batched_tokens = budget;
  return c;
}

struct OpenStep {
  std::vector<int32_t> tokens;  // sampled for each row (0 where the row samples nothing)
  bool fails = false;
  bool verified = true;  // its reads were checked (not scheduled behind a failing step)
};

class Pipeline {
 public:
  Pipeline(const SchedulerConfig& c, int depth, uint64_t seed)
      : sched(c), config(c), depth_(depth), state_(seed), kv_(static_cast<size_t>(c.num_blocks) * c.block_size, 0) {}

  int rnd(int n) {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state_ >> 33) % static_cast<uint64_t>(n));
  }

  // Schedules a step when the queue has room; closes the oldest when it is full or nothing new
  // could be scheduled.
  void advance() {
    if (static_cast<int>(open_.size()) < depth_) {
      const SchedulerOutput& out = sched.schedule(rnd(3) == 0 ? 1 + rnd(3) : 0);  // sometimes capped
      note_finished(out);
      if (out.num_reqs() > 0 || open_.empty()) {
        open_.push_back(run(out));
        if (out.num_reqs() > 0 && static_cast<int>(open_.size()) < depth_) return;
      }
    }
    close_oldest();
  }

  void drain() {
    while (!open_.empty()) close_oldest();
    note_finished(sched.schedule());  // reports what the last updates finished
    if (sched.in_step()) sched.update_from_output(nullptr);
  }

  void abort(const std::string& id) {
    if (const Request* r = sched.find(id)) aborted.insert(r->handle());
    sched.abort_requests({id});
  }

  Scheduler sched;
  SchedulerConfig config;
  int vocab = 40;
  std::map<int64_t, RequestParams> params;
  std::map<int64_t, std::vector<int32_t>> outputs;
  std::map<int64_t, FinishReason> finished;  // finished by an update, with its reason
  std::set<int64_t> aborted;                 // asked to abort, or ended by a failed step
  std::multiset<int64_t> reported;           // finished_handles over all steps
  int num_failed_steps = 0;

 private:
  void note_finished(const SchedulerOutput& out) { reported.insert(out.finished_handles.begin(), out.finished_handles.end()); }

  OpenStep run(const SchedulerOutput& out) {
    OpenStep step;
    step.fails = out.num_reqs() > 0 && rnd(100) == 0;
    for (const OpenStep& s : open_) step.verified &= !s.fails;  // it may read what a failing step never wrote
    const int bs = config.block_size;
    for (size_t c = 0; !step.fails && c < out.block_copies.size(); c += 2) {  // partial-block cache hits
      const auto src = static_cast<ptrdiff_t>(out.block_copies[c]);
      const auto dst = static_cast<ptrdiff_t>(out.block_copies[c + 1]);
      std::copy_n(kv_.begin() + src * bs, bs, kv_.begin() + dst * bs);
    }
    for (int i = 0; i < out.num_reqs(); ++i) {
      const Request* r = sched.find(out.req_handles[static_cast<size_t>(i)]);
      EXPECT_NE(r, nullptr);
      if (r == nullptr) return step;
      const std::vector<int32_t>& tokens = r->token_ids();
      const int begin = out.query_start_loc[static_cast<size_t>(i)], end = out.query_start_loc[static_cast<size_t>(i) + 1];
      const int seq_len = out.seq_lens[static_cast<size_t>(i)];
      EXPECT_LE(seq_len, r->num_tokens()) << "a step computes tokens that are not known yet";
      for (int t = begin; t < end; ++t) {
        const int pos = out.positions[static_cast<size_t>(t)];
        EXPECT_EQ(out.input_ids[static_cast<size_t>(t)], tokens[static_cast<size_t>(pos)]);
        if (!step.fails) kv_[static_cast<size_t>(out.slot_mapping[static_cast<size_t>(t)])] = fingerprint(tokens, pos);
      }
      const int32_t* table = out.block_table.data() + static_cast<ptrdiff_t>(i) * out.block_table_width;
      for (int pos = 0; step.verified && !step.fails && pos < seq_len; ++pos) {
        EXPECT_EQ(kv_[static_cast<size_t>(table[pos / bs] * bs + pos % bs)], fingerprint(tokens, pos))
            << "request " << r->request_id() << " reads stale KV at position " << pos;
      }
      const bool samples = seq_len == r->num_tokens();
      std::vector<int32_t> seq(tokens.begin(), tokens.begin() + seq_len);
      step.tokens.push_back(samples ? model_token(seq, vocab) : 0);
    }
    return step;
  }

  void close_oldest() {
    OpenStep step = open_.front();
    if (step.fails) {  // a failed step fails every step in flight with it, as the engine does
      while (!open_.empty()) {
        for (int64_t h : sched.fail_step()) aborted.insert(h);
        open_.pop_front();
      }
      ++num_failed_steps;
      return;
    }
    open_.pop_front();
    const octavo::UpdateOutput& up = sched.update_from_output(step.tokens.data());
    for (size_t i = 0; i < up.req_handles.size(); ++i) {
      const int64_t h = up.req_handles[i];
      for (int k = up.new_token_offsets[i]; k < up.new_token_offsets[i + 1]; ++k) outputs[h].push_back(up.new_token_ids[static_cast<size_t>(k)]);
      const auto reason = static_cast<FinishReason>(up.finish_reasons[i]);
      if (reason != FinishReason::kNone) EXPECT_TRUE(finished.emplace(h, reason).second) << "finished twice";
    }
    expect_pool_consistent(sched.kv_cache_manager().pool());
  }

  int depth_;
  uint64_t state_;
  std::vector<uint64_t> kv_;
  std::deque<OpenStep> open_;
};

// What the fake model generates for a request alone (the scheduler's stop rules are covered by
// test_scheduler.cc; here every request runs to max_tokens).
std::vector<int32_t> reference(const RequestParams& p, int vocab) {
  std::vector<int32_t> seq = p.prompt_token_ids, out;
  while (static_cast<int>(out.size()) < p.max_tokens) {
    out.push_back(model_token(seq, vocab));
    seq.push_back(out.back());
  }
  return out;
}

struct Case {
  int depth;
  int num_blocks;
  int budget;
  SchedulingPolicy policy;
  uint64_t seed;
};

class SchedulerPipeline : public testing::TestWithParam<Case> {};

TEST_P(SchedulerPipeline, MatchesReferenceAndFreesEverything) {
  const Case k = GetParam();
  SchedulerConfig c = config(k.num_blocks, k.budget);
  c.max_num_seqs = 8;
  c.policy = k.policy;
  Pipeline p(c, k.depth, k.seed);
  const std::vector<int32_t> shared = octavo_test::token_range(30, 500);
  int next = 0;
  for (int step = 0; step < 5000 && (next < 50 || p.sched.has_unfinished_requests()); ++step) {
    if (next < 50 && p.rnd(3) == 0) {
      const int len = 1 + p.rnd(30);
      std::vector<int32_t> prompt(shared.begin(), shared.begin() + (p.rnd(2) ? len : 0));
      while (static_cast<int>(prompt.size()) < len) prompt.push_back(1 + p.rnd(p.vocab));
      RequestParams r = make_params("r" + std::to_string(next++), prompt, 1 + p.rnd(16));
      r.priority = p.rnd(3);
      if ((len + r.max_tokens + 3) / 4 >= k.num_blocks) continue;  // more than the whole pool
      const int64_t h = p.sched.add_request(r);
      p.params.emplace(h, r);
    }
    if (p.rnd(50) == 0) p.abort("r" + std::to_string(p.rnd(next)));
    if (p.sched.has_unfinished_requests() || p.sched.in_step()) p.advance();
    if (testing::Test::HasFailure()) {
      ADD_FAILURE() << "stopped at step " << step;
      return;
    }
  }
  p.drain();
  EXPECT_FALSE(p.sched.has_unfinished_requests());
  expect_all_blocks_free(p.sched.kv_cache_manager().pool());
  for (const auto& [h, r] : p.params) {
    EXPECT_EQ(p.reported.count(h), 1u) << "request " << r.request_id << " reported finished " << p.reported.count(h) << " times";
    if (p.finished.count(h) != 0) {
      EXPECT_EQ(p.outputs[h], reference(r, p.vocab)) << "request " << r.request_id;
    } else {
      EXPECT_EQ(p.aborted.count(h), 1u) << "request " << r.request_id << " neither finished nor was aborted";
    }
  }
  EXPECT_GT(p.num_failed_steps, 0);
  EXPECT_GT(p.finished.size(), 15u);  // failed steps end the others in flight with them
}

INSTANTIATE_TEST_SUITE_P(Depths, SchedulerPipeline,
                         testing::Values(Case{2, 40, 16, SchedulingPolicy::kFcfs, 1}, Case{2, 14, 24, SchedulingPolicy::kFcfs, 2},
                                         Case{3, 14, 8, SchedulingPolicy::kPriority, 3}, Case{4, 60, 64, SchedulingPolicy::kFcfs, 4},
                                         Case{2, 12, 32, SchedulingPolicy::kPriority, 5}));

// A prompt split into chunks runs its chunks in consecutive open steps; only the last samples.
TEST(SchedulerPipeline, ChunksOfOnePromptOverlapAndOnlyTheLastSamples) {
  Scheduler s(config(32, 8));
  const int64_t a = s.add_request(make_params("a", octavo_test::token_range(20), 3));
  EXPECT_EQ(s.schedule().num_scheduled_tokens[0], 8);
  EXPECT_EQ(s.schedule().num_scheduled_tokens[0], 8);
  EXPECT_EQ(s.schedule().num_scheduled_tokens[0], 4);
  EXPECT_EQ(s.schedule().num_reqs(), 0);  // all 20 in flight: nothing more, and no step opened
  EXPECT_EQ(s.num_steps_in_flight(), 3);
  const int32_t tokens[] = {7, 8, 9};
  EXPECT_EQ(s.update_from_output(&tokens[0]).new_token_ids.size(), 0u);
  EXPECT_EQ(s.update_from_output(&tokens[1]).new_token_ids.size(), 0u);
  EXPECT_EQ(s.update_from_output(&tokens[2]).new_token_ids[0], 9);
  EXPECT_EQ(s.find(a)->num_output_tokens(), 1);
}

// max_num_reqs splits the requests into batches, one per open step.
TEST(SchedulerPipeline, CappedStepsSplitTheRequests) {
  Scheduler s(config(32, 64));
  for (const char* id : {"a", "b", "c"}) s.add_request(make_params(id, octavo_test::token_range(3), 4));
  EXPECT_EQ(s.schedule(2).num_reqs(), 2);
  EXPECT_EQ(s.schedule(2).num_reqs(), 1);
  EXPECT_EQ(s.num_steps_in_flight(), 2);
}

// A preemption passes over requests in flight (their step would write KV they no longer own).
TEST(SchedulerPipeline, PreemptionPassesOverRequestsInFlight) {
  Scheduler s(config(4, 64));  // 3 usable blocks of 4 tokens
  const int64_t a = s.add_request(make_params("a", octavo_test::token_range(4), 8));
  s.schedule();  // step 1: a (1 block)
  const int64_t b = s.add_request(make_params("b", octavo_test::token_range(5, 100), 8));
  EXPECT_EQ(s.schedule().req_handles[0], b);  // step 2: b (2 blocks), while a is in flight
  const int32_t t = 1;
  s.update_from_output(&t);  // step 1 closes: a needs a 2nd block now, and none is free
  EXPECT_EQ(s.schedule().num_reqs(), 0);  // b is in flight: a gives itself up
  EXPECT_EQ(s.num_preemptions(), 1);
  EXPECT_EQ(s.waiting()[0]->handle(), a);
  EXPECT_EQ(s.running()[0]->handle(), b);
  EXPECT_EQ(s.update_from_output(&t).new_token_ids[0], 1);  // b's step lands whole
}

// An abort while the request is in flight waits for its last open step.
TEST(SchedulerPipeline, AbortWaitsForTheRequestsLastOpenStep) {
  Scheduler s(config(32, 8));
  const int64_t a = s.add_request(make_params("a", octavo_test::token_range(12), 8));
  s.schedule();
  s.schedule();  // a's two chunks in flight
  s.abort_requests({"a"});
  const int32_t t = 1;
  s.update_from_output(&t);
  EXPECT_NE(s.find(a), nullptr);  // still in the second open step
  EXPECT_EQ(s.schedule().num_reqs(), 0);  // and given nothing more
  s.update_from_output(&t);
  EXPECT_EQ(s.find(a), nullptr);
  EXPECT_EQ(s.schedule().finished_handles[0], a);
  s.update_from_output(nullptr);
  expect_all_blocks_free(s.kv_cache_manager().pool());
}

}  // namespace
