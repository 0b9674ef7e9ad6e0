// Scheduler: admission checks, the flat batch arrays, token budget / max_num_seqs limits,
// chunked prefill, prefix-cache hits, stop rules, preemption (FCFS and priority) and aborts.
//
// Most tests drive the scheduler through a Harness that plays the model runner: it checks every
// SchedulerOutput against the requests it describes, writes a fake KV cache (each slot holds a
// fingerprint of the token prefix it was computed for) and verifies that every context token a
// request attends to holds the right fingerprint, so a wrong block table, slot mapping or cache
// hit shows up as a failure. Its "model" samples a token that depends only on the sequence, so
// each request's outputs are known in advance whatever the scheduling, preemption included.
// With speculation on, the harness also proposes draft tokens (some right, some wrong) and
// verifies them as a rejection sampler would, so the outputs must still be the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "octavo/scheduler.h"
#include "test_util.h"

namespace {

using octavo::ErrorKind;
using octavo::FinishReason;
using octavo::Request;
using octavo::RequestParams;
using octavo::RequestStatus;
using octavo::Scheduler;
using octavo::SchedulerConfig;
using octavo::SchedulerOutput;
using octavo::SchedulingPolicy;
using octavo::UpdateOutput;
using octavo_test::expect_all_blocks_free;
using octavo_test::expect_pool_consistent;
using octavo_test::make_params;
using octavo_test::token_range;

SchedulerConfig make_config(int num_blocks, int block_size = 4, int max_model_len = 64, int budget = 64) {
  SchedulerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_model_len = max_model_len;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 16;
  return c;
}

RequestParams params(const std::string& id, int prompt_len, int max_tokens, int32_t first_token = 1000) {
  return make_params(id, token_range(prompt_len, first_token), max_tokens);
}

// Fingerprints of every prefix: fp[i] identifies tokens[0..i]. Never 0 (0 = unwritten KV).
std::vector<uint64_t> prefix_fingerprints(const std::vector<int32_t>& tokens) {
  std::vector<uint64_t> fp(tokens.size());
  uint64_t h = 0x243f6a8885a308d3ULL;
  for (size_t i = 0; i < tokens.size(); ++i) {
    h ^= static_cast<uint32_t>(tokens[i]) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 31;
    fp[i] = h | 1;
  }
  return fp;
}

// The fake model: the next token is a function of the whole sequence, in [1, vocab].
int32_t model_token(const std::vector<int32_t>& tokens, int vocab) {
  return 1 + static_cast<int32_t>((prefix_fingerprints(tokens).back() >> 17) % static_cast<uint64_t>(vocab));
}

struct Stop {
  FinishReason reason = FinishReason::kNone;
  int32_t stop_reason = -1;
};

// vLLM's stop rules, written independently of Request::check_stop.
Stop expected_stop(const RequestParams& p, const std::vector<int32_t>& outputs, int max_model_len) {
  const int n = static_cast<int>(outputs.size());
  const int32_t last = outputs.back();
  if (n >= p.min_tokens) {
    if (!p.ignore_eos && p.eos_token_id >= 0 && last == p.eos_token_id) return {FinishReason::kStop, -1};
    if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), last) != p.stop_token_ids.end()) {
      return {FinishReason::kStop, last};
    }
  }
  if (n >= p.max_tokens || static_cast<int>(p.prompt_token_ids.size()) + n >= max_model_len) return {FinishReason::kLength, -1};
  return {};
}

// What the fake model generates for a request, run alone.
std::vector<int32_t> reference_outputs(const RequestParams& p, int max_model_len, int vocab) {
  std::vector<int32_t> seq = p.prompt_token_ids, outputs;
  while (true) {
    const int32_t t = model_token(seq, vocab);
    seq.push_back(t);
    outputs.push_back(t);
    if (expected_stop(p, outputs, max_model_len).reason != FinishReason::kNone) return outputs;
  }
}

class Harness {
 public:
  explicit Harness(const SchedulerConfig& config)
      : sched(config), config_(config), kv_(static_cast<size_t>(config.num_blocks) * config.block_size, 0) {}

  Scheduler sched;
  int vocab = 30000;
  std::map<int64_t, RequestParams> params;
  std::map<int64_t, std::vector<int32_t>> outputs;  // tokens returned by update_from_output
  std::map<int64_t, Stop> finished;                 // finish reasons returned by update_from_output
  std::set<int64_t> aborted;
  std::map<int64_t, int> times_scheduled;
  int num_steps = 0;
  // Speculative decoding: up to this many drafts per decoding request after every update, each
  // right (the model's next token) with probability draft_accuracy.
  int num_speculative_tokens = 0;
  double draft_accuracy = 0.7;
  int num_drafts_verified = 0, num_drafts_accepted = 0;

  int64_t add(RequestParams p) {
    RequestParams copy = p;
    const int64_t h = sched.add_request(std::move(p));
    EXPECT_TRUE(params.emplace(h, copy).second) << "handle " << h << " reused";
    EXPECT_NE(sched.find(h), nullptr);
    EXPECT_EQ(sched.find(copy.request_id), sched.find(h));
    return h;
  }

  const SchedulerOutput& schedule() {
    const SchedulerOutput& out = sched.schedule();
    in_step_ = true;
    ++num_steps;
    const std::set<int64_t> got(out.finished_handles.begin(), out.finished_handles.end());
    EXPECT_EQ(got, expect_finished_) << "finished_handles of step " << num_steps;
    EXPECT_EQ(got.size(), out.finished_handles.size()) << "a handle is reported finished twice";
    expect_finished_.clear();
    check_output(out);
    return out;
  }

  // One token per scheduled request.
  const UpdateOutput& update(const std::vector<int32_t>& sampled) {
    std::vector<std::vector<int32_t>> rows;
    for (int32_t t : sampled) rows.push_back({t});
    return update_rows(rows);
  }

  // rows[i]: the tokens sampled for scheduled request i.
  const UpdateOutput& update_rows(const std::vector<std::vector<int32_t>>& rows) {
    EXPECT_TRUE(in_step_);
    EXPECT_EQ(rows.size(), last_.size());
    std::vector<int32_t> sampled, offsets{0};
    for (const auto& row : rows) {
      sampled.insert(sampled.end(), row.begin(), row.end());
      offsets.push_back(static_cast<int32_t>(sampled.size()));
    }
    const UpdateOutput& up = sched.update_from_output(sampled.data(), offsets.data());
    in_step_ = false;
    copy_sources_.clear();  // released by the update
    check_update(up, rows);
    for (int64_t h : deferred_aborts_) {
      if (finished.count(h) != 0) continue;  // finished on its own in this update
      EXPECT_EQ(sched.find(h), nullptr) << "deferred abort of " << h << " not applied after the update";
      if (aborted.insert(h).second) expect_finished_.insert(h);
    }
    deferred_aborts_.clear();
    check_invariants();
    if (num_speculative_tokens > 0) propose_drafts(up);
    return up;
  }

  // Samples from the fake model: one token per scheduled request, or with drafts, its accepted
  // drafts and the model's token after them (a rejection sampler whose target is the model).
  const UpdateOutput& update_from_model() {
    std::vector<std::vector<int32_t>> rows;
    for (const Scheduled& s : last_) {
      std::vector<int32_t> seq = sched.find(s.handle)->token_ids(), row;
      for (size_t k = 0;; ++k) {
        const int32_t t = model_token(seq, vocab);
        row.push_back(t);
        if (k == s.drafts.size() || s.drafts[k] != t) break;
        seq.push_back(t);
      }
      num_drafts_verified += static_cast<int>(s.drafts.size());
      num_drafts_accepted += static_cast<int>(row.size()) - 1;
      rows.push_back(std::move(row));
    }
    return update_rows(rows);
  }

  // Drafts for the requests the update left decoding: the model's next tokens, some replaced by
  // a wrong one. The scheduler keeps them (cut to what max_tokens allows).
  void propose_drafts(const UpdateOutput& up) {
    for (size_t i = 0; i < up.req_handles.size(); ++i) {
      const int64_t h = up.req_handles[i];
      const Request* r = sched.find(h);
      if (r == nullptr || r->num_computed_tokens != r->num_tokens() - 1) continue;
      std::vector<int32_t> seq = r->token_ids(), drafts;
      const int k = static_cast<int>(rng_() % static_cast<uint32_t>(num_speculative_tokens + 1));
      for (int j = 0; j < k; ++j) {
        int32_t t = model_token(seq, vocab);
        if (static_cast<double>(rng_() % 1000) >= draft_accuracy * 1000) t = t % vocab + 1;  // a wrong one
        drafts.push_back(t);
        seq.push_back(t);
      }
      sched.set_draft_tokens(h, drafts.data(), k);
      const int room = r->params().max_tokens - r->num_output_tokens() - 1;
      drafts.resize(static_cast<size_t>(std::max(0, std::min(k, room))));
      EXPECT_EQ(r->spec_token_ids, drafts) << "drafts of " << r->request_id();
      proposed_[h] = std::move(drafts);
    }
  }

  void step() {
    schedule();
    update_from_model();
  }

  // The step's forward pass failed: its KV writes never happened, and fail_step() ends the step.
  void fail() {
    EXPECT_TRUE(in_step_);
    for (int32_t slot : last_slots_) kv_[static_cast<size_t>(slot)] = 0;
    const std::vector<int64_t> failed = sched.fail_step();
    in_step_ = false;
    copy_sources_.clear();
    EXPECT_EQ(failed, last_handles_);
    for (int64_t h : failed) {
      EXPECT_EQ(sched.find(h), nullptr) << "request " << h << " of a failed step is still unfinished";
      if (aborted.insert(h).second) expect_finished_.insert(h);
    }
    deferred_aborts_.clear();
    check_invariants();
  }

  void abort(const std::vector<std::string>& ids) {
    std::vector<int64_t> handles;
    for (const std::string& id : ids) {
      if (const Request* r = sched.find(id)) handles.push_back(r->handle());
    }
    sched.abort_requests(ids);
    for (int64_t h : handles) {
      if (in_step_) {
        EXPECT_NE(sched.find(h), nullptr) << "abort during a step must wait for update_from_output";
        deferred_aborts_.push_back(h);
      } else {
        EXPECT_EQ(sched.find(h), nullptr) << "aborted request " << h << " is still unfinished";
        if (aborted.insert(h).second) expect_finished_.insert(h);
      }
    }
    if (!in_step_) check_invariants();
  }

  // Steps until every request has finished and its finish has been reported.
  void run(int max_steps = 10000) {
    for (int i = 0; i < max_steps && sched.has_unfinished_requests(); ++i) {
      step();
      if (testing::Test::HasFatalFailure()) return;
    }
    ASSERT_FALSE(sched.has_unfinished_requests()) << "requests still unfinished after " << max_steps << " steps";
    if (!expect_finished_.empty()) {
      const SchedulerOutput& out = schedule();
      EXPECT_EQ(out.num_reqs(), 0);
      update({});
    }
  }

  // Every request that was not aborted produced exactly what the model generates alone.
  void expect_reference_outputs() {
    for (const auto& [h, p] : params) {
      if (aborted.count(h) != 0) continue;
      ASSERT_EQ(finished.count(h), 1u) << "request " << p.request_id << " never finished";
      EXPECT_EQ(outputs[h], reference_outputs(p, config_.max_model_len, vocab)) << "request " << p.request_id;
      const Stop stop = expected_stop(p, outputs[h], config_.max_model_len);
      EXPECT_EQ(static_cast<int>(finished[h].reason), static_cast<int>(stop.reason)) << p.request_id;
      EXPECT_EQ(finished[h].stop_reason, stop.stop_reason) << p.request_id;
    }
  }

  void check_invariants() {
    const octavo::BlockPool& pool = sched.kv_cache_manager().pool();
    expect_pool_consistent(pool);
    std::vector<int> refs(static_cast<size_t>(pool.num_blocks()), 0);
    EXPECT_LE(sched.num_running(), config_.max_num_seqs);
    for (const Request* r : sched.running()) {
      EXPECT_EQ(r->status, RequestStatus::kRunning);
      if (!in_step_) EXPECT_LE(r->num_computed_tokens, r->num_tokens()) << r->request_id();
      for (int32_t id : r->block_ids) {
        ASSERT_GT(id, 0);
        ASSERT_LT(id, pool.num_blocks());
        refs[static_cast<size_t>(id)] += 1;
      }
    }
    for (const Request* r : sched.waiting()) {
      EXPECT_TRUE(r->status == RequestStatus::kWaiting || r->status == RequestStatus::kPreempted);
      EXPECT_TRUE(r->block_ids.empty()) << "waiting request " << r->request_id() << " holds blocks";
      EXPECT_EQ(r->num_computed_tokens, 0);
    }
    for (int32_t id : copy_sources_) refs[static_cast<size_t>(id)] += 1;  // held until the step closes
    for (int32_t id = 1; id < pool.num_blocks(); ++id) {
      EXPECT_EQ(pool.ref_count(id), refs[static_cast<size_t>(id)]) << "block " << id << " reference count";
    }
  }

  const std::vector<int64_t>& last_handles() const { return last_handles_; }

 private:
  struct Scheduled {
    int64_t handle;
    int seq_len;
    int num_tokens;
    std::vector<int32_t> drafts;  // verified by the step
  };

  void check_output(const SchedulerOutput& out) {
    const int R = out.num_reqs();
    const int T = out.total_num_scheduled_tokens();
    const int bs = config_.block_size;
    const auto R1 = static_cast<size_t>(R);
    ASSERT_EQ(out.num_scheduled_tokens.size(), R1);
    ASSERT_EQ(out.num_computed_tokens.size(), R1);
    ASSERT_EQ(out.is_new.size(), R1);
    ASSERT_EQ(out.seq_lens.size(), R1);
    ASSERT_EQ(out.num_draft_tokens.size(), R1);
    int num_rows = 0;
    for (int d : out.num_draft_tokens) num_rows += d + 1;
    ASSERT_EQ(out.logits_indices.size(), static_cast<size_t>(num_rows));
    ASSERT_EQ(out.query_start_loc.size(), R1 + 1);
    ASSERT_EQ(out.positions.size(), static_cast<size_t>(T));
    ASSERT_EQ(out.slot_mapping.size(), static_cast<size_t>(T));
    ASSERT_EQ(out.block_table.size(), R1 * static_cast<size_t>(out.block_table_width));
    EXPECT_LE(R, config_.max_num_seqs);
    EXPECT_LE(T, config_.max_num_batched_tokens);
    EXPECT_EQ(out.query_start_loc[0], 0);
    EXPECT_EQ(out.query_start_loc[R1], T);

    // Partial-block cache hits: each copy goes into a block of a new request, from another block.
    ASSERT_EQ(out.block_copies.size() % 2, 0u);
    std::map<int32_t, int32_t> copied_into;  // dst -> src
    copy_sources_.clear();
    for (size_t c = 0; c < out.block_copies.size(); c += 2) {
      const int32_t src = out.block_copies[c], dst = out.block_copies[c + 1];
      EXPECT_NE(src, dst);
      EXPECT_TRUE(copied_into.emplace(dst, src).second) << "block " << dst << " is copied into twice";
      copy_sources_.push_back(src);
    }
    last_.clear();
    last_slots_.assign(out.slot_mapping.begin(), out.slot_mapping.end());
    last_handles_.assign(out.req_handles.begin(), out.req_handles.end());
    std::set<int64_t> handles;
    std::set<int32_t> slots;
    std::vector<const Request*> reqs;
    std::vector<std::vector<int32_t>> seqs;  // each request's tokens, then the drafts it verifies
    size_t row = 0;
    for (int i = 0; i < R; ++i) {
      const auto u = static_cast<size_t>(i);
      const int64_t h = out.req_handles[u];
      EXPECT_TRUE(handles.insert(h).second) << "request scheduled twice in one step";
      const Request* r = sched.find(h);
      ASSERT_NE(r, nullptr) << "scheduled handle " << h << " is unknown";
      reqs.push_back(r);
      times_scheduled[h] += 1;
      EXPECT_EQ(r->status, RequestStatus::kRunning);
      const int n = out.num_scheduled_tokens[u];
      const int start = out.num_computed_tokens[u];
      const int d = out.num_draft_tokens[u];
      EXPECT_GE(n, 1);
      EXPECT_EQ(out.query_start_loc[u + 1] - out.query_start_loc[u], n);
      EXPECT_EQ(out.seq_lens[u], start + n);
      EXPECT_EQ(r->num_computed_tokens, start + n) << "num_computed_tokens not advanced by schedule()";
      EXPECT_TRUE(r->spec_token_ids.empty()) << "drafts stay after the step that took them";
      std::vector<int32_t> drafts = proposed_[h];
      proposed_.erase(h);
      ASSERT_LE(static_cast<size_t>(d), drafts.size()) << "more drafts scheduled than proposed";
      drafts.resize(static_cast<size_t>(d));
      if (d > 0) EXPECT_EQ(start + n - d, r->num_tokens()) << "drafts scheduled before the newest token";
      EXPECT_LE(start + n, r->num_tokens() + d);
      EXPECT_LT(start + n, config_.max_model_len + 1);
      EXPECT_LE(r->num_output_tokens() + d, r->params().max_tokens - 1) << "drafts past max_tokens";
      seqs.push_back(r->token_ids());
      seqs.back().insert(seqs.back().end(), drafts.begin(), drafts.end());
      for (int k = 0; k <= d; ++k, ++row) {
        EXPECT_EQ(out.logits_indices[row], out.query_start_loc[u + 1] - 1 - d + k) << "logits row " << k;
      }
      if (out.is_new[u] && start % bs != 0) {  // its last cached tokens come from a partial block
        EXPECT_EQ(copied_into.count(r->block_ids[static_cast<size_t>(start / bs)]), 1u)
            << "a new request starts inside a block it does not copy";
      }
      // Block table row: the request's blocks, then null-block padding.
      ASSERT_LE(r->block_ids.size(), static_cast<size_t>(out.block_table_width));
      EXPECT_GE(static_cast<int>(r->block_ids.size()) * bs, start + n) << "blocks do not cover the sequence";
      for (int j = 0; j < out.block_table_width; ++j) {
        const int32_t expected = j < static_cast<int>(r->block_ids.size()) ? r->block_ids[static_cast<size_t>(j)] : 0;
        EXPECT_EQ(out.block_table[u * static_cast<size_t>(out.block_table_width) + static_cast<size_t>(j)], expected);
      }
      for (int k = 0; k < n; ++k) {
        const auto t = static_cast<size_t>(out.query_start_loc[u] + k);
        const int pos = start + k;
        EXPECT_EQ(out.positions[t], pos);
        EXPECT_EQ(out.input_ids[t], seqs.back()[static_cast<size_t>(pos)]);
        const int32_t block = r->block_ids[static_cast<size_t>(pos / bs)];
        EXPECT_EQ(out.slot_mapping[t], block * bs + pos % bs);
        EXPECT_NE(block, 0) << "a token is written to the null block";
        EXPECT_TRUE(slots.insert(out.slot_mapping[t]).second) << "two tokens share KV slot " << out.slot_mapping[t];
      }
      last_.push_back({h, start + n, r->num_tokens(), std::move(drafts)});
    }
    for (int64_t h : out.preempted_handles) {
      EXPECT_EQ(handles.count(h), 0u) << "a preempted request is in the batch";
      proposed_.erase(h);  // preemption drops drafts
      const Request* r = sched.find(h);
      ASSERT_NE(r, nullptr);
      EXPECT_EQ(r->status, RequestStatus::kPreempted);
      EXPECT_EQ(r->num_computed_tokens, 0);
      EXPECT_TRUE(r->block_ids.empty());
    }
    // The forward pass: copy the blocks, write KV of every scheduled token, then read every context token.
    for (const auto& [dst, src] : copied_into) {
      std::copy_n(kv_.begin() + static_cast<ptrdiff_t>(src) * bs, bs, kv_.begin() + static_cast<ptrdiff_t>(dst) * bs);
    }
    for (int i = 0; i < R; ++i) {
      const auto u = static_cast<size_t>(i);
      const std::vector<uint64_t> fp = prefix_fingerprints(seqs[u]);
      for (int k = 0; k < out.num_scheduled_tokens[u]; ++k) {
        const auto t = static_cast<size_t>(out.query_start_loc[u] + k);
        kv_[static_cast<size_t>(out.slot_mapping[t])] = fp[static_cast<size_t>(out.positions[t])];
      }
    }
    for (int i = 0; i < R; ++i) {
      const auto u = static_cast<size_t>(i);
      const Request* r = reqs[u];
      const std::vector<uint64_t> fp = prefix_fingerprints(seqs[u]);
      for (int pos = 0; pos < out.seq_lens[u]; ++pos) {
        const int32_t block = r->block_ids[static_cast<size_t>(pos / bs)];
        const size_t slot = static_cast<size_t>(block) * bs + pos % bs;
        if (kv_[slot] != fp[static_cast<size_t>(pos)]) {
          ADD_FAILURE() << "request " << r->request_id() << " reads wrong KV at position " << pos << " (block " << block
                        << ", step " << num_steps << ")";
          break;
        }
      }
    }
    check_invariants();
  }

  void check_update(const UpdateOutput& up, const std::vector<std::vector<int32_t>>& rows) {
    const size_t R = last_.size();
    ASSERT_EQ(up.req_handles, last_handles_);
    ASSERT_EQ(up.new_token_offsets.size(), R + 1);
    ASSERT_EQ(up.finish_reasons.size(), R);
    ASSERT_EQ(up.stop_reasons.size(), R);
    EXPECT_EQ(up.new_token_offsets[0], 0);
    EXPECT_EQ(static_cast<size_t>(up.new_token_offsets[R]), up.new_token_ids.size());
    for (size_t i = 0; i < R; ++i) {
      const int64_t h = last_[i].handle;
      const RequestParams& p = params.at(h);
      const int count = up.new_token_offsets[i + 1] - up.new_token_offsets[i];
      const bool prefilling = last_[i].seq_len - static_cast<int>(last_[i].drafts.size()) < last_[i].num_tokens;
      // The tokens kept: the row's up to (and with) the first that stops the request.
      Stop expected;
      size_t kept = 0;
      while (!prefilling && kept < rows[i].size() && expected.reason == FinishReason::kNone) {
        outputs[h].push_back(rows[i][kept++]);
        expected = expected_stop(p, outputs[h], config_.max_model_len);
      }
      EXPECT_EQ(count, static_cast<int>(kept)) << "request " << p.request_id << (prefilling ? " mid-prefill" : "");
      for (size_t k = 0; k < kept && static_cast<int>(k) < count; ++k) {
        EXPECT_EQ(up.new_token_ids[static_cast<size_t>(up.new_token_offsets[i]) + k], rows[i][k]);
      }
      const auto reason = static_cast<FinishReason>(up.finish_reasons[i]);
      EXPECT_EQ(static_cast<int>(reason), static_cast<int>(expected.reason)) << "request " << p.request_id;
      EXPECT_EQ(up.stop_reasons[i], expected.stop_reason) << "request " << p.request_id;
      if (reason != FinishReason::kNone) {
        EXPECT_EQ(finished.count(h), 0u) << "finished twice";
        finished[h] = {reason, up.stop_reasons[i]};
        expect_finished_.insert(h);
        EXPECT_EQ(sched.find(h), nullptr) << "finished request is still unfinished";
      } else if (std::find(deferred_aborts_.begin(), deferred_aborts_.end(), h) == deferred_aborts_.end()) {
        const Request* r = sched.find(h);
        EXPECT_NE(r, nullptr) << "request " << p.request_id << " vanished without finishing";
        if (r != nullptr) {
          EXPECT_EQ(r->num_output_tokens(), static_cast<int>(outputs[h].size()));
          if (!prefilling) EXPECT_EQ(r->num_computed_tokens, r->num_tokens() - 1) << "rejected drafts still computed";
        }
      }
    }
  }

  SchedulerConfig config_;
  std::vector<uint64_t> kv_;  // [num_blocks * block_size] fingerprint of the prefix each slot holds
  std::vector<Scheduled> last_;
  std::vector<int64_t> last_handles_;
  std::vector<int32_t> last_slots_;
  std::vector<int32_t> copy_sources_;  // partial cached blocks the open step copies (it holds them)
  std::set<int64_t> expect_finished_;
  std::vector<int64_t> deferred_aborts_;
  std::map<int64_t, std::vector<int32_t>> proposed_;  // drafts the scheduler keeps for each request
  std::mt19937 rng_{12345};
  bool in_step_ = false;
};

std::vector<int32_t> slice(const std::vector<int32_t>& v, int begin, int end) {
  return std::vector<int32_t>(v.begin() + begin, v.begin() + end);
}

// ---------------------------------------------------------------------------------------------
// add_request

TEST(Scheduler, AddRequestRejectsBadRequests) {
  Scheduler s(make_config(/*num_blocks=*/9, /*block_size=*/4, /*max_model_len=*/32));
  EXPECT_OCTAVO_ERROR(s.add_request(make_params("empty", {}, 4)), ErrorKind::kValue);
  const int64_t a = s.add_request(params("a", 4, 4));
  EXPECT_OCTAVO_ERROR(s.add_request(params("a", 4, 4)), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(s.add_request(params("zero", 4, 0)), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(s.add_request(params("neg", 4, -3)), ErrorKind::kValue);
  RequestParams min_over = params("min", 4, 4);
  min_over.min_tokens = 5;
  EXPECT_OCTAVO_ERROR(s.add_request(min_over), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(s.add_request(params("long", 32, 1)), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(s.add_request(params("longer", 40, 1)), ErrorKind::kValue);
  // Rejected requests leave no trace: their ids stay free.
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_EQ(s.find("zero"), nullptr);
  const int64_t b = s.add_request(params("zero", 4, 1));
  EXPECT_NE(a, b);
  EXPECT_EQ(s.num_waiting(), 2);
  // The longest prompt that leaves one token of room is fine (8 blocks of 4 = 32 tokens).
  EXPECT_NO_THROW(s.add_request(params("max", 31, 1)));
  min_over.min_tokens = 4;
  EXPECT_NO_THROW(s.add_request(min_over));
}

TEST(Scheduler, AddRequestRejectsRequestsLargerThanThePool) {
  Scheduler s(make_config(/*num_blocks=*/3, /*block_size=*/4, /*max_model_len=*/64));  // 2 usable blocks
  EXPECT_NO_THROW(s.add_request(params("fits", 4, 4)));  // 8 tokens
  EXPECT_OCTAVO_ERROR(s.add_request(params("prompt", 9, 1)), ErrorKind::kValue);
  EXPECT_OCTAVO_ERROR(s.add_request(params("outputs", 6, 6)), ErrorKind::kValue);
  EXPECT_EQ(s.num_waiting(), 1);
  // The model length bounds the size: 4 + 100 tokens are capped at 8.
  Scheduler capped(make_config(3, 4, /*max_model_len=*/8, 64));
  EXPECT_NO_THROW(capped.add_request(params("capped", 4, 100)));
}

TEST(Scheduler, HandlesAreUniqueAndFindWorks) {
  Scheduler s(make_config(16));
  std::set<int64_t> handles;
  for (int i = 0; i < 5; ++i) handles.insert(s.add_request(params("r" + std::to_string(i), 3, 2)));
  EXPECT_EQ(handles.size(), 5u);
  const Request* r = s.find("r3");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(s.find(r->handle()), r);
  EXPECT_EQ(r->request_id(), "r3");
  EXPECT_EQ(r->status, RequestStatus::kWaiting);
  EXPECT_EQ(s.find("nope"), nullptr);
  EXPECT_EQ(s.find(int64_t{987654}), nullptr);
  EXPECT_TRUE(s.has_unfinished_requests());
}

TEST(Scheduler, RejectsBadConfig) {
  SchedulerConfig c = make_config(1);
  EXPECT_OCTAVO_ERROR(Scheduler{c}, ErrorKind::kValue);
  c = make_config(16);
  c.max_num_seqs = 0;
  EXPECT_OCTAVO_ERROR(Scheduler{c}, ErrorKind::kValue);
  c = make_config(16);
  c.max_num_batched_tokens = 0;
  EXPECT_OCTAVO_ERROR(Scheduler{c}, ErrorKind::kValue);
}

TEST(Scheduler, StepOrderIsEnforced) {
  Scheduler s(make_config(16));
  s.add_request(params("a", 3, 2));
  EXPECT_THROW(s.update_from_output(nullptr), octavo::Error);
  s.schedule();
  // A second step while the first is open finds nothing: every token of "a" is in flight.
  EXPECT_EQ(s.schedule().num_reqs(), 0);
  EXPECT_EQ(s.num_steps_in_flight(), 1);
  const int32_t tok = 5;
  s.update_from_output(&tok);
  EXPECT_THROW(s.update_from_output(&tok), octavo::Error);
  EXPECT_THROW(s.fail_step(), octavo::Error);
}

// ---------------------------------------------------------------------------------------------
// One request through its whole life, with the arrays checked by hand.

TEST(Scheduler, SingleRequestLifecycle) {
  Harness h(make_config(16, 4, 64, 64));
  const int64_t a = h.add(params("a", 6, 3));
  EXPECT_EQ(h.sched.num_waiting(), 1);

  const SchedulerOutput& o1 = h.schedule();
  ASSERT_EQ(o1.num_reqs(), 1);
  EXPECT_EQ(o1.req_handles[0], a);
  EXPECT_EQ(o1.num_scheduled_tokens[0], 6);
  EXPECT_EQ(o1.num_computed_tokens[0], 0);
  EXPECT_EQ(o1.is_new[0], 1);
  EXPECT_EQ(o1.input_ids, token_range(6));
  EXPECT_EQ(o1.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(o1.query_start_loc, (std::vector<int32_t>{0, 6}));
  EXPECT_EQ(o1.seq_lens, (std::vector<int32_t>{6}));
  EXPECT_EQ(o1.logits_indices, (std::vector<int32_t>{5}));
  const std::vector<int32_t> blocks = h.sched.find(a)->block_ids;
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(o1.block_table_width, 2);
  EXPECT_EQ(o1.block_table, blocks);
  EXPECT_EQ(o1.slot_mapping, (std::vector<int32_t>{blocks[0] * 4, blocks[0] * 4 + 1, blocks[0] * 4 + 2,
                                                   blocks[0] * 4 + 3, blocks[1] * 4, blocks[1] * 4 + 1}));
  EXPECT_TRUE(o1.finished_handles.empty());
  EXPECT_EQ(h.sched.num_running(), 1);
  EXPECT_EQ(h.sched.num_waiting(), 0);
  const UpdateOutput& u1 = h.update({77});
  EXPECT_EQ(u1.new_token_ids, (std::vector<int32_t>{77}));
  EXPECT_EQ(u1.finish_reasons, (std::vector<int8_t>{0}));

  const SchedulerOutput& o2 = h.schedule();
  ASSERT_EQ(o2.num_reqs(), 1);
  EXPECT_EQ(o2.is_new[0], 0);
  EXPECT_EQ(o2.input_ids, (std::vector<int32_t>{77}));
  EXPECT_EQ(o2.positions, (std::vector<int32_t>{6}));
  EXPECT_EQ(o2.num_computed_tokens, (std::vector<int32_t>{6}));
  EXPECT_EQ(o2.seq_lens, (std::vector<int32_t>{7}));
  EXPECT_EQ(o2.slot_mapping, (std::vector<int32_t>{blocks[1] * 4 + 2}));
  EXPECT_EQ(o2.logits_indices, (std::vector<int32_t>{0}));
  h.update({78});

  h.schedule();
  const UpdateOutput& u3 = h.update({79});
  EXPECT_EQ(u3.finish_reasons, (std::vector<int8_t>{static_cast<int8_t>(FinishReason::kLength)}));
  EXPECT_EQ(h.outputs[a], (std::vector<int32_t>{77, 78, 79}));
  EXPECT_EQ(h.sched.find(a), nullptr);
  EXPECT_FALSE(h.sched.has_unfinished_requests());
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());

  // The finish is reported by the next schedule() exactly once.
  const SchedulerOutput& o4 = h.schedule();
  EXPECT_EQ(o4.num_reqs(), 0);
  EXPECT_EQ(o4.finished_handles, (std::vector<int64_t>{a}));
  h.update({});
  const SchedulerOutput& o5 = h.schedule();
  EXPECT_TRUE(o5.finished_handles.empty());
  h.update({});
}

TEST(Scheduler, FinishedBlocksStayCachedForTheNextRequest) {
  Harness h(make_config(16, 4, 64, 64));
  const int64_t a = h.add(params("a", 12, 1));
  h.run();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
  EXPECT_EQ(h.sched.kv_cache_manager().pool().num_cached_blocks(), 3);
  const int64_t b = h.add(params("b", 12, 1));  // the same prompt
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.num_reqs(), 1);
  EXPECT_EQ(o.req_handles[0], b);
  EXPECT_EQ(o.num_computed_tokens[0], 8) << "the last prompt token must be recomputed";
  EXPECT_EQ(o.num_scheduled_tokens[0], 4);
  h.update_from_model();
  h.run();
  EXPECT_EQ(h.outputs[a], h.outputs[b]);
  h.expect_reference_outputs();
}

TEST(Scheduler, PromptOfPreviousOutputHitsGeneratedBlocks) {
  Harness h(make_config(32, 4, 64, 64));
  const int64_t a = h.add(params("a", 6, 8));
  h.run();
  // a computed KV for prompt + 7 outputs (the last output is never fed back): 13 tokens, 3 blocks.
  RequestParams p = make_params("b", token_range(6), 2);
  p.prompt_token_ids.insert(p.prompt_token_ids.end(), h.outputs[a].begin(), h.outputs[a].end());
  h.add(p);  // 14 tokens
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.num_reqs(), 1);
  // Blocks 0-2 from the prefix cache, a's partial block 3 (token 12) copied: 1 token to compute.
  EXPECT_EQ(o.num_computed_tokens[0], 13);
  EXPECT_EQ(o.num_scheduled_tokens[0], 1);
  EXPECT_EQ(o.block_copies.size(), 2u);
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

// Beam search's step: beams that each extend a finished request by a different token copy its
// partial last block (copy on write: the cached block stays as it is for the next copier) and
// compute only their new token; the cached block is held until the copying step closes.
TEST(Scheduler, ExtensionsOfAFinishedRequestCopyItsPartialBlock) {
  Harness h(make_config(32, 4, 64, 64));
  const int64_t a = h.add(params("a", 5, 2));
  h.run();  // KV for prompt + 1 output: 6 tokens, block 1 holds 2 of them
  std::vector<int32_t> prefix = token_range(5, 1000);
  prefix.push_back(h.outputs[a][0]);
  std::vector<int64_t> beams;
  for (int32_t next : {7, 8, 9}) {
    RequestParams p = make_params("beam" + std::to_string(next), prefix, 3);
    p.prompt_token_ids.push_back(next);
    beams.push_back(h.add(p));
  }
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.num_reqs(), 3);
  EXPECT_EQ(o.num_computed_tokens, (std::vector<int32_t>{6, 6, 6}));
  EXPECT_EQ(o.num_scheduled_tokens, (std::vector<int32_t>{1, 1, 1}));
  ASSERT_EQ(o.block_copies.size(), 6u);
  const int32_t src = o.block_copies[0];
  EXPECT_EQ(o.block_copies[2], src);
  EXPECT_EQ(o.block_copies[4], src);
  EXPECT_EQ(h.sched.kv_cache_manager().pool().ref_count(src), 3);  // held by the step
  h.update_from_model();
  EXPECT_EQ(h.sched.kv_cache_manager().pool().ref_count(src), 0);
  h.run();
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// A step that was to copy a partial block fails: the copy may never have run, so the block the
// request copied into must not be cached with the copied tokens.
TEST(Scheduler, FailedStepDoesNotCacheAnUncopiedBlock) {
  Harness h(make_config(32, 4, 64, 64));
  const int64_t a = h.add(params("a", 5, 2));
  h.run();
  std::vector<int32_t> prompt = token_range(5, 1000);
  prompt.push_back(h.outputs[a][0]);
  prompt.push_back(7);
  h.add(make_params("b", prompt, 3));
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.block_copies.size(), 2u);
  const int32_t src = o.block_copies[0], dst = o.block_copies[1];
  h.fail();
  const octavo::BlockPool& pool = h.sched.kv_cache_manager().pool();
  EXPECT_TRUE(pool.is_cached(src));
  EXPECT_FALSE(pool.is_cached(dst));
  expect_all_blocks_free(pool);
}

TEST(Scheduler, ConcurrentRequestsShareCachedPrefix) {
  Harness h(make_config(32, 4, 64, 64));
  const int64_t a = h.add(params("a", 10, 5));
  h.step();
  const int64_t b = h.add(params("b", 10, 5));
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.num_reqs(), 2);
  EXPECT_EQ(o.req_handles[1], b);
  EXPECT_EQ(o.num_computed_tokens[1], 8);
  const Request* ra = h.sched.find(a);
  const Request* rb = h.sched.find(b);
  EXPECT_EQ(rb->block_ids[0], ra->block_ids[0]);
  EXPECT_EQ(rb->block_ids[1], ra->block_ids[1]);
  EXPECT_NE(rb->block_ids[2], ra->block_ids[2]);
  EXPECT_EQ(h.sched.kv_cache_manager().pool().ref_count(ra->block_ids[0]), 2);
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, ExtraKeyOrDisabledCachingGivesNoHit) {
  {
    Harness h(make_config(32, 4, 64, 64));
    RequestParams p = params("a", 12, 1);
    p.cache_extra_key = 7;
    h.add(p);
    h.run();
    RequestParams q = params("b", 12, 1);
    q.cache_extra_key = 8;
    h.add(q);
    const SchedulerOutput& o = h.schedule();
    EXPECT_EQ(o.num_computed_tokens[0], 0);
    EXPECT_EQ(o.num_scheduled_tokens[0], 12);
    h.update_from_model();
  }
  {
    SchedulerConfig c = make_config(32, 4, 64, 64);
    c.enable_prefix_caching = false;
    Harness h(c);
    h.add(params("a", 12, 1));
    h.run();
    h.add(params("b", 12, 1));
    const SchedulerOutput& o = h.schedule();
    EXPECT_EQ(o.num_computed_tokens[0], 0);
    EXPECT_EQ(o.num_scheduled_tokens[0], 12);
    h.update_from_model();
  }
}

// ---------------------------------------------------------------------------------------------
// Stop rules

TEST(Scheduler, EosStopsWithoutStopReason) {
  Harness h(make_config(16));
  RequestParams p = params("a", 3, 10);
  p.eos_token_id = 2;
  const int64_t a = h.add(p);
  h.schedule();
  h.update({5});
  h.schedule();
  const UpdateOutput& u = h.update({2});
  EXPECT_EQ(u.finish_reasons[0], static_cast<int8_t>(FinishReason::kStop));
  EXPECT_EQ(u.stop_reasons[0], -1);
  EXPECT_EQ(h.outputs[a], (std::vector<int32_t>{5, 2}));
}

TEST(Scheduler, StopTokenSetsStopReason) {
  Harness h(make_config(16));
  RequestParams p = params("a", 3, 10);
  p.stop_token_ids = {9, 11};
  h.add(p);
  h.schedule();
  h.update({4});
  h.schedule();
  const UpdateOutput& u = h.update({11});
  EXPECT_EQ(u.finish_reasons[0], static_cast<int8_t>(FinishReason::kStop));
  EXPECT_EQ(u.stop_reasons[0], 11);
}

TEST(Scheduler, MinTokensDefersEosAndStopTokens) {
  Harness h(make_config(16));
  RequestParams p = params("a", 3, 10);
  p.eos_token_id = 2;
  p.stop_token_ids = {9};
  p.min_tokens = 3;
  const int64_t a = h.add(p);
  for (int32_t t : {2, 9}) {
    h.schedule();
    EXPECT_EQ(h.update({t}).finish_reasons[0], 0) << "stopped before min_tokens";
  }
  h.schedule();
  const UpdateOutput& u = h.update({9});
  EXPECT_EQ(u.finish_reasons[0], static_cast<int8_t>(FinishReason::kStop));
  EXPECT_EQ(u.stop_reasons[0], 9);
  EXPECT_EQ(h.outputs[a].size(), 3u);
}

TEST(Scheduler, IgnoreEosRunsToMaxTokens) {
  Harness h(make_config(16));
  RequestParams p = params("a", 3, 3);
  p.eos_token_id = 2;
  p.ignore_eos = true;
  const int64_t a = h.add(p);
  for (int i = 0; i < 3; ++i) {
    h.schedule();
    h.update({2});
  }
  EXPECT_EQ(h.finished[a].reason, FinishReason::kLength);
  EXPECT_EQ(h.outputs[a].size(), 3u);
}

TEST(Scheduler, MaxModelLenEndsRequest) {
  Harness h(make_config(16, 4, /*max_model_len=*/8, 64));
  const int64_t a = h.add(params("a", 6, 100));
  h.run();
  EXPECT_EQ(h.finished[a].reason, FinishReason::kLength);
  EXPECT_EQ(h.outputs[a].size(), 2u);
}

TEST(Scheduler, MaxTokensOneFinishesAfterPrefill) {
  Harness h(make_config(16));
  const int64_t a = h.add(params("a", 5, 1));
  h.schedule();
  const UpdateOutput& u = h.update({3});
  EXPECT_EQ(u.finish_reasons[0], static_cast<int8_t>(FinishReason::kLength));
  EXPECT_EQ(h.sched.find(a), nullptr);
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// ---------------------------------------------------------------------------------------------
// Batching limits and chunked prefill

TEST(Scheduler, RunningRequestsComeBeforeWaitingOnes) {
  Harness h(make_config(32, 4, 64, 64));
  const int64_t a = h.add(params("a", 5, 5));
  h.step();
  const int64_t b = h.add(params("b", 5, 5, 2000));
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(o.is_new, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(o.num_scheduled_tokens, (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(o.query_start_loc, (std::vector<int32_t>{0, 1, 6}));
  EXPECT_EQ(o.logits_indices, (std::vector<int32_t>{0, 5}));
  // Rows padded with the null block to the widest request.
  EXPECT_EQ(o.block_table_width, 2);
  EXPECT_EQ(o.block_table[1], h.sched.find(a)->block_ids[1]);
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, TokenBudgetSplitsPrefillAcrossRequests) {
  Harness h(make_config(32, 4, 64, /*budget=*/16));
  const int64_t a = h.add(params("a", 10, 4));
  const int64_t b = h.add(params("b", 10, 4, 2000));
  const SchedulerOutput& o1 = h.schedule();
  EXPECT_EQ(o1.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(o1.num_scheduled_tokens, (std::vector<int32_t>{10, 6}));
  EXPECT_EQ(o1.total_num_scheduled_tokens(), 16);
  const UpdateOutput& u1 = h.update_from_model();
  EXPECT_EQ(u1.new_token_offsets, (std::vector<int32_t>{0, 1, 1})) << "b is mid-prefill: no token";
  const SchedulerOutput& o2 = h.schedule();
  EXPECT_EQ(o2.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(o2.num_scheduled_tokens, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(o2.num_computed_tokens, (std::vector<int32_t>{10, 6}));
  EXPECT_EQ(o2.is_new, (std::vector<uint8_t>{0, 0}));
  const UpdateOutput& u2 = h.update_from_model();
  EXPECT_EQ(u2.new_token_offsets, (std::vector<int32_t>{0, 1, 2}));
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, ChunkedPrefillOfLongPrompt) {
  Harness h(make_config(32, 4, 64, /*budget=*/16));
  const int64_t a = h.add(params("a", 40, 3));
  std::vector<int32_t> chunks, computed;
  for (int i = 0; i < 3; ++i) {
    const SchedulerOutput& o = h.schedule();
    ASSERT_EQ(o.num_reqs(), 1);
    chunks.push_back(o.num_scheduled_tokens[0]);
    computed.push_back(o.num_computed_tokens[0]);
    EXPECT_EQ(o.is_new[0], i == 0 ? 1 : 0);
    const UpdateOutput& u = h.update_from_model();
    EXPECT_EQ(u.new_token_ids.size(), i < 2 ? 0u : 1u);
    EXPECT_EQ(h.sched.find(a)->num_output_tokens(), i < 2 ? 0 : 1);
  }
  EXPECT_EQ(chunks, (std::vector<int32_t>{16, 16, 8}));
  EXPECT_EQ(computed, (std::vector<int32_t>{0, 16, 32}));
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, DecodesShareTheBudgetWithAPrefillChunk) {
  Harness h(make_config(64, 4, 128, /*budget=*/16));
  const int64_t a = h.add(params("a", 4, 20));
  const int64_t b = h.add(params("b", 4, 20, 2000));
  h.step();
  const int64_t c = h.add(params("c", 50, 2, 3000));
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{a, b, c}));
  EXPECT_EQ(o.num_scheduled_tokens, (std::vector<int32_t>{1, 1, 14}));
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, LongPrefillThresholdCapsChunks) {
  SchedulerConfig c = make_config(32, 4, 64, 64);
  c.long_prefill_token_threshold = 5;
  Harness h(c);
  h.add(params("a", 12, 2));
  std::vector<int32_t> chunks;
  for (int i = 0; i < 3; ++i) {
    chunks.push_back(h.schedule().num_scheduled_tokens.at(0));
    h.update_from_model();
  }
  EXPECT_EQ(chunks, (std::vector<int32_t>{5, 5, 2}));
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, WithoutChunkingAPromptWaitsForAWholeBudget) {
  SchedulerConfig c = make_config(64, 4, /*max_model_len=*/40, /*budget=*/40);
  c.enable_chunked_prefill = false;
  Harness h(c);
  const int64_t a = h.add(params("a", 30, 3));
  const int64_t b = h.add(params("b", 30, 3, 2000));
  const SchedulerOutput& o1 = h.schedule();
  EXPECT_EQ(o1.req_handles, (std::vector<int64_t>{a}));
  EXPECT_EQ(o1.num_scheduled_tokens, (std::vector<int32_t>{30}));
  h.update_from_model();
  const SchedulerOutput& o2 = h.schedule();
  EXPECT_EQ(o2.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(o2.num_scheduled_tokens, (std::vector<int32_t>{1, 30}));
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, MaxNumSeqsLimitsTheBatch) {
  SchedulerConfig c = make_config(32, 4, 64, 64);
  c.max_num_seqs = 2;
  Harness h(c);
  const int64_t a = h.add(params("a", 4, 3));
  const int64_t b = h.add(params("b", 4, 3, 2000));
  const int64_t d = h.add(params("c", 4, 3, 3000));
  const SchedulerOutput& o1 = h.schedule();
  EXPECT_EQ(o1.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(h.sched.num_waiting(), 1);
  h.update_from_model();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(h.schedule().req_handles, (std::vector<int64_t>{a, b}));
    h.update_from_model();
  }
  // a and b finished: c gets in.
  const SchedulerOutput& o4 = h.schedule();
  EXPECT_EQ(o4.req_handles, (std::vector<int64_t>{d}));
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, WaitingRequestThatDoesNotFitWaits) {
  Harness h(make_config(/*num_blocks=*/5, 4, 64, 64));  // 4 usable blocks
  const int64_t a = h.add(params("a", 8, 8));           // 2 blocks now, up to 4
  h.step();
  const int64_t b = h.add(params("b", 9, 1, 2000));     // needs 3 blocks
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{a}));
  EXPECT_EQ(h.sched.num_waiting(), 1);
  EXPECT_TRUE(o.preempted_handles.empty());
  h.update_from_model();
  h.run();
  EXPECT_EQ(h.outputs[b].size(), 1u);
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// ---------------------------------------------------------------------------------------------
// Preemption
//
// Pool of 6 usable blocks of 4 tokens. "b" (5-token prompt) starts alone; "a" and "c" (7 tokens)
// join at step 2. At step 4 "b" needs no block, but "a" grows to 9 tokens and needs a third one
// while the pool is full.

struct PreemptionScene {
  explicit PreemptionScene(SchedulingPolicy policy, int b_priority) : h(config(policy)) {
    RequestParams pb = params("b", 5, 10, 3000);
    pb.priority = b_priority;
    b = h.add(pb);
    h.step();
    a = h.add(params("a", 7, 6, 1000));
    c = h.add(params("c", 7, 6, 2000));
    h.step();
    h.step();
    EXPECT_EQ(h.sched.kv_cache_manager().pool().num_free_blocks(), 0);
  }
  static SchedulerConfig config(SchedulingPolicy policy) {
    SchedulerConfig c = make_config(7, 4, 64, 64);
    c.policy = policy;
    return c;
  }
  Harness h;
  int64_t a = 0, b = 0, c = 0;
};

TEST(Scheduler, FcfsPreemptsTheLatestArrival) {
  PreemptionScene s(SchedulingPolicy::kFcfs, 0);
  Harness& h = s.h;
  ASSERT_EQ(h.sched.find(s.c)->num_output_tokens(), 2);
  const std::vector<int32_t> c_tokens = h.sched.find(s.c)->token_ids();
  const int64_t d = h.add(params("d", 2, 2, 4000));  // waiting behind the victim
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.preempted_handles, (std::vector<int64_t>{s.c}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{s.b, s.a}));
  ASSERT_EQ(h.sched.num_waiting(), 2);
  EXPECT_EQ(h.sched.waiting()[1], h.sched.find(d)) << "the victim goes to the front of the waiting queue";
  const Request* c = h.sched.find(s.c);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status, RequestStatus::kPreempted);
  EXPECT_EQ(c->num_computed_tokens, 0);
  EXPECT_EQ(c->num_preemptions, 1);
  EXPECT_EQ(c->token_ids(), c_tokens) << "a preempted request keeps its output tokens";
  ASSERT_FALSE(h.sched.waiting().empty());
  EXPECT_EQ(h.sched.waiting().front(), c);
  EXPECT_EQ(h.sched.num_preemptions(), 1);
  h.update_from_model();
  EXPECT_TRUE(h.schedule().preempted_handles.empty()) << "preempted_handles is per step";
  h.update_from_model();
  h.run();
  // c resumed, recomputed its prompt and outputs, and ended with exactly max_tokens outputs.
  EXPECT_EQ(h.outputs[s.c].size(), 6u);
  EXPECT_EQ(h.finished[s.c].reason, FinishReason::kLength);
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, ResumedRequestIsNewAndRecomputesItsOutputs) {
  PreemptionScene s(SchedulingPolicy::kFcfs, 0);
  Harness& h = s.h;
  h.schedule();
  h.update_from_model();
  const int c_tokens = h.sched.find(s.c)->num_tokens();  // 7 prompt + 2 outputs
  for (int i = 0; i < 50; ++i) {
    const SchedulerOutput& o = h.schedule();
    auto it = std::find(o.req_handles.begin(), o.req_handles.end(), s.c);
    if (it != o.req_handles.end()) {
      const auto k = static_cast<size_t>(it - o.req_handles.begin());
      EXPECT_EQ(o.is_new[k], 1);
      EXPECT_EQ(o.num_computed_tokens[k] + o.num_scheduled_tokens[k], c_tokens) << "resume covers prompt + outputs";
      const UpdateOutput& u = h.update_from_model();
      EXPECT_EQ(u.new_token_offsets[k + 1] - u.new_token_offsets[k], 1) << "resumed request samples after recompute";
      break;
    }
    h.update_from_model();
  }
  h.run();
  EXPECT_EQ(h.outputs[s.c].size(), 6u);
  h.expect_reference_outputs();
}

TEST(Scheduler, PriorityPreemptsTheLargestPriorityValue) {
  PreemptionScene s(SchedulingPolicy::kPriority, /*b_priority=*/5);
  Harness& h = s.h;
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.preempted_handles, (std::vector<int64_t>{s.b}));
  EXPECT_EQ(std::count(o.req_handles.begin(), o.req_handles.end(), s.b), 0);
  EXPECT_EQ(std::count(o.req_handles.begin(), o.req_handles.end(), s.a), 1);
  const Request* b = h.sched.find(s.b);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->status, RequestStatus::kPreempted);
  EXPECT_EQ(b->num_computed_tokens, 0);
  h.update_from_model();
  h.run();
  EXPECT_EQ(h.outputs[s.b].size(), 10u);
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// The victim ("b", first in the running list) was already scheduled in this step; the requests
// after the one that preempted must still be scheduled.
TEST(Scheduler, PriorityPreemptionOfEarlierRequestKeepsSchedulingTheRest) {
  PreemptionScene s(SchedulingPolicy::kPriority, /*b_priority=*/5);
  Harness& h = s.h;
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.preempted_handles, (std::vector<int64_t>{s.b}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{s.a, s.c}));
  EXPECT_EQ(o.total_num_scheduled_tokens(), 2) << "the victim's tokens were given back";
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

// A victim already scheduled in this step gives its tokens back: the prefill chunk of "c",
// scheduled after the request that preempted, grows by the victim's decode token.
TEST(Scheduler, PreemptedVictimReturnsItsTokenBudget) {
  SchedulerConfig cfg = make_config(/*num_blocks=*/5, /*block_size=*/16, 64, /*budget=*/24);  // 4 usable
  cfg.policy = SchedulingPolicy::kPriority;
  Harness h(cfg);
  RequestParams pb = params("b", 15, 20, 3000);
  pb.priority = 5;
  const int64_t b = h.add(pb);
  h.step();  // b: 15 tokens, 1 block
  const int64_t a = h.add(params("a", 16, 10, 1000));
  const int64_t c = h.add(params("c", 40, 4, 2000));
  const SchedulerOutput& o2 = h.schedule();  // b decodes, a prefills, c gets a 7-token chunk
  ASSERT_EQ(o2.req_handles, (std::vector<int64_t>{b, a, c}));
  ASSERT_EQ(o2.num_scheduled_tokens, (std::vector<int32_t>{1, 16, 7}));
  h.update_from_model();
  // b takes the last free block, a needs one too: b (priority 5) is preempted after being
  // scheduled; its token returns to the budget, so c's chunk is 23, not 22.
  const SchedulerOutput& o3 = h.schedule();
  EXPECT_EQ(o3.preempted_handles, (std::vector<int64_t>{b}));
  EXPECT_EQ(o3.req_handles, (std::vector<int64_t>{a, c}));
  EXPECT_EQ(o3.num_scheduled_tokens, (std::vector<int32_t>{1, 23}));
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// A victim preempted after its prefill chunk was scheduled (and its blocks registered in the
// prefix cache) never computed that chunk: those blocks must not be found when it resumes.
TEST(Scheduler, PreemptedChunkLeavesNoUnwrittenBlockCached) {
  SchedulerConfig cfg = make_config(/*num_blocks=*/6, 4, 64, 64);  // 5 usable blocks
  cfg.policy = SchedulingPolicy::kPriority;
  cfg.long_prefill_token_threshold = 5;
  Harness h(cfg);
  RequestParams pb = params("b", 16, 2, 3000);
  pb.priority = 5;
  const int64_t b = h.add(pb);
  h.step();  // b: tokens 0..4
  const int64_t a = h.add(params("a", 4, 3, 1000));
  h.step();  // b: tokens 5..9, a: prefill
  const SchedulerOutput& o = h.schedule();  // b's chunk 10..14 fills block 2; a needs a block
  ASSERT_EQ(o.preempted_handles, (std::vector<int64_t>{b}));
  ASSERT_EQ(o.req_handles, (std::vector<int64_t>{a}));
  h.update_from_model();
  // Blocks 0 and 1 of b hold computed KV; block 2 only for tokens 8 and 9 (a partial block now).
  Request probe(make_params("probe", token_range(16, 3000), 1), 999, 999);
  const octavo::ComputedBlocks hits = h.sched.kv_cache_manager().get_computed_blocks(probe);
  EXPECT_EQ(hits.num_computed_tokens, 10);
  EXPECT_EQ(hits.num_partial_tokens, 2);
  h.run();  // the Harness checks that b's resumed context reads only written KV
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, PriorityWithEqualPrioritiesPreemptsLatestArrival) {
  PreemptionScene s(SchedulingPolicy::kPriority, /*b_priority=*/0);
  Harness& h = s.h;
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.preempted_handles, (std::vector<int64_t>{s.c}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{s.b, s.a}));
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, PriorityPolicyAdmitsLowerValuesFirst) {
  SchedulerConfig c = make_config(32, 4, 64, 64);
  c.policy = SchedulingPolicy::kPriority;
  c.max_num_seqs = 1;
  Harness h(c);
  RequestParams p1 = params("late", 4, 1, 1000);
  p1.priority = 3;
  RequestParams p2 = params("urgent", 4, 1, 2000);
  p2.priority = -1;
  RequestParams p3 = params("normal", 4, 1, 3000);
  const int64_t late = h.add(p1), urgent = h.add(p2), normal = h.add(p3);
  std::vector<int64_t> order;
  while (h.sched.has_unfinished_requests()) {
    const SchedulerOutput& o = h.schedule();
    for (int64_t x : o.req_handles) order.push_back(x);
    h.update_from_model();
  }
  EXPECT_EQ(order, (std::vector<int64_t>{urgent, normal, late}));
}

// A step that preempted admits no waiting request, even one that would fit.
TEST(Scheduler, NoAdmissionInAStepThatPreempted) {
  SchedulerConfig c = make_config(/*num_blocks=*/3, 4, 64, 64);  // 2 usable blocks
  c.policy = SchedulingPolicy::kPriority;
  Harness h(c);
  RequestParams pa = params("a", 3, 4, 1000);
  RequestParams pc = params("c", 4, 4, 2000);
  pc.priority = 5;
  const int64_t a = h.add(pa);
  const int64_t cc = h.add(pc);
  h.step();  // a: 1 block, c: 1 block
  RequestParams pd = params("d", 2, 2, 3000);
  pd.priority = 1;
  const int64_t d = h.add(pd);
  const SchedulerOutput& o = h.schedule();  // c needs a second block: c preempts itself
  EXPECT_EQ(o.preempted_handles, (std::vector<int64_t>{cc}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{a})) << "d must not be admitted in a step that preempted";
  EXPECT_EQ(h.sched.kv_cache_manager().pool().num_free_blocks(), 1);
  h.update_from_model();
  h.run();
  EXPECT_EQ(h.outputs[d].size(), 2u);
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, RequestAloneThatRunsOutOfBlocksIsNeverStuck) {
  // One request that needs the whole pool, plus another that forces preemptions.
  Harness h(make_config(/*num_blocks=*/5, 4, 64, 64));  // 4 usable blocks
  h.add(params("a", 6, 10, 1000));                       // up to 15 tokens: 4 blocks
  h.add(params("b", 6, 10, 2000));
  h.run(500);
  h.expect_reference_outputs();
  EXPECT_GT(h.sched.num_preemptions(), 0);
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// update_from_output with offsets: several tokens per request (speculative decoding); tokens after
// a stop are dropped, tokens for a request mid-prefill are ignored.
TEST(Scheduler, UpdateWithOffsetsTakesSeveralTokensPerRequest) {
  SchedulerConfig cfg = make_config(32, 4, 64, /*budget=*/12);
  Scheduler s(cfg);
  RequestParams pa = params("a", 4, 10, 1000);
  pa.eos_token_id = 2;
  const int64_t a = s.add_request(pa);
  const int64_t b = s.add_request(params("b", 4, 10, 2000));
  s.schedule();
  const int32_t first[2] = {7, 8};
  s.update_from_output(first);
  const int64_t c = s.add_request(params("c", 20, 10, 3000));
  const SchedulerOutput& o = s.schedule();
  ASSERT_EQ(o.req_handles, (std::vector<int64_t>{a, b, c}));
  ASSERT_LT(o.num_computed_tokens[2] + o.num_scheduled_tokens[2], 20);  // c is mid-prefill
  const int32_t sampled[6] = {5, 6, 9, 10, 11, 12};
  const int32_t offsets[4] = {0, 2, 3, 6};
  const UpdateOutput& u = s.update_from_output(sampled, offsets);
  EXPECT_EQ(u.new_token_offsets, (std::vector<int32_t>{0, 2, 3, 3}));
  EXPECT_EQ(u.new_token_ids, (std::vector<int32_t>{5, 6, 9}));
  EXPECT_EQ(s.find(a)->token_ids(), (std::vector<int32_t>{1000, 1001, 1002, 1003, 7, 5, 6}));
  EXPECT_EQ(s.find(c)->num_output_tokens(), 0);
  // Both new tokens of a are fed back in the next step.
  const SchedulerOutput& o2 = s.schedule();
  ASSERT_EQ(o2.req_handles[0], a);
  EXPECT_EQ(o2.num_scheduled_tokens[0], 2);
  EXPECT_EQ(o2.input_ids[0], 5);
  EXPECT_EQ(o2.input_ids[1], 6);
  // eos first: the tokens after it are dropped.
  std::vector<int32_t> sampled2, offsets2 = {0};
  for (int i = 0; i < o2.num_reqs(); ++i) {
    if (o2.req_handles[static_cast<size_t>(i)] == a) sampled2.insert(sampled2.end(), {2, 3, 4});
    else sampled2.push_back(20);
    offsets2.push_back(static_cast<int32_t>(sampled2.size()));
  }
  const UpdateOutput& u2 = s.update_from_output(sampled2.data(), offsets2.data());
  EXPECT_EQ(u2.finish_reasons[0], static_cast<int8_t>(FinishReason::kStop));
  EXPECT_EQ(u2.new_token_offsets[1] - u2.new_token_offsets[0], 1);
  EXPECT_EQ(u2.new_token_ids[0], 2);
  EXPECT_EQ(s.find(a), nullptr);
  (void)b;
}

// ---------------------------------------------------------------------------------------------
// Speculative decoding

// A step verifying drafts: the drafts follow the newest token in the batch, one logits row per
// draft plus one; the update keeps the accepted ones and the token after them, and the rejected
// drafts' positions are computed again by the next step.
TEST(Scheduler, DraftsAreVerifiedAndRejectedOnesComputedAgain) {
  Scheduler s(make_config(32, 4, 64, 64));
  const int64_t a = s.add_request(params("a", 5, 20, 1000));
  s.schedule();
  const int32_t first = 7;
  s.update_from_output(&first);
  const int32_t drafts[3] = {11, 12, 13};
  s.set_draft_tokens(a, drafts, 3);
  EXPECT_EQ(s.find(a)->spec_token_ids, (std::vector<int32_t>{11, 12, 13}));
  const SchedulerOutput& o = s.schedule();
  EXPECT_EQ(o.num_scheduled_tokens, (std::vector<int32_t>{4}));
  EXPECT_EQ(o.num_draft_tokens, (std::vector<int32_t>{3}));
  EXPECT_EQ(o.input_ids, (std::vector<int32_t>{7, 11, 12, 13}));
  EXPECT_EQ(o.positions, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(o.logits_indices, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(o.total_num_draft_tokens(), 3);
  EXPECT_TRUE(s.find(a)->spec_token_ids.empty());
  EXPECT_EQ(s.find(a)->num_computed_tokens, 9);
  const int32_t verified[2] = {11, 20};  // 11 accepted, 12 rejected: 20 comes instead
  const int32_t offsets[2] = {0, 2};
  const UpdateOutput& u = s.update_from_output(verified, offsets);
  EXPECT_EQ(u.new_token_ids, (std::vector<int32_t>{11, 20}));
  EXPECT_EQ(s.find(a)->num_tokens(), 8);
  EXPECT_EQ(s.find(a)->num_computed_tokens, 7) << "the rejected drafts' KV still counts";
  const SchedulerOutput& o2 = s.schedule();  // no drafts: the newest token alone
  EXPECT_EQ(o2.input_ids, (std::vector<int32_t>{20}));
  EXPECT_EQ(o2.positions, (std::vector<int32_t>{7}));
  EXPECT_EQ(o2.num_draft_tokens, (std::vector<int32_t>{0}));
  EXPECT_EQ(o2.logits_indices, (std::vector<int32_t>{0}));
  const int32_t next = 21;
  s.update_from_output(&next);
  EXPECT_EQ(s.find(a)->num_computed_tokens, 8);
}

// Drafts are kept only where the next step can verify them, and only as many as max_tokens can
// use; the token budget and max_model_len cut them further.
TEST(Scheduler, DraftsAreCutToWhatTheRequestAndTheStepAllow) {
  Scheduler s(make_config(32, 4, /*max_model_len=*/12, /*budget=*/4));
  const int64_t a = s.add_request(params("a", 4, /*max_tokens=*/4, 1000));
  const int64_t b = s.add_request(params("b", 4, 8, 2000));
  const int32_t drafts[5] = {1, 2, 3, 4, 5};
  s.set_draft_tokens(a, drafts, 2);
  EXPECT_TRUE(s.find(a)->spec_token_ids.empty()) << "a waiting request keeps no drafts";
  s.schedule();
  s.set_draft_tokens(a, drafts, 2);
  EXPECT_TRUE(s.find(a)->spec_token_ids.empty()) << "a request in flight keeps no drafts";
  const int32_t t1 = 9;
  s.update_from_output(&t1);  // a's prompt (budget 4): b still waits
  s.set_draft_tokens(a, drafts, 5);
  EXPECT_EQ(s.find(a)->spec_token_ids.size(), 2u) << "one output, max_tokens 4: two drafts at most";
  s.set_draft_tokens(a, drafts, 1);
  EXPECT_EQ(s.find(a)->spec_token_ids, (std::vector<int32_t>{1})) << "drafts replace the earlier ones";
  s.set_draft_tokens(b, drafts, 2);
  EXPECT_TRUE(s.find(b)->spec_token_ids.empty());
  s.set_draft_tokens(a, drafts, 2);
  const SchedulerOutput& o = s.schedule();  // a: 1 + 2 tokens; b's prompt chunk gets the last one
  EXPECT_EQ(o.num_draft_tokens, (std::vector<int32_t>{2, 0}));
  const int32_t rows[4] = {1, 2, 30, 31};  // a: both drafts accepted, then 30; b: mid-prefill
  const int32_t offsets[3] = {0, 3, 4};
  const UpdateOutput& u = s.update_from_output(rows, offsets);
  EXPECT_EQ(u.new_token_ids, (std::vector<int32_t>{1, 2, 30}));
  EXPECT_EQ(u.finish_reasons[0], static_cast<int8_t>(FinishReason::kLength));
  EXPECT_EQ(s.find(a), nullptr);
  while (s.find(b)->num_output_tokens() == 0) {  // the rest of b's prompt
    s.schedule();
    s.update_from_output(rows);
  }
  ASSERT_EQ(s.find(b)->num_tokens(), 5);
  s.set_draft_tokens(b, drafts, 5);
  const SchedulerOutput& o2 = s.schedule();
  EXPECT_EQ(o2.num_draft_tokens, (std::vector<int32_t>{3})) << "the budget of 4 leaves room for 3";
  const int32_t rows2[4] = {1, 2, 3, 40};
  const int32_t offsets2[2] = {0, 4};
  s.update_from_output(rows2, offsets2);
  ASSERT_EQ(s.find(b)->num_tokens(), 9);
  // max_model_len 12: positions stop at 10, so the newest token (position 8) takes 2 drafts.
  s.set_draft_tokens(b, drafts, 3);
  const SchedulerOutput& o3 = s.schedule();
  EXPECT_EQ(o3.num_draft_tokens, (std::vector<int32_t>{2}));
  EXPECT_EQ(o3.positions, (std::vector<int32_t>{8, 9, 10}));
}

// A request preempted with drafts loses them; resumed, it recomputes and verifies none.
TEST(Scheduler, PreemptionDropsDrafts) {
  Harness h(make_config(/*num_blocks=*/7, 4, 64, 64));  // 6 usable blocks
  h.num_speculative_tokens = 4;
  h.draft_accuracy = 1.0;
  h.add(params("a", 8, 12, 1000));
  h.add(params("b", 8, 12, 2000));
  h.run(200);
  h.expect_reference_outputs();
  EXPECT_GT(h.sched.num_preemptions(), 0);
  EXPECT_GT(h.num_drafts_accepted, 0);
  EXPECT_EQ(h.num_drafts_accepted, h.num_drafts_verified);
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

// A stop token among the accepted drafts ends the request there; the KV it keeps for the prefix
// cache covers its tokens only.
TEST(Scheduler, StopAmongAcceptedDraftsDropsTheRest) {
  Scheduler s(make_config(32, 4, 64, 64));
  RequestParams p = params("a", 6, 20, 1000);
  p.stop_token_ids = {50};
  const int64_t a = s.add_request(p);
  s.schedule();
  const int32_t first = 7;
  s.update_from_output(&first);
  const int32_t drafts[4] = {8, 50, 9, 10};
  s.set_draft_tokens(a, drafts, 4);
  s.schedule();
  const int32_t rows[5] = {8, 50, 9, 10, 11};
  const int32_t offsets[2] = {0, 5};
  const UpdateOutput& u = s.update_from_output(rows, offsets);
  EXPECT_EQ(u.new_token_ids, (std::vector<int32_t>{8, 50}));
  EXPECT_EQ(u.stop_reasons[0], 50);
  EXPECT_EQ(s.find(a), nullptr);
  // a's tokens were prompt 1000..1005, 7, 8, 50: 9 tokens, two full blocks and one of 1 token.
  RequestParams q = params("b", 6, 4, 1000);
  q.prompt_token_ids.insert(q.prompt_token_ids.end(), {7, 8, 50, 60});
  s.add_request(q);
  s.schedule();
  EXPECT_EQ(s.kv_cache_manager().pool().stats().hits, 9) << "8 tokens in full blocks + 1 in a partial one";
}

// ---------------------------------------------------------------------------------------------
// Aborts

TEST(Scheduler, AbortWaitingRequest) {
  Harness h(make_config(16));
  const int64_t a = h.add(params("a", 4, 2));
  const int64_t b = h.add(params("b", 4, 2, 2000));
  h.abort({"a"});
  EXPECT_EQ(h.sched.num_waiting(), 1);
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.finished_handles, (std::vector<int64_t>{a}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{b}));
  h.update_from_model();
  h.run();
  // The id is free again once aborted.
  EXPECT_NO_THROW(h.add(params("a", 4, 1)));
  h.run();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, AbortRunningRequestFreesBlocksAtOnce) {
  Harness h(make_config(16));
  const int64_t a = h.add(params("a", 9, 5));
  h.step();
  EXPECT_EQ(h.sched.kv_cache_manager().pool().num_used_blocks(), 3);
  h.abort({"a", "unknown"});
  h.abort({"a"});  // twice: ignored
  EXPECT_EQ(h.sched.find(a), nullptr);
  EXPECT_EQ(h.sched.num_running(), 0);
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.finished_handles, (std::vector<int64_t>{a}));
  EXPECT_EQ(o.num_reqs(), 0);
  h.update({});
}

TEST(Scheduler, AbortDuringStepIsDeferredUntilAfterUpdate) {
  Harness h(make_config(16));
  const int64_t a = h.add(params("a", 9, 5));
  const int64_t b = h.add(params("b", 5, 5, 2000));
  h.step();
  h.schedule();
  const int used = h.sched.kv_cache_manager().pool().num_used_blocks();
  h.abort({"a"});
  // The step's KV writes are still in flight: nothing is freed yet.
  ASSERT_NE(h.sched.find(a), nullptr);
  EXPECT_EQ(h.sched.kv_cache_manager().pool().num_used_blocks(), used);
  EXPECT_EQ(h.sched.num_running(), 2);
  const UpdateOutput& u = h.update_from_model();
  EXPECT_EQ(u.req_handles, (std::vector<int64_t>{a, b}));
  EXPECT_EQ(h.sched.find(a), nullptr);
  EXPECT_EQ(h.sched.num_running(), 1);
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.finished_handles, (std::vector<int64_t>{a}));
  EXPECT_EQ(o.req_handles, (std::vector<int64_t>{b}));
  h.update_from_model();
  h.run();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, DeferredAbortOfRequestFinishingInThatStep) {
  Harness h(make_config(16));
  const int64_t a = h.add(params("a", 4, 1));
  h.schedule();
  h.abort({"a"});
  h.update_from_model();  // a finishes with "length" before the abort applies
  EXPECT_EQ(h.finished[a].reason, FinishReason::kLength);
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.finished_handles, (std::vector<int64_t>{a}));
  h.update({});
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, AbortPreemptedRequest) {
  PreemptionScene s(SchedulingPolicy::kFcfs, 0);
  Harness& h = s.h;
  h.schedule();  // preempts c
  h.update_from_model();
  ASSERT_EQ(h.sched.find(s.c)->status, RequestStatus::kPreempted);
  h.abort({"c"});
  EXPECT_EQ(h.sched.find(s.c), nullptr);
  EXPECT_EQ(h.sched.num_waiting(), 0);
  h.run();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, AbortMidPrefillKeepsPoolConsistent) {
  Harness h(make_config(32, 4, 64, /*budget=*/8));
  const int64_t a = h.add(params("a", 30, 2));
  h.step();
  h.step();
  h.abort({"a"});
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
  // The 16 computed tokens (4 blocks) remain usable as a prefix; nothing beyond them is claimed.
  const int64_t b = h.add(params("b", 30, 2));
  const SchedulerOutput& o = h.schedule();
  EXPECT_EQ(o.finished_handles, (std::vector<int64_t>{a}));
  ASSERT_EQ(o.req_handles, (std::vector<int64_t>{b}));
  EXPECT_LE(o.num_computed_tokens[0], 16);
  h.update_from_model();
  h.run();
  h.expect_reference_outputs();
}

TEST(Scheduler, FailedStepAbortsItsRequestsAndCachesNothingItWasToWrite) {
  Harness h(make_config(32, 4, 64, /*budget=*/13));
  const int64_t a = h.add(params("a", 12, 3, 1000));
  h.step();  // a's prompt: 3 blocks of written KV
  const int64_t c = h.add(params("c", 12, 3, 5000));
  const int64_t f = h.add(params("f", 12, 3, 7000));  // no budget left for f in the next step
  const SchedulerOutput& o = h.schedule();
  ASSERT_EQ(o.req_handles, (std::vector<int64_t>{a, c}));
  h.fail();
  EXPECT_EQ(h.sched.num_running(), 0);
  EXPECT_EQ(h.sched.num_waiting(), 1);
  // c's blocks were registered when the step was scheduled; the failure takes them out again.
  Request same_as_c(make_params("probe-c", token_range(12, 5000), 1), 998, 998);
  EXPECT_EQ(h.sched.kv_cache_manager().get_computed_blocks(same_as_c).num_computed_tokens, 0);
  // a's prompt was written by the step before: it stays a valid prefix.
  Request same_as_a(make_params("probe-a", token_range(12, 1000), 1), 999, 999);
  EXPECT_EQ(h.sched.kv_cache_manager().get_computed_blocks(same_as_a).num_computed_tokens, 8);
  h.add(params("c2", 12, 3, 5000));
  h.add(params("a2", 12, 3, 1000));
  h.run();  // the Harness checks that no request reads KV the failed step never wrote
  h.expect_reference_outputs();
  EXPECT_EQ(h.finished.count(f), 1u);
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
}

TEST(Scheduler, FailStepNeedsAStep) {
  Scheduler s(make_config(8));
  EXPECT_OCTAVO_ERROR(s.fail_step(), ErrorKind::kRuntime);
}

// ---------------------------------------------------------------------------------------------
// Randomized workloads: many requests with shared prefixes, stop tokens, priorities, aborts and
// a pool small enough to force preemption. Every step is checked by the Harness; at the end
// every request's outputs must equal what it generates alone and the pool must be empty.

struct Workload {
  SchedulingPolicy policy;
  bool chunked;
  bool caching;
  int block_size;
  int num_blocks;
  int budget;
  int max_num_seqs;
  uint64_t seed;
  int num_speculative_tokens = 0;  // drafts proposed per decoding request (0: speculation off)
};

std::string workload_name(const Workload& w) {
  return std::string(w.policy == SchedulingPolicy::kFcfs ? "Fcfs" : "Priority") + (w.chunked ? "Chunked" : "Whole") +
         (w.caching ? "Cached" : "Uncached") + "_bs" + std::to_string(w.block_size) + "_blocks" +
         std::to_string(w.num_blocks) + "_budget" + std::to_string(w.budget) + "_seqs" + std::to_string(w.max_num_seqs) +
         "_seed" + std::to_string(w.seed) +
         (w.num_speculative_tokens ? "_spec" + std::to_string(w.num_speculative_tokens) : "");
}

void PrintTo(const Workload& w, std::ostream* os) { *os << workload_name(w); }

class SchedulerRandom : public testing::TestWithParam<Workload> {};

TEST_P(SchedulerRandom, MatchesReferenceAndFreesEverything) {
  const Workload w = GetParam();
  SchedulerConfig c;
  c.num_blocks = w.num_blocks;
  c.block_size = w.block_size;
  c.max_model_len = 64;
  c.max_num_batched_tokens = w.budget;
  c.max_num_seqs = w.max_num_seqs;
  c.enable_chunked_prefill = w.chunked;
  c.enable_prefix_caching = w.caching;
  c.policy = w.policy;
  Harness h(c);
  h.vocab = 40;  // small: eos and stop tokens do occur
  h.num_speculative_tokens = w.num_speculative_tokens;

  uint64_t state = w.seed;
  auto rnd = [&state](int n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((state >> 33) % static_cast<uint64_t>(n));
  };
  const std::vector<int32_t> shared = token_range(40, 500);
  const int usable_tokens = (w.num_blocks - 1) * w.block_size;
  int next_id = 0;
  int num_added = 0;
  // Adds a few random requests (sometimes between schedule() and update_from_output()).
  auto add_some = [&]() {
    if (num_added < 60 && rnd(3) == 0) {
      for (int k = 1 + rnd(3); k > 0 && num_added < 60; --k) {
        const int prompt_len = 1 + rnd(40);
        std::vector<int32_t> prompt;
        if (rnd(2)) prompt = slice(shared, 0, std::min(prompt_len, 40));
        for (int i = static_cast<int>(prompt.size()); i < prompt_len; ++i) prompt.push_back(1 + rnd(h.vocab));
        RequestParams p = make_params("req" + std::to_string(next_id++), prompt, 1 + rnd(24));
        if (rnd(3) == 0) p.eos_token_id = 1 + rnd(h.vocab);
        if (rnd(4) == 0) p.stop_token_ids = {1 + rnd(h.vocab), 1 + rnd(h.vocab)};
        if (rnd(4) == 0) p.min_tokens = rnd(p.max_tokens + 1);
        if (rnd(5) == 0) p.ignore_eos = true;
        if (rnd(6) == 0) p.cache_extra_key = static_cast<uint64_t>(1 + rnd(2));
        p.priority = rnd(3);
        // Keep requests that the pool could never hold out of the workload.
        const int max_len = std::min(prompt_len + p.max_tokens, 64);
        if (max_len > usable_tokens) p.max_tokens = std::max(1, usable_tokens - prompt_len);
        p.min_tokens = std::min(p.min_tokens, p.max_tokens);
        if (prompt_len >= usable_tokens) continue;
        h.add(p);
        ++num_added;
      }
    }
  };
  for (int step = 0; step < 4000; ++step) {
    add_some();
    if (!h.sched.has_unfinished_requests()) {
      if (num_added >= 60) break;
      continue;
    }
    h.schedule();
    if (rnd(40) == 0) h.abort({"req" + std::to_string(rnd(next_id))});  // during the step
    if (rnd(4) == 0) add_some();
    h.update_from_model();
    if (rnd(40) == 0) h.abort({"req" + std::to_string(rnd(next_id))});  // between steps
    if (testing::Test::HasFatalFailure() || testing::Test::HasFailure()) {
      ADD_FAILURE() << "stopped at step " << step;
      return;
    }
  }
  h.run();
  EXPECT_EQ(num_added, 60);
  h.expect_reference_outputs();
  expect_all_blocks_free(h.sched.kv_cache_manager().pool());
  EXPECT_FALSE(h.sched.has_unfinished_requests());
  int num_stopped = 0;
  for (const auto& entry : h.finished) num_stopped += entry.second.reason == FinishReason::kStop;
  const int64_t hits = h.sched.kv_cache_manager().pool().stats().hits;
  RecordProperty("preemptions", static_cast<int>(h.sched.num_preemptions()));
  RecordProperty("prefix_cache_hit_tokens", static_cast<int>(hits));
  RecordProperty("aborted", static_cast<int>(h.aborted.size()));
  RecordProperty("stopped", num_stopped);
  if (w.caching) {
    EXPECT_GT(hits, 0) << "the shared prefixes never hit the cache";
  }
  if (w.num_blocks <= 20) {
    EXPECT_GT(h.sched.num_preemptions(), 0) << "the tight pool never preempted";
  }
  if (w.num_speculative_tokens > 0) {
    EXPECT_GT(h.num_drafts_accepted, 0);
    EXPECT_LT(h.num_drafts_accepted, h.num_drafts_verified) << "no draft was ever rejected";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Workloads, SchedulerRandom,
    testing::Values(Workload{SchedulingPolicy::kFcfs, true, true, 4, 20, 32, 8, 1},
                    Workload{SchedulingPolicy::kFcfs, true, true, 4, 20, 7, 8, 2},
                    Workload{SchedulingPolicy::kPriority, true, true, 4, 20, 32, 8, 3},
                    Workload{SchedulingPolicy::kPriority, true, true, 2, 40, 16, 6, 4},
                    Workload{SchedulingPolicy::kFcfs, false, true, 4, 20, 64, 8, 5},
                    Workload{SchedulingPolicy::kPriority, false, true, 4, 20, 64, 8, 6},
                    Workload{SchedulingPolicy::kFcfs, true, false, 4, 20, 32, 8, 7},
                    Workload{SchedulingPolicy::kFcfs, true, true, 16, 6, 48, 4, 8},
                    Workload{SchedulingPolicy::kFcfs, true, true, 4, 200, 256, 32, 9},
                    Workload{SchedulingPolicy::kPriority, true, true, 1, 80, 24, 8, 10},
                    Workload{SchedulingPolicy::kFcfs, true, true, 4, 20, 32, 8, 11, 3},
                    Workload{SchedulingPolicy::kFcfs, true, true, 4, 20, 7, 8, 12, 5},
                    Workload{SchedulingPolicy::kPriority, true, true, 2, 40, 16, 6, 13, 4},
                    Workload{SchedulingPolicy::kFcfs, false, true, 4, 20, 64, 8, 14, 2},
                    Workload{SchedulingPolicy::kFcfs, true, false, 4, 20, 32, 8, 15, 3},
                    Workload{SchedulingPolicy::kPriority, true, true, 1, 80, 24, 8, 16, 6},
                    Workload{SchedulingPolicy::kFcfs, true, true, 4, 200, 256, 32, 17, 7}),
    [](const testing::TestParamInfo<Workload>& info) { return workload_name(info.param); });

}  // namespace
