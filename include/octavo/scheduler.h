// The continuous-batching scheduler, with vLLM v1 semantics: one token budget per step shared by
// decodes and prefill chunks, running requests served before waiting ones, chunked prefill,
// prefix-cache hits skipping computed tokens, and preemption by recompute when blocks run out.
//
// One engine step is: schedule() -> forward over the flat batch it describes -> one
// update_from_output() with the tokens sampled for that batch.
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
  std::vector<int32_t> logits_indices;        // [R] token whose logits each request samples from
  std::vector<int64_t> finished_handles;      // finished or aborted since the previous step
  std::vector<int64_t> preempted_handles;     // preempted in this step

  int num_reqs() const { return static_cast<int>(req_handles.size()); }
  int total_num_scheduled_tokens() const { return static_cast<int>(input_ids.size()); }
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
  // ignored. Called between schedule() and update_from_output(), it takes effect after the
  // update so that the step's KV writes stay valid.
  void abort_requests(const std::vector<std::string>& request_ids);

  const SchedulerOutput& schedule();
  // sampled[offsets[i] .. offsets[i + 1]) are the tokens sampled for request i of the last
  // schedule(); offsets may be null (exactly one token per request). Tokens of a request still
  // in its prefill are ignored.
  const UpdateOutput& update_from_output(const int32_t* sampled, const int32_t* offsets = nullptr);
  // Ends a step whose forward pass failed, in place of update_from_output(): every request the
  // step scheduled finishes with reason "abort", and the blocks it was to fill leave the prefix
  // cache (their KV may never have been written). Returns the handles it aborted, in batch order.
  std::vector<int64_t> fail_step();

  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  bool has_unfinished_requests() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  bool in_step() const { return in_step_; }  // schedule() was called, update_from_output() not yet
  int num_scheduled_reqs() const { return static_cast<int>(scheduled_.size()); }

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
  };

  void schedule_running(int& budget);
  void schedule_waiting(int& budget);
  bool allocate_or_preempt(Request* request, int num_new_tokens, int& budget);
  Request* pick_victim();
  void preempt(Request* victim, int& budget);
  void enqueue_waiting(Request* request, bool at_front);
  int cap_new_tokens(const Request& request, int num_new_tokens, int budget) const;
  void fill_output();
  void finish(Request* request, FinishReason reason);
  void apply_pending_aborts();

  SchedulerConfig config_;
  KVCacheManager kv_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;  // unfinished, by handle
  std::unordered_map<std::string, int64_t> handle_of_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  std::vector<Scheduled> scheduled_;
  std::vector<std::string> pending_aborts_;
  SchedulerOutput output_;
  UpdateOutput update_;
  int64_t next_handle_ = 1;
  int64_t num_preemptions_ = 0;
  bool in_step_ = false;  // between schedule() and update_from_output()
};

}  // namespace octavo
