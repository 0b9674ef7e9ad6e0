// The continuous-batching scheduler, with vLLM v1 semantics: one token budget per step shared by
// decodes and prefill chunks, running requests served before waiting ones, chunked prefill,
// prefix-cache hits skipping computed tokens, and preemption by recompute when blocks run out.
//
// One engine step is: schedule() -> forward over the flat batch it describes -> one
// update_from_output() with the tokens sampled for that batch. More than one step may be open
// at once (pipeline parallel keeps a batch per stage in flight): schedule() then takes only
// tokens no open step holds, and updates close the open steps in the order they were scheduled.
//
// Speculative decoding: a decoding request may carry draft tokens (set_draft_tokens). Its step
// then computes its newest token and the drafts (they count against the token budget and get KV
// slots) and samples one row per draft plus one; the update takes the accepted drafts and the
// token after them, and the rejected drafts' KV slots are written again by the next step. Drafts
// never reach token_ids(), so they are never hashed into the prefix cache.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "octavo/kv_cache_manager.h"
#include "octavo/request.h"

namespace octavo {

enum class SchedulingPolicy { kFcfs, kPriority };

struct SchedulerConfig {
  int num_blocks = 0;                     // KV blocks in the pool, including the null block
  int block_size = 16;                    // tokens per block
  int max_model_len = 2048;               // prompt + output tokens of one request, at most
  int max_num_seqs = 256;                 // running requests, at most
  int max_num_batched_tokens = 2048;      // token budget of one step
  bool enable_chunked_prefill = true;     // split prompts across steps to fit the budget
  bool enable_prefix_caching = true;
  int max_num_partial_prefills = 1;       // requests mid-prefill at once (0 = no cap)
  int long_prefill_token_threshold = 0;   // with chunked prefill: cap on one request's tokens
                                          // per step (0 = none)
  int num_lookahead_tokens = 0;           // extra KV slots per request for speculative tokens
  std::vector<int32_t> kv_group_windows;  // hybrid models: each KV group's sliding window (0: full;
                                          // group 0's is 0); empty: one group (kv_cache_manager.h)
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;

  void validate() const;  // throws a ValueError-kind Error naming the bad field
};

// What one step computes, as flat arrays ready for a model runner. R = number of scheduled
// requests, T = total scheduled tokens. The buffers are reused by the next schedule().
struct SchedulerOutput {
  std::vector<int64_t> req_handles;           // [R] batch order: running requests, then new/resumed
  std::vector<int32_t> num_scheduled_tokens;  // [R] tokens computed for each request this step
  std::vector<int32_t> num_computed_tokens;   // [R] tokens already in the KV cache before this step
  std::vector<uint8_t> is_new;                // [R] 1: new or resumed after preemption; 0: continues
  std::vector<int32_t> input_ids;             // [T]
  std::vector<int32_t> positions;             // [T]
  std::vector<int32_t> slot_mapping;          // [T] block_id * block_size + offset of each token's KV
  std::vector<int32_t> query_start_loc;       // [R + 1] prefix sums of num_scheduled_tokens
  std::vector<int32_t> seq_lens;              // [R] num_computed_tokens + num_scheduled_tokens
  std::vector<int32_t> block_table;           // [R, block_table_width] padded with the null block 0
  int block_table_width = 0;
  // Hybrid models: KV groups 1, 2, ...'s block tables [G - 1, R, block_table_width] and slot
  // mappings [G - 1, T] (block_table and slot_mapping are group 0's); empty with one group.
  std::vector<int32_t> group_block_tables;
  std::vector<int32_t> group_slot_mappings;
  int num_kv_groups = 1;
  std::vector<int32_t> num_draft_tokens;      // [R] draft tokens scheduled after each request's newest token
  std::vector<int32_t> logits_indices;        // [R + D] sampled token rows, each request's in a run: its
                                              //   drafts' positions' (predicting the next draft) and its
                                              //   last token's; D = sum of num_draft_tokens
  std::vector<int64_t> finished_handles;      // finished or aborted since the previous step
  std::vector<int64_t> preempted_handles;     // preempted in this step
  std::vector<int32_t> block_copies;          // [2C] (src, dst) block pairs to copy, all layers, K and V,
                                              //   before this step's forward: partial-block cache hits

  int num_reqs() const { return static_cast<int>(req_handles.size()); }
  int total_num_scheduled_tokens() const { return static_cast<int>(input_ids.size()); }
  int total_num_draft_tokens() const { return static_cast<int>(logits_indices.size() - req_handles.size()); }
};

// What update_from_output() produced, for the scheduled requests in batch order.
struct UpdateOutput {
  std::vector<int64_t> req_handles;        // [R]
  std::vector<int32_t> new_token_offsets;  // [R + 1] request i's new tokens are
  std::vector<int32_t> new_token_ids;      //   new_token_ids[offsets[i] : offsets[i + 1]]
  std::vector<int8_t> finish_reasons;      // [R] FinishReason values; 0 = still running
  std::vector<int32_t> stop_reasons;       // [R] stop token id, or -1
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  // Queues a request and returns its handle. Throws a ValueError-kind Error for an empty prompt,
  // a duplicate id, bad limits, or a request that could never fit the model length or the pool.
  int64_t add_request(RequestParams params);
  // Finishes requests with reason "abort" and frees their blocks. Unknown or finished ids are
  // ignored. Called while a step is open, it takes effect once no open step holds the request
  // (after the update that closes its last one), so that the steps' KV writes stay valid.
  void abort_requests(const std::vector<std::string>& request_ids);

  // Opens a step over the tokens no open step holds. A request in flight is never preempted
  // (its step would write KV it no longer owns). With steps open and nothing to schedule it
  // opens none (num_reqs() == 0); with none open it opens an empty one, closed by an update
  // with no tokens. max_num_reqs > 0 caps the step's requests: pipeline parallel splits the
  // running requests into one batch per stage, so that the stages overlap.
  const SchedulerOutput& schedule(int max_num_reqs = 0);
  // Closes the oldest open step. sampled[offsets[i] .. offsets[i + 1]) are the tokens sampled
  // for its request i; offsets may be null (exactly one token per request). Tokens of a request
  // whose step stopped short of its last token (a prefill chunk), or that a failed step
  // finished meanwhile, are ignored. A request that verified k drafts gets its accepted drafts
  // and the token after them (n <= k + 1 tokens); its k + 1 - n rejected drafts' KV no longer
  // counts as computed. Tokens after one that stops the request are dropped.
  const UpdateOutput& update_from_output(const int32_t* sampled, const int32_t* offsets = nullptr);
  // Closes the oldest open step, whose forward pass failed, in place of update_from_output():
  // every request it scheduled finishes with reason "abort", and the blocks it was to fill leave
  // the prefix cache (their KV may never have been written). Returns the handles it aborted, in
  // batch order.
  std::vector<int64_t> fail_step();

  // Speculative decoding: the draft tokens request `handle` verifies in its next step, replacing
  // any it had. Kept only for a running request whose newest token is its only uncomputed one
  // and that no open step holds (else ignored, as is an unknown handle); cut to what max_tokens
  // leaves room for (a step verifying k drafts yields up to k + 1 tokens).
  void set_draft_tokens(int64_t handle, const int32_t* tokens, int count);

  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  bool has_unfinished_requests() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  bool in_step() const { return !in_flight_.empty(); }  // a step is scheduled and not yet updated
  int num_steps_in_flight() const { return static_cast<int>(in_flight_.size()); }
  // Requests of the oldest open step: the one the next update closes.
  int num_scheduled_reqs() const { return in_flight_.empty() ? 0 : static_cast<int>(in_flight_.front().size()); }

  const Request* find(int64_t handle) const;        // unfinished requests only; null otherwise
  const Request* find(const std::string& id) const;
  const std::vector<Request*>& running() const { return running_; }
  const std::deque<Request*>& waiting() const { return waiting_; }
  const SchedulerConfig& config() const { return config_; }
  KVCacheManager& kv_cache_manager() { return kv_; }
  const KVCacheManager& kv_cache_manager() const { return kv_; }

 private:
  struct Scheduled {
    Request* request;
    int num_tokens;
    bool is_new;
    int num_computed_before = 0;  // the request's computed tokens when the step was scheduled
    bool samples = false;         // the step reaches the request's last token: its token is kept
    int32_t copy_src = -1;        // a partial cached block this step copies: held until it closes
    int num_drafts = 0;           // draft tokens it verifies (the last num_drafts of num_tokens)
  };

  void schedule_running(int& budget, size_t max_reqs);
  void schedule_waiting(int& budget, size_t max_reqs);
  bool allocate_or_preempt(Request* request, int num_new_tokens, int& budget);
  Request* pick_victim();  // null when every running request is in flight
  void preempt(Request* victim, int& budget);
  void enqueue_waiting(Request* request, bool at_front);
  int cap_new_tokens(const Request& request, int num_new_tokens, int budget) const;
  void fill_output();
  void fill_group_tables();
  void finish(Request* request, FinishReason reason, int num_valid_tokens = -1);
  void release_if_landed(Request* request);
  void unqueue(Request* request);
  std::vector<Scheduled> close_oldest_step();
  void apply_pending_aborts();

  SchedulerConfig config_;
  KVCacheManager kv_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;  // unfinished, by handle
  std::unordered_map<std::string, int64_t> handle_of_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Scheduled> scheduled_;                // the step schedule() is building
  std::deque<std::vector<Scheduled>> in_flight_;    // open steps, oldest first
  std::vector<int64_t> pending_aborts_;             // handles aborted while a step was open
  std::vector<int64_t> finished_since_schedule_;    // reported by the next schedule()
  SchedulerOutput output_;
  UpdateOutput update_;
  int64_t next_handle_ = 1;
  int64_t num_preemptions_ = 0;
};

}  // namespace octavo
