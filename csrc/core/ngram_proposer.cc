#include "octavo/ngram_proposer.h"

#include <algorithm>

#include "octavo/status.h"

namespace octavo {

void NgramConfig::validate() const {
  OCTAVO_CHECK(min_n >= 1, "prompt_lookup_min must be at least 1, got " << min_n);
  OCTAVO_CHECK(max_n >= min_n, "prompt_lookup_max (" << max_n << ") must be at least prompt_lookup_min (" << min_n
                                                     << ")");
  OCTAVO_CHECK(num_tokens >= 1, "num_speculative_tokens must be at least 1, got " << num_tokens);
  OCTAVO_CHECK(max_model_len >= 0, "max_model_len must be non-negative, got " << max_model_len);
}

namespace {

// The earliest p < count - n where tokens[p, p + n) equals the last n tokens, or -1.
int earliest_match(const int32_t* tokens, int count, int n) {
  const int32_t* suffix = tokens + count - n;
  for (int p = 0; p + n < count; ++p) {
    if (tokens[p] == suffix[0] && std::equal(suffix + 1, suffix + n, tokens + p + 1)) return p;
  }
  return -1;
}

}  // namespace

std::vector<int32_t> propose_ngram(const int32_t* tokens, int count, const NgramConfig& config) {
  int room = config.num_tokens;
  if (config.max_model_len > 0) room = std::min(room, config.max_model_len - count);
  if (room <= 0) return {};
  for (int n = std::min(config.max_n, count - 1); n >= config.min_n; --n) {
    const int p = earliest_match(tokens, count, n);
    if (p < 0) continue;
    const int begin = p + n;
    return std::vector<int32_t>(tokens + begin, tokens + std::min(count, begin + room));
  }
  return {};
}

}  // namespace octavo
