// sample: one token per request row, in vLLM v1's order:
//   bans -> repetition / frequency / presence penalties -> greedy argmax, or
//   temperature -> softmax -> min_p -> top_k -> top_p -> inverse-CDF draw,
// plus logprobs of the raw logits. Requests run in parallel and each one reads only its own row
// and parameters, so a request gets the same token alone or in any batch.
//
// The vocabulary is large (150k) and the kept set is usually small, so the kernel avoids sorting
// the vocabulary: vectorized passes over the row, then exact selection among the few candidates
// above a falling threshold.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "isa_kernels.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "parallel.h"
#include "sample_random.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

constexpr float kInf = INFINITY;
using sampling::kGreedyTemperature;
using sampling::uniform;

// ---------------------------------------------------------------------------------------------
// Vectorized passes over a row.

// Largest value of x[0, n), ignoring NaN; -inf when there is none.
float max_of(const float* x, int64_t n) {
  VecF acc = VecF::set1(-kInf);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = max(VecF::load(x + i), acc);  // max(new, acc) keeps acc on NaN
  float m = reduce_max(acc);
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

float sum_of(const float* x, int64_t n) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = acc + VecF::load(x + i);
  float s = reduce_add(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

// First index of the largest value (lowest id on ties). The maximum is found per block so that
// only one block is scanned for its position.
int64_t argmax(const float* x, int64_t n) {
  constexpr int64_t kBlock = 256;
  float best = -kInf;
  int64_t start = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float m = max_of(x + b, std::min(kBlock, n - b));
    if (m > best) {
      best = m;
      start = b;
    }
  }
  // NaN ranks as -inf, as on CUDA: in a row of only -inf and NaN the first of them wins.
  for (int64_t i = start; i < std::min(start + kBlock, n); ++i) {
    if (x[i] == best || (best == -kInf && x[i] != x[i])) return i;
  }
  return start;
}

// Number of i with x[i] >= v (NaN never counts). Lane counts stay exact in float up to 2^24 per
// lane.
int64_t count_at_least(const float* x, int64_t n, float v) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = acc + select_at_least(VecF::load(x + i), v, VecF::set1(1.0f), 0.0f);
  int64_t count = static_cast<int64_t>(reduce_add(acc));
  for (; i < n; ++i) count += x[i] >= v;
  return count;
}

// Long sums are taken in blocks of this many elements (a multiple of every kW), added in
// double: one float accumulator over 150k tokens would lose digits of the softmax denominator.
constexpr int64_t kSumBlock = 1024;

float sum_exp_block(const float* x, int64_t n, float xmax) {
  const VecF shift = VecF::set1(xmax);
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = acc + exp(VecF::load(x + i) - shift);
  float s = reduce_add(acc);
  if (i < n) {
    const int r = static_cast<int>(n - i);
    float tail[kW];
    exp(load_partial(x + i, r) - shift).store(tail);
    for (int j = 0; j < r; ++j) s += tail[j];  // the padding lanes are not part of the row
  }
  return s;
}

// sum of exp(x[i] - xmax): the softmax denominator of the raw row.
double sum_exp(const float* x, int64_t n, float xmax) {
  double s = 0;
  for (int64_t b = 0; b < n; b += kSumBlock) s += sum_exp_block(x + b, std::min(kSumBlock, n - b), xmax);
  return s;
}

float scaled_exp_block(const float* x, float* e, int64_t n, float xmax, float inv_t, float floor) {
  const VecF shift = VecF::set1(xmax), scale = VecF::set1(inv_t);
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const VecF y = exp((VecF::load(x + i) - shift) * scale);
    const VecF kept = select_at_least(y, floor, y, 0.0f);  // a NaN logit weighs 0
    kept.store(e + i);
    acc = acc + kept;
  }
  float s = reduce_add(acc);
  if (i < n) {
    const int r = static_cast<int>(n - i);
    const VecF y = exp((load_partial(x + i, r) - shift) * scale);
    store_partial(select_at_least(y, floor, y, 0.0f), e + i, r);
    for (int j = 0; j < r; ++j) s += e[i + j];
  }
  return s;
}

// e[i] = exp((x[i] - xmax) * inv_t): probabilities up to the common factor 1 / sum, with the
// most likely token at exactly 1. Entries below `floor` become 0 (min_p relative to the max
// probability is then simply floor = min_p), and so do NaN logits, which the CUDA kernel ranks
// as -inf. x and e may be the same buffer. Returns sum(e).
double scaled_exp(const float* x, float* e, int64_t n, float xmax, float inv_t, float floor) {
  double s = 0;
  for (int64_t b = 0; b < n; b += kSumBlock) {
    s += scaled_exp_block(x + b, e + b, std::min(kSumBlock, n - b), xmax, inv_t, floor);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Candidates: the tokens with the largest values, without sorting the vocabulary.

// NaN ranks as -inf so that `likelier` below stays a strict weak order for the STL algorithms.
inline float rank_value(float x) { return x == x ? x : -kInf; }

// "a is more likely than b": larger value first, lower token id on ties (deterministic).
auto likelier(const float* v) {
  return [v](int32_t a, int32_t b) {
    const float x = rank_value(v[a]), y = rank_value(v[b]);
    return (x > y) | ((x == y) & (a < b));  // bitwise: no branches on the data
  };
}

// Appends to idx, in token order, the tokens with lo <= v < hi and returns how many, adding
// their values to *mass (meaningful for probabilities; logits may hold -inf). lo = -inf takes
// everything below hi (NaN too); hi = NaN means no upper bound (the test is !(v >= hi)).
// Blocks whose maximum is below lo are skipped after one vector pass, so a high band costs
// little more than reading the row. idx needs room for one more token: every token is
// written, only the ones in the band are counted.
int64_t gather_band(const float* v, int64_t n, float lo, float hi, int32_t* idx, double* mass) {
  constexpr int64_t kBlock = 64;
  const bool unbounded = lo == -kInf;
  int64_t count = 0;
  double sum = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(b + kBlock, n);
    if (!unbounded && max_of(v + b, end - b) < lo) continue;
    for (int64_t i = b; i < end; ++i) {  // branch-free: in a dense band the test is a coin toss
      const bool in = (unbounded | (v[i] >= lo)) & !(v[i] >= hi);
      idx[count] = static_cast<int32_t>(i);
      count += in;
      sum += static_cast<float>(in) * v[i];
    }
  }
  *mass += sum;
  return count;
}

// Gathers the tokens of v band by band, from the top, until enough(count, mass) holds or the
// last band is done. `levels` are the bands' descending lower bounds. The result is every token
// with a value >= the last band used, so it holds the most likely ones whatever the order.
template <typename Enough>
int64_t gather_top(const float* v, int64_t n, const float* levels, int num_levels, int32_t* idx,
                   const Enough& enough) {
  int64_t count = 0;
  double mass = 0;
  float hi = NAN;
  for (int l = 0; l < num_levels; ++l) {
    count += gather_band(v, n, levels[l], hi, idx + count, &mass);
    if (enough(count, mass)) break;
    hi = levels[l];
  }
  return count;
}

// Depths of the bands below the largest value: probabilities from e^-2 of the most likely
// token's down, logits from its logit - 2 down. The peaked distributions of language models
// usually stop in the first few; more, finer bands mean fewer surplus candidates for top_k.
constexpr int kNumLevels = 9;
constexpr float kBandDepth[kNumLevels - 1] = {2, 4, 6, 9, 12, 16, 24, 48};

// ---------------------------------------------------------------------------------------------
// top_k and top_p among the candidates.

// Position of the median of idx[a], idx[b], idx[c] in the likelier order: a quickselect pivot.
int64_t median_position(const float* e, const int32_t* idx, int64_t a, int64_t b, int64_t c) {
  const auto before = likelier(e);
  if (before(idx[b], idx[a])) std::swap(a, b);  // now idx[a] comes first
  if (before(idx[c], idx[a])) return a;
  if (before(idx[c], idx[b])) return c;
  return b;
}

double mass_of(const float* e, const int32_t* idx, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += e[idx[i]];
  return s;
}

// Lomuto partition of idx[lo, hi) around the pivot at idx[hi - 1]: tokens likelier than the
// pivot end in [lo, mid), the pivot at mid; returns mid and the mass of [lo, mid) in *upper.
// Every token is swapped and only the count depends on the test, so there are no branches on
// the data (which would be coin tosses).
int64_t partition_likelier(const float* e, int32_t* idx, int64_t lo, int64_t hi, double* upper) {
  const auto before = likelier(e);
  const int32_t pivot = idx[hi - 1];
  int64_t mid = lo;
  double mass = 0;
  for (int64_t i = lo; i < hi - 1; ++i) {
    const int32_t t = idx[i];
    const bool up = before(t, pivot);
    idx[i] = idx[mid];
    idx[mid] = t;
    mid += up;
    mass += static_cast<float>(up) * e[t];
  }
  idx[hi - 1] = idx[mid];
  idx[mid] = pivot;
  *upper = mass;
  return mid;
}

// Reorders idx[0, n) so that its first m entries are the smallest set of most likely tokens
// whose mass reaches `target` (top_p), and returns m. A quickselect on mass instead of rank:
// partition around a pivot, keep the side where the running mass crosses the target. Expected
// O(n); only the last few tokens get sorted.
int64_t top_p_prefix(const float* e, int32_t* idx, int64_t n, double target) {
  int64_t lo = 0, hi = n;  // idx[0, lo) are kept, with mass `above` < target; the cut is in [lo, hi)
  double above = 0;
  while (hi - lo > 32) {
    std::iter_swap(idx + median_position(e, idx, lo, lo + (hi - lo) / 2, hi - 1), idx + hi - 1);
    const int32_t pivot = idx[hi - 1];
    double upper;
    const int64_t m = partition_likelier(e, idx, lo, hi, &upper);
    if (above + upper >= target) {
      hi = m;
      continue;
    }
    above += upper + e[pivot];
    if (above >= target) return m + 1;
    lo = m + 1;
  }
  std::sort(idx + lo, idx + hi, likelier(e));
  for (int64_t i = lo; i < hi; ++i) {
    above += e[idx[i]];
    if (above >= target) return i + 1;
  }
  return hi;  // rounding left the target just out of reach: keep them all
}

// The tokens top_k (k > 0) and top_p (< 1) keep, into idx[0, m); returns m. e holds the
// probabilities (up to a factor) after min_p, `total` their sum.
int64_t select_kept(const float* e, int64_t n, double total, int64_t k, float top_p, int32_t* idx) {
  float levels[kNumLevels];
  for (int l = 0; l + 1 < kNumLevels; ++l) levels[l] = std::exp(-kBandDepth[l]);
  levels[kNumLevels - 1] = FLT_TRUE_MIN;  // every token with a nonzero probability
  // With top_k the whole top-k set is needed (top_p renormalizes over it); otherwise only
  // enough of the most likely tokens to reach top_p of the mass.
  const double target = top_p * total;
  int64_t m = gather_top(e, n, levels, kNumLevels, idx,
                         [&](int64_t count, double mass) { return k > 0 ? count >= k : mass >= target; });
  if (k > 0 && m > k) {
    std::nth_element(idx, idx + k, idx + m, likelier(e));
    m = k;
  }
  if (top_p < 1) m = top_p_prefix(e, idx, m, top_p * (k > 0 ? mass_of(e, idx, m) : total));
  return m;
}

// ---------------------------------------------------------------------------------------------
// The draw: inverse CDF in token order, so the pick depends only on the kept set and weights.

// The first token of w[0, n) (weights >= 0) at which the running sum passes u * total; -1 when
// there is no mass. Sums are taken per block with vectors, so only one block is walked token by
// token; both passes add the same block sums in the same order, so the target is reached.
int64_t draw_from_row(const float* w, int64_t n, double u) {
  double total = 0;
  for (int64_t b = 0; b < n; b += kSumBlock) total += sum_of(w + b, std::min(kSumBlock, n - b));
  const double target = u * total;
  double acc = 0;
  for (int64_t b = 0; b < n; b += kSumBlock) {
    const int64_t len = std::min(kSumBlock, n - b);
    const double s = sum_of(w + b, len);
    if (!(acc + s > target)) {
      acc += s;
      continue;
    }
    int64_t last = -1;  // the token-by-token sum may fall just short of the vector one
    for (int64_t i = b; i < b + len; ++i) {
      if (!(w[i] > 0)) continue;
      last = i;
      acc += w[i];
      if (acc > target) return i;
    }
    return last;
  }
  return -1;
}

// Puts idx[0, m) in increasing token order: a counting sort through a bitmap of the vocabulary,
// O(n / 64 + m) however many tokens are kept.
void sort_tokens(int32_t* idx, int64_t m, uint64_t* bits, int64_t n) {
  const int64_t words = (n + 63) / 64;
  std::memset(bits, 0, static_cast<size_t>(words) * sizeof(uint64_t));
  for (int64_t i = 0; i < m; ++i) bits[idx[i] >> 6] |= uint64_t{1} << (idx[i] & 63);
  int64_t out = 0;
  for (int64_t w = 0; w < words; ++w) {
    for (uint64_t x = bits[w]; x != 0; x &= x - 1) idx[out++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(x));
  }
}

// Inverse CDF over the tokens idx[0, m) (in token order) with weights w; -1 when no mass.
int64_t draw_from_list(const float* w, const int32_t* idx, int64_t m, double u) {
  const double target = u * mass_of(w, idx, m);
  double acc = 0;
  for (int64_t i = 0; i < m; ++i) {
    acc += w[idx[i]];
    if (acc > target) return idx[i];
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// Penalties.

struct TokenList {
  const int32_t* ids = nullptr;
  int64_t size = 0;
};

TokenList tokens_of(const int32_t* offsets, const int32_t* ids, int64_t r) {
  if (!offsets) return {};
  return {ids + offsets[r], offsets[r + 1] - offsets[r]};
}

// Per-thread token counters, all zero between requests: whatever a request sets it resets
// before it returns, so nothing O(vocabulary) is cleared per request. Owned by this file rather
// than taken from thread_scratch(), whose slots other kernels overwrite.
class TokenTally {
 public:
  ~TokenTally() { std::free(data_); }
  int32_t* get(int64_t vocab) {
    if (size_ < vocab) {
      std::free(data_);
      data_ = static_cast<int32_t*>(std::calloc(static_cast<size_t>(vocab), sizeof(int32_t)));
      size_ = data_ ? vocab : 0;
      OCTAVO_CHECK_KIND(ErrorKind::kRuntime, data_, "out of memory for sampling penalty counters");
    }
    return data_;
  }

 private:
  int32_t* data_ = nullptr;
  int64_t size_ = 0;
};

int32_t* token_tally(int64_t vocab) {
  thread_local TokenTally tally;
  return tally.get(vocab);
}

// Row r's biases on the raw logits into x: listed tokens get raw + value (-inf bans, even a
// +inf logit), the others stay as they are or, where only_listed, are banned.
void apply_biases(const SampleParams& p, int64_t r, const float* raw, float* x) {
  const TokenList listed = tokens_of(p.bias_offsets, p.bias_token_ids, r);
  const float* values = listed.size ? p.bias_values + p.bias_offsets[r] : nullptr;
  if (p.only_listed && p.only_listed[r]) std::fill(x, x + p.vocab_size, -kInf);
  else std::memcpy(x, raw, static_cast<size_t>(p.vocab_size) * sizeof(float));
  for (int64_t i = 0; i < listed.size; ++i) {
    const int32_t t = listed.ids[i];
    x[t] = values[i] == -kInf ? -kInf : raw[t] + values[i];
  }
}

// Every distinct token of prompt and output once: positive logits shrink (/ r), others grow
// more negative (* r). `seen` marks tokens already penalized and is reset afterwards.
void repetition_penalty(float* x, TokenList prompt, TokenList output, float r, int32_t* seen) {
  const auto penalize = [&](TokenList list) {
    for (int64_t i = 0; i < list.size; ++i) {
      const int32_t t = list.ids[i];
      if (seen[t]) continue;
      seen[t] = 1;
      x[t] = x[t] > 0 ? x[t] / r : x[t] * r;
    }
  };
  const auto unmark = [&](TokenList list) {
    for (int64_t i = 0; i < list.size; ++i) seen[list.ids[i]] = 0;
  };
  penalize(prompt);
  penalize(output);
  unmark(prompt);
  unmark(output);
}

// logit -= frequency * count + presence for each distinct output token.
void frequency_presence_penalty(float* x, TokenList output, float frequency, float presence, int32_t* count) {
  for (int64_t i = 0; i < output.size; ++i) ++count[output.ids[i]];
  for (int64_t i = 0; i < output.size; ++i) {
    const int32_t t = output.ids[i];
    if (count[t] == 0) continue;  // done at its first occurrence
    x[t] = x[t] - frequency * static_cast<float>(count[t]) - presence;
    count[t] = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// One request.

struct Scratch {
  float* work;     // [vocab] the penalized row, then the probabilities
  int32_t* idx;    // [vocab + 1] candidate tokens (+ 1: gather_band writes one past its last)
  uint64_t* bits;  // [vocab / 64] bitmap for sort_tokens
  int32_t* tally;  // [vocab] all zero between requests
};

Scratch scratch_for(int64_t vocab) {
  const size_t n = static_cast<size_t>(vocab);
  return {static_cast<float*>(thread_scratch(0, n * sizeof(float))),
          static_cast<int32_t*>(thread_scratch(1, (n + 1) * sizeof(int32_t))),
          static_cast<uint64_t*>(thread_scratch(2, (n + 63) / 64 * sizeof(uint64_t))), token_tally(vocab)};
}

template <typename T>
T param_or(const T* values, int64_t r, T fallback) {
  return values ? values[r] : fallback;
}

// The request's logits after biases, bans and penalties, in `work`; the raw row itself when none
// apply (a greedy request without any is then a single pass).
const float* penalized_row(const SampleParams& p, int64_t r, const float* raw, const Scratch& s) {
  const bool biased = (p.bias_offsets && p.bias_offsets[r + 1] > p.bias_offsets[r]) ||
                      (p.only_listed && p.only_listed[r]);
  const TokenList prompt = tokens_of(p.prompt_offsets, p.prompt_token_ids, r);
  const TokenList output = tokens_of(p.output_offsets, p.output_token_ids, r);
  const float repetition = param_or(p.repetition_penalty, r, 1.0f);
  const float frequency = param_or(p.frequency_penalty, r, 0.0f);
  const float presence = param_or(p.presence_penalty, r, 0.0f);
  const bool repeat = repetition != 1.0f && prompt.size + output.size > 0;
  const bool counts = (frequency != 0.0f || presence != 0.0f) && output.size > 0;
  if (!biased && !repeat && !counts) return raw;
  apply_biases(p, r, raw, s.work);
  if (repeat) repetition_penalty(s.work, prompt, output, repetition, s.tally);
  if (counts) frequency_presence_penalty(s.work, output, frequency, presence, s.tally);
  return s.work;
}

int64_t random_token(const SampleParams& p, int64_t r, const float* row, const Scratch& s) {
  const int64_t n = p.vocab_size;
  const float xmax = max_of(row, n);
  if (!std::isfinite(xmax)) return argmax(row, n);  // everything banned, or an infinite logit
  const double total = scaled_exp(row, s.work, n, xmax, 1.0f / p.temperature[r], param_or(p.min_p, r, 0.0f));
  const int32_t k_param = param_or(p.top_k, r, 0);
  const int64_t k = k_param > 0 && k_param < n ? k_param : 0;
  const float top_p = param_or(p.top_p, r, 1.0f);
  const double u = uniform(p.seeds[r], p.counters[r]);
  int64_t token;
  if (k == 0 && top_p >= 1) {
    token = draw_from_row(s.work, n, u);
  } else {
    const int64_t m = select_kept(s.work, n, total, k, top_p, s.idx);
    sort_tokens(s.idx, m, s.bits, n);
    token = draw_from_list(s.work, s.idx, m, u);
  }
  return token >= 0 ? token : argmax(s.work, n);  // no mass left (NaN logits): most likely token
}

// The n most likely tokens of the raw row, most likely first, as (token, logprob).
void top_logprobs(const float* raw, int64_t vocab, float xmax, float lse, int64_t n, int32_t* idx,
                  int32_t* ids_out, float* logprobs_out) {
  float levels[kNumLevels];
  for (int l = 0; l + 1 < kNumLevels; ++l) levels[l] = xmax - kBandDepth[l];
  levels[kNumLevels - 1] = -kInf;  // the rest of the row
  const int64_t m = gather_top(raw, vocab, levels, kNumLevels, idx, [n](int64_t count, double) { return count >= n; });
  const auto before = likelier(raw);
  if (m > n) std::nth_element(idx, idx + n, idx + m, before);
  std::sort(idx, idx + n, before);
  for (int64_t i = 0; i < n; ++i) {
    ids_out[i] = idx[i];
    logprobs_out[i] = raw[idx[i]] - lse;
  }
}

// Logprobs are of the raw logits (vLLM's default): before bans, penalties and temperature.
void write_logprobs(const SampleParams& p, int64_t r, const float* raw, int32_t token, const Scratch& s) {
  const int64_t n = p.vocab_size;
  const float xmax = max_of(raw, n);
  const float lse = static_cast<float>(xmax + std::log(sum_exp(raw, n, xmax)));
  if (p.sampled_logprobs) p.sampled_logprobs[r] = raw[token] - lse;
  if (p.sampled_ranks) p.sampled_ranks[r] = static_cast<int32_t>(count_at_least(raw, n, raw[token]));
  if (p.top_token_ids && p.num_top > 0) {
    top_logprobs(raw, n, xmax, lse, p.num_top, s.idx, p.top_token_ids + r * p.num_top,
                 p.top_logprobs + r * p.num_top);
  }
}

void sample_request(const SampleParams& p, int64_t r, const Scratch& s) {
  const float* raw = p.logits + r * p.logits_stride;
  const float* row = penalized_row(p, r, raw, s);
  const int64_t token = p.temperature[r] < kGreedyTemperature ? argmax(row, p.vocab_size) : random_token(p, r, row, s);
  p.sampled[r] = static_cast<int32_t>(token);
  if (p.accepted) p.accepted[r] = p.draft_token_ids[r] >= 0 && token == p.draft_token_ids[r];
  if (p.sampled_logprobs || p.sampled_ranks || p.top_token_ids) write_logprobs(p, r, raw, p.sampled[r], s);
}

}  // namespace

void sample(const SampleParams& p) {
  parallel_for(p.num_reqs, 1, [&p](int64_t begin, int64_t end) {
    const Scratch s = scratch_for(p.vocab_size);
    for (int64_t r = begin; r < end; ++r) sample_request(p, r, s);
  });
}

}  // namespace octavo::cpu::OCTAVO_ISA
