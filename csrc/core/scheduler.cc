#include "octavo/scheduler.h"

#include <algorithm>
#include <cstdint>

#include "octavo/status.h"

namespace octavo {

void SchedulerConfig::validate() const {
  OCTAVO_CHECK(num_blocks >= 2, "num_blocks must be at least 2 (block 0 is reserved), got " << num_blocks);
  OCTAVO_CHECK(block_size >= 1 && block_size <= 1024, "block_size must be in [1, 1024], got " << block_size);
  OCTAVO_CHECK(max_model_len >= 2, "max_model_len must be at least 2, got " << max_model_len);
  OCTAVO_CHECK(max_num_seqs >= 1, "max_num_seqs must be positive, got " << max_num_seqs);
  OCTAVO_CHECK(max_num_batched_tokens >= 1, "max_num_batched_tokens must be positive, got " << max_num_batched_tokens);
  OCTAVO_CHECK(enable_chunked_prefill || max_num_batched_tokens >= max_model_len,
               "without chunked prefill max_num_batched_tokens (" << max_num_batched_tokens
                   << ") must be at least max_model_len (" << max_model_len << ") so that every prompt fits one step");
  OCTAVO_CHECK(max_num_partial_prefills >= 0, "max_num_partial_prefills must be >= 0, got " << max_num_partial_prefills);
  OCTAVO_CHECK(long_prefill_token_threshold >= 0,
               "long_prefill_token_threshold must be >= 0, got " << long_prefill_token_threshold);
  OCTAVO_CHECK(num_lookahead_tokens >= 0, "num_lookahead_tokens must be >= 0, got " << num_lookahead_tokens);
  OCTAVO_CHECK(kv_group_windows.empty() || kv_group_windows[0] == 0,
               "kv_group_windows[0] must be 0 (group 0 has full attention), got " << kv_group_windows[0]);
  for (int32_t w : kv_group_windows) OCTAVO_CHECK(w >= 0, "kv_group_windows must be >= 0, got " << w);
}

namespace {

SchedulerConfig validated(const SchedulerConfig& config) {
  config.validate();
  return config;
}

// Priority order (lower first), then arrival time, then order of add_request; keeps the waiting
// queue sorted and picks the preemption victim under the priority policy.
bool served_before(const Request* a, const Request* b) {
  const RequestParams& pa = a->params();
  const RequestParams& pb = b->params();
  if (pa.priority != pb.priority) return pa.priority < pb.priority;
  if (pa.arrival_time != pb.arrival_time) return pa.arrival_time < pb.arrival_time;
  return a->arrival_seq() < b->arrival_seq();
}

}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(validated(config)),
      kv_(config.num_blocks, config.block_size, config.max_model_len, config.enable_prefix_caching,
          config.kv_group_windows) {
  // Reserve once so that the buffers Python views do not move between steps.
  const size_t max_reqs = static_cast<size_t>(config.max_num_seqs);
  const size_t max_tokens = static_cast<size_t>(config.max_num_batched_tokens);
  const size_t max_width = static_cast<size_t>(kv_.num_blocks_for(config.max_model_len));
  output_.req_handles.reserve(max_reqs);
  output_.num_scheduled_tokens.reserve(max_reqs);
  output_.num_computed_tokens.reserve(max_reqs);
  output_.is_new.reserve(max_reqs);
  output_.query_start_loc.reserve(max_reqs + 1);
  output_.seq_lens.reserve(max_reqs);
  output_.logits_indices.reserve(max_reqs);
  output_.block_table.reserve(max_reqs * max_width);
  output_.num_kv_groups = kv_.num_groups();
  output_.group_block_tables.reserve((kv_.num_groups() - 1) * max_reqs * max_width);
  output_.group_slot_mappings.reserve((kv_.num_groups() - 1) * max_tokens);
  output_.input_ids.reserve(max_tokens);
  output_.positions.reserve(max_tokens);
  output_.slot_mapping.reserve(max_tokens);
  output_.finished_handles.reserve(max_reqs);
  output_.preempted_handles.reserve(max_reqs);
  update_.req_handles.reserve(max_reqs);
  update_.new_token_offsets.reserve(max_reqs + 1);
  update_.new_token_ids.reserve(max_reqs * static_cast<size_t>(1 + config.num_lookahead_tokens));
  update_.finish_reasons.reserve(max_reqs);
  update_.stop_reasons.reserve(max_reqs);
  running_.reserve(max_reqs);
  scheduled_.reserve(max_reqs);
}

int64_t Scheduler::add_request(RequestParams params) {
  const int prompt_len = static_cast<int>(params.prompt_token_ids.size());
  const std::string& id = params.request_id;
  OCTAVO_CHECK(prompt_len >= 1, "request '" << id << "' has an empty prompt");
  OCTAVO_CHECK(handle_of_.find(id) == handle_of_.end(), "request id '" << id << "' is already in use");
  OCTAVO_CHECK(params.max_tokens >= 1, "max_tokens must be at least 1, got " << params.max_tokens);
  OCTAVO_CHECK(params.min_tokens >= 0 && params.min_tokens <= params.max_tokens,
               "min_tokens must be in [0, max_tokens=" << params.max_tokens << "], got " << params.min_tokens);
  OCTAVO_CHECK(prompt_len < config_.max_model_len,
               "request '" << id << "': the prompt has " << prompt_len << " tokens, which leaves no room to generate "
                           << "within max_model_len=" << config_.max_model_len);
  // The last generated token is never fed back, so its KV slot is never needed.
  const int64_t max_len = std::min<int64_t>(static_cast<int64_t>(prompt_len) + params.max_tokens, config_.max_model_len);
  const int blocks_needed = kv_.max_blocks_per_request(static_cast<int>(max_len) - 1 + config_.num_lookahead_tokens,
                                                       config_.max_num_batched_tokens + config_.num_lookahead_tokens);
  OCTAVO_CHECK(blocks_needed <= kv_.pool().num_usable_blocks(),
               "request '" << id << "' needs up to " << blocks_needed << " KV blocks (" << max_len
                           << " tokens) but the whole pool has " << kv_.pool().num_usable_blocks()
                           << "; lower max_tokens or give the KV cache more memory");
  const int64_t handle = next_handle_++;
  auto request = std::make_unique<Request>(std::move(params), handle, handle);
  Request* raw = request.get();
  handle_of_.emplace(raw->request_id(), handle);
  requests_.emplace(handle, std::move(request));
  enqueue_waiting(raw, /*at_front=*/false);
  return handle;
}

void Scheduler::enqueue_waiting(Request* request, bool at_front) {
  if (config_.policy == SchedulingPolicy::kPriority) {
    waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), request, served_before), request);
  } else if (at_front) {
    waiting_.push_front(request);
  } else {
    waiting_.push_back(request);
  }
}

const Request* Scheduler::find(int64_t handle) const {
  auto it = requests_.find(handle);
  // A request finished while in flight stays allocated until its open steps close.
  return it == requests_.end() || it->second->status == RequestStatus::kFinished ? nullptr : it->second.get();
}

const Request* Scheduler::find(const std::string& id) const {
  auto it = handle_of_.find(id);
  return it == handle_of_.end() ? nullptr : find(it->second);
}

void Scheduler::abort_requests(const std::vector<std::string>& request_ids) {
  for (const std::string& id : request_ids) {
    auto it = handle_of_.find(id);
    if (it == handle_of_.end()) continue;
    Request* request = requests_.at(it->second).get();
    if (!in_flight_.empty()) {  // applied once no open step holds it
      if (!request->abort_pending) pending_aborts_.push_back(request->handle());
      request->abort_pending = true;
      continue;
    }
    unqueue(request);
    finish(request, FinishReason::kAbort);
  }
}

void Scheduler::unqueue(Request* request) {
  if (request->status == RequestStatus::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), request));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), request));
  }
}

// The blocks go back at once (an open step that still writes them runs before any later step
// that reuses them); the Request itself stays until no open step points at it.
void Scheduler::finish(Request* request, FinishReason reason, int num_valid_tokens) {
  request->status = RequestStatus::kFinished;
  if (request->finish_reason == FinishReason::kNone) request->finish_reason = reason;
  kv_.free(*request, num_valid_tokens);
  finished_since_schedule_.push_back(request->handle());
  handle_of_.erase(request->request_id());
  release_if_landed(request);
}

void Scheduler::release_if_landed(Request* request) {
  if (request->status == RequestStatus::kFinished && request->num_steps_in_flight == 0) {
    requests_.erase(request->handle());
  }
}

const SchedulerOutput& Scheduler::schedule(int max_num_reqs) {
  apply_pending_aborts();  // those no open step holds any more
  output_.preempted_handles.clear();
  output_.block_copies.clear();
  scheduled_.clear();
  int budget = config_.max_num_batched_tokens;
  const size_t max_reqs = max_num_reqs > 0 ? static_cast<size_t>(max_num_reqs) : SIZE_MAX;
  schedule_running(budget, max_reqs);
  if (output_.preempted_handles.empty()) schedule_waiting(budget, max_reqs);
  fill_output();
  output_.finished_handles.assign(finished_since_schedule_.begin(), finished_since_schedule_.end());
  finished_since_schedule_.clear();
  for (Scheduled& s : scheduled_) {
    Request* r = s.request;
    s.num_computed_before = r->num_computed_tokens;
    r->num_computed_tokens += s.num_tokens;
    s.samples = r->num_computed_tokens - s.num_drafts == r->num_tokens();
    r->spec_token_ids.clear();  // verified by this step, or (those the budget cut off) dropped
    ++r->num_steps_in_flight;
  }
  if (!scheduled_.empty() || in_flight_.empty()) in_flight_.push_back(scheduled_);
  return output_;
}

int Scheduler::cap_new_tokens(const Request& request, int num_new_tokens, int budget) const {
  // The threshold splits long prompts, so it only applies where prompts may be split.
  const int threshold = config_.long_prefill_token_threshold;
  if (threshold > 0 && config_.enable_chunked_prefill) num_new_tokens = std::min(num_new_tokens, threshold);
  num_new_tokens = std::min(num_new_tokens, budget);
  // Positions stay below max_model_len.
  return std::min(num_new_tokens, config_.max_model_len - 1 - request.num_computed_tokens);
}

void Scheduler::schedule_running(int& budget, size_t max_reqs) {
  for (size_t i = 0; i < running_.size() && budget > 0 && scheduled_.size() < max_reqs; ++i) {
    Request* request = running_[i];
    if (request->abort_pending) continue;  // it ends when its open steps close
    const int uncomputed = request->num_tokens() - request->num_computed_tokens;
    const int wanted = uncomputed + static_cast<int>(request->spec_token_ids.size());
    const int num_new = cap_new_tokens(*request, wanted, budget);
    if (num_new <= 0) continue;
    const size_t num_preempted = output_.preempted_handles.size();
    if (!allocate_or_preempt(request, num_new, budget)) break;
    // A priority victim may have stood before this request; find where it stands now.
    if (output_.preempted_handles.size() != num_preempted) i = std::find(running_.begin(), running_.end(), request) - running_.begin();
    scheduled_.push_back({request, num_new, false});
    scheduled_.back().num_drafts = std::max(0, num_new - uncomputed);  // the budget may cut drafts off
    budget -= num_new;
  }
}

bool Scheduler::allocate_or_preempt(Request* request, int num_new_tokens, int& budget) {
  while (!kv_.allocate_slots(*request, num_new_tokens, nullptr, config_.num_lookahead_tokens)) {
    Request* victim = pick_victim();
    if (victim == nullptr) return false;  // the others are in flight: they free blocks as they land
    preempt(victim, budget);
    if (victim == request) return false;
  }
  return true;
}

Request* Scheduler::pick_victim() {
  // FCFS: the latest running request; priority: the one served last (largest priority value,
  // latest arrival). Requests in flight are passed over.
  Request* victim = nullptr;
  for (Request* r : running_) {
    if (r->num_steps_in_flight > 0) continue;
    if (victim == nullptr || config_.policy != SchedulingPolicy::kPriority || served_before(victim, r)) victim = r;
  }
  return victim;
}

void Scheduler::preempt(Request* victim, int& budget) {
  running_.erase(std::find(running_.begin(), running_.end(), victim));
  // A victim already scheduled in this step gives its tokens back to the budget.
  auto it = std::find_if(scheduled_.begin(), scheduled_.end(), [&](const Scheduled& s) { return s.request == victim; });
  if (it != scheduled_.end()) {
    budget += it->num_tokens;
    scheduled_.erase(it);
  }
  // KV written in earlier steps stays cached for the recompute; slots reserved this step are not.
  kv_.free(*victim, victim->num_computed_tokens);
  victim->num_computed_tokens = 0;
  victim->spec_token_ids.clear();
  victim->status = RequestStatus::kPreempted;
  victim->num_preemptions += 1;
  ++num_preemptions_;
  output_.preempted_handles.push_back(victim->handle());
  enqueue_waiting(victim, /*at_front=*/true);
}

void Scheduler::schedule_waiting(int& budget, size_t max_reqs) {
  int partial_prefills = 0;
  for (const Scheduled& s : scheduled_) partial_prefills += s.request->num_computed_tokens + s.num_tokens < s.request->num_tokens();
  while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < config_.max_num_seqs &&
         scheduled_.size() < max_reqs) {
    Request* request = waiting_.front();
    ComputedBlocks hits = kv_.get_computed_blocks(*request);
    int wanted = 0, num_new = 0;
    bool partial = false, admitted = false;
    for (;;) {
      wanted = request->num_tokens() - hits.num_computed_tokens;
      if (!config_.enable_chunked_prefill && wanted > budget) break;
      num_new = std::min(cap_new_tokens(*request, wanted, budget), wanted);
      partial = num_new < wanted;
      const int cap = config_.max_num_partial_prefills;
      if (partial && cap > 0 && partial_prefills >= cap) break;
      admitted = kv_.allocate_slots(*request, num_new, &hits, config_.num_lookahead_tokens);
      // A partial-block hit holds one more block (the one it copies): where that is the block
      // too many, the request computes those tokens instead.
      if (admitted || hits.partial_block < 0) break;
      hits.num_computed_tokens -= hits.num_partial_tokens;
      hits.partial_block = -1;
      hits.num_partial_tokens = 0;
    }
    if (!admitted) break;
    waiting_.pop_front();
    request->num_computed_tokens = hits.num_computed_tokens;
    request->status = RequestStatus::kRunning;
    running_.push_back(request);
    scheduled_.push_back({request, num_new, true});
    if (request->copy_src >= 0) {  // its first tokens' KV comes from a cached partial block
      output_.block_copies.insert(output_.block_copies.end(), {request->copy_src, request->copy_dst});
      scheduled_.back().copy_src = request->copy_src;
      request->copy_src = request->copy_dst = -1;
    }
    budget -= num_new;
    partial_prefills += partial;
  }
}

void Scheduler::fill_output() {
  SchedulerOutput& out = output_;
  const int bs = kv_.block_size();
  out.req_handles.clear();
  out.num_scheduled_tokens.clear();
  out.num_computed_tokens.clear();
  out.is_new.clear();
  out.input_ids.clear();
  out.positions.clear();
  out.slot_mapping.clear();
  out.seq_lens.clear();
  out.num_draft_tokens.clear();
  out.logits_indices.clear();
  out.query_start_loc.assign(1, 0);
  int width = 0;
  for (const Scheduled& s : scheduled_) width = std::max(width, static_cast<int>(s.request->block_ids.size()));
  out.block_table_width = width;
  out.block_table.assign(scheduled_.size() * static_cast<size_t>(width), BlockPool::kNullBlock);

  for (size_t i = 0; i < scheduled_.size(); ++i) {
    const Request& r = *scheduled_[i].request;
    const int start = r.num_computed_tokens;
    const int end = start + scheduled_[i].num_tokens;
    out.req_handles.push_back(r.handle());
    out.num_scheduled_tokens.push_back(scheduled_[i].num_tokens);
    out.num_computed_tokens.push_back(start);
    out.is_new.push_back(scheduled_[i].is_new ? 1 : 0);
    const int32_t* ids = r.block_ids.data();
    const int num_tokens = r.num_tokens();
    for (int pos = start; pos < end; ++pos) {
      out.input_ids.push_back(pos < num_tokens ? r.token_ids()[pos] : r.spec_token_ids[pos - num_tokens]);
      out.positions.push_back(pos);
      out.slot_mapping.push_back(ids[pos / bs] * bs + pos % bs);
    }
    out.query_start_loc.push_back(static_cast<int32_t>(out.input_ids.size()));
    out.seq_lens.push_back(end);
    const int num_drafts = scheduled_[i].num_drafts;
    out.num_draft_tokens.push_back(num_drafts);
    for (int k = num_drafts; k >= 0; --k) out.logits_indices.push_back(static_cast<int32_t>(out.input_ids.size()) - 1 - k);
    std::copy(r.block_ids.begin(), r.block_ids.end(), out.block_table.begin() + static_cast<ptrdiff_t>(i) * width);
  }
  fill_group_tables();
}

void Scheduler::fill_group_tables() {
  SchedulerOutput& out = output_;
  const int bs = kv_.block_size();
  const size_t num_reqs = scheduled_.size(), width = static_cast<size_t>(out.block_table_width);
  out.group_block_tables.assign((kv_.num_groups() - 1) * num_reqs * width, BlockPool::kNullBlock);
  out.group_slot_mappings.clear();
  for (int g = 1; g < kv_.num_groups(); ++g) {
    for (size_t i = 0; i < num_reqs; ++i) {
      const Request& r = *scheduled_[i].request;
      const std::vector<int32_t>& ids = r.block_table(g);
      std::copy(ids.begin(), ids.end(), out.group_block_tables.begin() + ((g - 1) * num_reqs + i) * width);
      const int start = r.num_computed_tokens;
      for (int pos = start; pos < start + scheduled_[i].num_tokens; ++pos) {
        out.group_slot_mappings.push_back(ids[pos / bs] * bs + pos % bs);
      }
    }
  }
}

std::vector<Scheduler::Scheduled> Scheduler::close_oldest_step() {
  std::vector<Scheduled> step = std::move(in_flight_.front());
  in_flight_.pop_front();
  for (const Scheduled& s : step) {
    --s.request->num_steps_in_flight;
    if (s.copy_src >= 0) kv_.release_copy_source(s.copy_src);  // copied by now
  }
  return step;
}

const UpdateOutput& Scheduler::update_from_output(const int32_t* sampled, const int32_t* offsets) {
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, !in_flight_.empty(), "update_from_output() called without a schedule() before it");
  const std::vector<Scheduled> step = close_oldest_step();
  UpdateOutput& up = update_;
  up.req_handles.clear();
  up.new_token_ids.clear();
  up.finish_reasons.clear();
  up.stop_reasons.clear();
  up.new_token_offsets.assign(1, 0);
  std::vector<Request*> stopped_now;
  for (size_t i = 0; i < step.size(); ++i) {
    Request* r = step[i].request;
    up.req_handles.push_back(r->handle());
    const int begin = offsets ? offsets[i] : static_cast<int>(i);
    const int end = offsets ? offsets[i + 1] : static_cast<int>(i) + 1;
    bool stopped = false;
    const bool retired = r->status == RequestStatus::kFinished;  // by a failed step before this one
    if (step[i].samples && !retired) {
      for (int k = begin; k < end && !stopped; ++k) {
        r->append_output_token(sampled[k]);
        up.new_token_ids.push_back(sampled[k]);
        stopped = r->check_stop(config_.max_model_len);
      }
      // The rejected drafts' KV is not the request's: their slots are computed again. After a
      // stop, KV past the last kept token is no part of it either (it may be cached at free).
      const int num_rejected = std::max(0, step[i].num_drafts + 1 - (end - begin));
      r->num_computed_tokens = std::min(r->num_computed_tokens - num_rejected, r->num_tokens());
    }
    up.new_token_offsets.push_back(static_cast<int32_t>(up.new_token_ids.size()));
    up.finish_reasons.push_back(static_cast<int8_t>(stopped ? r->finish_reason : FinishReason::kNone));
    up.stop_reasons.push_back(stopped ? r->stop_reason : -1);
    if (stopped) stopped_now.push_back(r);
    if (retired) release_if_landed(r);
  }
  for (Request* r : stopped_now) {
    unqueue(r);
    finish(r, r->finish_reason);
  }
  apply_pending_aborts();
  return up;
}

std::vector<int64_t> Scheduler::fail_step() {
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, !in_flight_.empty(), "fail_step() called without a schedule() before it");
  std::vector<int64_t> aborted;
  for (const Scheduled& s : close_oldest_step()) {
    Request* r = s.request;
    if (r->status == RequestStatus::kFinished) {  // a failed step before this one ended it
      release_if_landed(r);
      continue;
    }
    aborted.push_back(r->handle());
    unqueue(r);
    // Only the tokens before this step are in the cache; a later open step of the request
    // computes on top of KV that was never written, so it is ended too (its rows report nothing).
    // A block this step was to copy may never have been copied: only the full blocks before it count.
    const int bs = kv_.block_size();
    const int valid = s.copy_src >= 0 ? s.num_computed_before / bs * bs : s.num_computed_before;
    finish(r, FinishReason::kAbort, valid);
  }
  apply_pending_aborts();
  return aborted;
}

void Scheduler::set_draft_tokens(int64_t handle, const int32_t* tokens, int count) {
  auto it = requests_.find(handle);
  if (it == requests_.end()) return;
  Request* r = it->second.get();
  if (r->status != RequestStatus::kRunning || r->num_steps_in_flight > 0 || r->abort_pending ||
      r->num_computed_tokens != r->num_tokens() - 1) {
    return;
  }
  const int room = r->params().max_tokens - r->num_output_tokens() - 1;
  r->spec_token_ids.assign(tokens, tokens + std::max(0, std::min(count, room)));
}

void Scheduler::apply_pending_aborts() {
  if (pending_aborts_.empty()) return;
  std::vector<int64_t> still_in_flight;
  for (int64_t handle : pending_aborts_) {
    auto it = requests_.find(handle);
    if (it == requests_.end() || it->second->status == RequestStatus::kFinished) continue;  // ended meanwhile
    Request* r = it->second.get();
    if (r->num_steps_in_flight > 0) {
      still_in_flight.push_back(handle);
      continue;
    }
    unqueue(r);
    finish(r, FinishReason::kAbort);
  }
  pending_aborts_.swap(still_in_flight);
}

}  // namespace octavo
