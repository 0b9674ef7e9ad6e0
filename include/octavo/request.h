// A generation request as the scheduler sees it: token ids, stop conditions, scheduling keys,
// and the KV blocks it holds. Sampling parameters that do not affect scheduling live in Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace octavo {

enum class RequestStatus : uint8_t { kWaiting, kRunning, kPreempted, kFinished };

// Why a request finished. Numeric values are part of the Python binding.
enum class FinishReason : int8_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort" as in vLLM

struct RequestParams {
  std::string request_id;                 // unique among unfinished requests
  std::vector<int32_t> prompt_token_ids;  // at least one token
  int32_t max_tokens = 16;                // output tokens at most (>= 1)
  int32_t min_tokens = 0;                 // eos / stop tokens are ignored before this many outputs
  int32_t eos_token_id = -1;              // -1: the model has none
  std::vector<int32_t> stop_token_ids;    // finish with reason "stop" and stop_reason = the token
  bool ignore_eos = false;
  int32_t priority = 0;                   // priority policy: lower value is served first (as vLLM)
  double arrival_time = 0.0;              // seconds; priority policy: breaks priority ties,
                                          // then the order of add_request does
  uint64_t cache_extra_key = 0;           // prefix-cache extra key (LoRA id, multimodal hash,
                                          // cache salt folded to 64 bits by the caller); 0 = none
  bool skip_reading_prefix_cache = false;  // compute the whole prompt even where it is cached (its
                                           // blocks are still cached for others): prompt logprobs
                                           // need the hidden state of every prompt position
};

class Request {
 public:
  Request(RequestParams params, int64_t handle, int64_t arrival_seq);

  const std::string& request_id() const { return params_.request_id; }
  int64_t handle() const { return handle_; }
  const RequestParams& params() const { return params_; }
  int64_t arrival_seq() const { return arrival_seq_; }  // order of add_request, for ties

  const std::vector<int32_t>& token_ids() const { return token_ids_; }  // prompt + outputs
  int num_tokens() const { return static_cast<int>(token_ids_.size()); }
  int num_prompt_tokens() const { return static_cast<int>(params_.prompt_token_ids.size()); }
  int num_output_tokens() const { return num_tokens() - num_prompt_tokens(); }
  void append_output_token(int32_t token) { token_ids_.push_back(token); }

  // Chained prefix-cache hash of full block i of token_ids(); hashes are computed as blocks fill.
  uint64_t block_hash(int i, int block_size);
  // The hash of block i's first n (< block_size) tokens, chained from full block i - 1.
  uint64_t partial_block_hash(int i, int n, int block_size);

  // Applies vLLM's stop rules to the newest token; sets finish_reason / stop_reason on a stop.
  bool check_stop(int max_model_len);

  RequestStatus status = RequestStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_reason = -1;              // the stop token that ended the request, or -1
  int num_computed_tokens = 0;           // tokens whose KV is (or, this step, will be) in the cache
  int num_preemptions = 0;
  int num_steps_in_flight = 0;           // open steps (scheduled, not yet updated) that hold it
  bool abort_pending = false;            // aborted while in flight: finishes when its steps end

  // Owned by KVCacheManager: the request's block table and how many of its blocks are cached.
  std::vector<int32_t> block_ids;
  int num_cached_blocks = 0;
  // Hybrid models: the block tables of KV groups 1, 2, ... (group 0's is block_ids), each as long
  // as block_ids. A sliding-window group holds the null block where its window has moved on.
  std::vector<std::vector<int32_t>> group_block_ids;
  std::vector<int32_t>& block_table(int group) { return group == 0 ? block_ids : group_block_ids[group - 1]; }
  const std::vector<int32_t>& block_table(int group) const {
    return group == 0 ? block_ids : group_block_ids[group - 1];
  }
  // A partial-block cache hit admitted in the current schedule(): the cached block (held until
  // the step that copies it closes) and the request's own block it is copied into; -1: none.
  int32_t copy_src = -1, copy_dst = -1;
  // Speculative decoding: draft tokens to follow token_ids() in the request's next step, where
  // they are verified; the step that schedules the request takes them (Scheduler::set_draft_tokens).
  std::vector<int32_t> spec_token_ids;

 private:
  RequestParams params_;
  int64_t handle_;
  int64_t arrival_seq_;
  std::vector<int32_t> token_ids_;
  std::vector<uint64_t> block_hashes_;
};

}  // namespace octavo
