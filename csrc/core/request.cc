#include "octavo/request.h"

#include <algorithm>

#include "octavo/block_pool.h"

namespace octavo {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kNone: break;
  }
  return "none";
}

Request::Request(RequestParams params, int64_t handle, int64_t arrival_seq)
    : params_(std::move(params)), handle_(handle), arrival_seq_(arrival_seq), token_ids_(params_.prompt_token_ids) {}

uint64_t Request::block_hash(int i, int block_size) {
  while (static_cast<int>(block_hashes_.size()) <= i) {
    const int n = static_cast<int>(block_hashes_.size());
    const uint64_t parent = n == 0 ? 0 : block_hashes_.back();
    block_hashes_.push_back(
        hash_block_tokens(parent, token_ids_.data() + static_cast<size_t>(n) * block_size, block_size,
                          params_.cache_extra_key));
  }
  return block_hashes_[i];
}

uint64_t Request::partial_block_hash(int i, int n, int block_size) {
  const uint64_t parent = i == 0 ? 0 : block_hash(i - 1, block_size);
  return hash_block_tokens(parent, token_ids_.data() + static_cast<size_t>(i) * block_size, n,
                           params_.cache_extra_key);
}

bool Request::check_stop(int max_model_len) {
  const int32_t last = token_ids_.back();
  if (num_output_tokens() >= params_.min_tokens) {
    if (!params_.ignore_eos && params_.eos_token_id >= 0 && last == params_.eos_token_id) {
      finish_reason = FinishReason::kStop;
      return true;
    }
    const auto& stops = params_.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), last) != stops.end()) {
      finish_reason = FinishReason::kStop;
      stop_reason = last;
      return true;
    }
  }
  if (num_output_tokens() >= params_.max_tokens || num_tokens() >= max_model_len) {
    finish_reason = FinishReason::kLength;
    return true;
  }
  return false;
}

}  // namespace octavo
