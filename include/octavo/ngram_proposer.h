// Prompt lookup ("ngram" speculative decoding, vLLM's NgramProposer): the draft for a request is
// what followed, earlier in its own tokens, the longest n-gram that ends them.
#pragma once

#include <cstdint>
#include <vector>

namespace octavo {

struct NgramConfig {
  int min_n = 1;          // prompt_lookup_min: the shortest suffix worth matching (>= 1)
  int max_n = 3;          // prompt_lookup_max: the longest suffix tried (>= min_n)
  int num_tokens = 5;     // num_speculative_tokens: the longest draft (>= 1)
  int max_model_len = 0;  // drafts stop at this many tokens in all (0: no limit)

  void validate() const;  // throws a ValueError-kind Error naming the bad field
};

// For n from max_n down to min_n: the suffix of n tokens of tokens[0, count) is looked for at the
// earliest position p < count - n; the first n found gives the draft tokens[p + n, ...), at most
// num_tokens of them and at most max_model_len - count. Empty when no suffix occurs earlier.
// The same choice as vLLM (the longest n-gram, the earliest of its occurrences).
std::vector<int32_t> propose_ngram(const int32_t* tokens, int count, const NgramConfig& config);

}  // namespace octavo
