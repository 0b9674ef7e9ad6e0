// sample on CUDA: one block per request row, in the CPU kernel's order (cpu/sampling.cc):
//   bans -> repetition / frequency / presence penalties -> greedy argmax, or
//   temperature -> softmax -> min_p -> top_k -> top_p -> inverse-CDF draw in token order,
// plus logprobs of the raw logits. The random number is the CPU kernel's: the same (seed,
// counter) gives the same u, so with the same kept weights both pick the same token.
//
// Nothing is sorted: top_k and top_p become thresholds on the probabilities, found by a 16-way
// search over their float bit patterns (each pass reads the row once and narrows the range 16
// times), and the draw is a block-wide prefix sum in token order. Of the tokens tied exactly at
// the threshold, the lowest ids are kept, as many as the CPU kernel keeps (a Cut's quota).
#include <cfloat>
#include <climits>

#include "common.cuh"
#include "cuda_kernels.h"
#include "sample_random.h"

namespace octavo::cuda {
namespace {

using sampling::kGreedyTemperature;
using sampling::uniform;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kSplits = 16;                  // ways per threshold-search pass

// ---- block reductions (blockDim.x == kThreads; block_reduce is common.cuh's) -----------------

struct Scratch {
  float f[kWarps];
  double d[kWarps];
  unsigned long long u[kWarps];
  int i[kWarps];
  float thresholds[kSplits];
  int result;
};

__device__ float fmax_op(float a, float b) { return fmaxf(a, b); }  // NaN loses
__device__ double add_d(double a, double b) { return a + b; }
__device__ int add_i(int a, int b) { return a + b; }
__device__ unsigned long long max_u(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// A key whose unsigned order is "more likely first": larger value, then lower token id; NaN
// ranks as -inf.
__device__ unsigned long long likelihood_key(float x, int token) {
  if (x != x) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;  // -0 ties with +0, as on the CPU
  const unsigned bits = __float_as_uint(x);
  const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | (0xffffffffu - static_cast<unsigned>(token));
}
__device__ int key_token(unsigned long long key) { return static_cast<int>(0xffffffffu - (key & 0xffffffffu)); }

// The most likely token of row[0, n) among those whose key is below `below` (all: ~0).
__device__ int argmax_below(const float* row, int64_t n, unsigned long long below, Scratch& s) {
  unsigned long long best = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const unsigned long long key = likelihood_key(row[i], static_cast<int>(i));
    if (key < below && key > best) best = key;
  }
  return key_token(block_reduce(best, max_u, 0ull, s.u));
}

__device__ float row_max(const float* row, int64_t n, Scratch& s) {
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) m = fmaxf(m, row[i]);
  return block_reduce(m, fmax_op, -INFINITY, s.f);
}

// ---- penalties --------------------------------------------------------------------------------

struct TokenList {
  const int32_t* ids = nullptr;
  int64_t size = 0;
};

__device__ TokenList tokens_of(const int32_t* offsets, const int32_t* ids, int64_t r) {
  if (!offsets) return {};
  return {ids + offsets[r], offsets[r + 1] - offsets[r]};
}

template <typename Fn>
__device__ void for_each_token(TokenList list, int64_t n, Fn fn) {
  for (int64_t i = threadIdx.x; i < list.size; i += kThreads) {
    const int32_t t = list.ids[i];
    if (t >= 0 && t < n) fn(t);  // ids are not validated on the host for CUDA tensors
  }
}

// The row after biases, bans and penalties (in vLLM's order), in `work`; false (work untouched)
// when none apply. `counts` (all zero between calls, present whenever a penalty is) marks the
// tokens the repetition penalty has done, so that a token listed twice is penalized once, and
// gathers the frequency counts (each taken back with an exchange, which also makes one thread per
// distinct token apply it).
__device__ bool penalize(const SampleParams& p, int64_t r, const float* raw, float* work, int* counts) {
  const int64_t n = p.vocab_size;
  const TokenList listed = tokens_of(p.bias_offsets, p.bias_token_ids, r);
  const bool only_listed = p.only_listed && p.only_listed[r];
  const TokenList prompt = tokens_of(p.prompt_offsets, p.prompt_token_ids, r);
  const TokenList output = tokens_of(p.output_offsets, p.output_token_ids, r);
  const float repetition = p.repetition_penalty ? p.repetition_penalty[r] : 1.0f;
  const float frequency = p.frequency_penalty ? p.frequency_penalty[r] : 0.0f;
  const float presence = p.presence_penalty ? p.presence_penalty[r] : 0.0f;
  const bool repeat = repetition != 1.0f && prompt.size + output.size > 0 && counts != nullptr;
  const bool tally = (frequency != 0.0f || presence != 0.0f) && output.size > 0 && counts != nullptr;
  if (listed.size == 0 && !only_listed && !repeat && !tally) return false;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) work[i] = only_listed ? -INFINITY : raw[i];
  __syncthreads();
  if (listed.size > 0) {  // each token once per row (the host's contract), so no two threads meet
    const float* values = p.bias_values + p.bias_offsets[r];
    for (int64_t i = threadIdx.x; i < listed.size; i += kThreads) {
      const int32_t t = listed.ids[i];
      if (t >= 0 && t < n) work[t] = values[i] == -INFINITY ? -INFINITY : raw[t] + values[i];
    }
    __syncthreads();
  }
  if (repeat) {
    // The first thread to claim a token penalizes it; the claims are then taken back.
    const auto penalize_token = [&](int32_t t) {
      if (atomicCAS(&counts[t], 0, 1) == 0) work[t] = work[t] > 0 ? work[t] / repetition : work[t] * repetition;
    };
    for_each_token(prompt, n, penalize_token);
    for_each_token(output, n, penalize_token);
    __syncthreads();
    const auto release = [&](int32_t t) { atomicExch(&counts[t], 0); };
    for_each_token(prompt, n, release);
    for_each_token(output, n, release);
    __syncthreads();
  }
  if (tally) {
    for_each_token(output, n, [&](int32_t t) { atomicAdd(&counts[t], 1); });
    __syncthreads();
    for_each_token(output, n, [&](int32_t t) {
      const int c = atomicExch(&counts[t], 0);
      if (c > 0) work[t] = work[t] - frequency * static_cast<float>(c) - presence;
    });
    __syncthreads();
  }
  return true;
}

// ---- thresholds for top_k and top_p ---------------------------------------------------------

// The largest probability threshold t in [lo, hi] (as float bit patterns; weights are >= 0, so
// their bits order as their values) for which enough(count(w >= t), mass(w >= t)) holds; `lo`
// must satisfy it. Each pass tries kSplits - 1 thresholds in one read of the row.
template <typename Enough>
__device__ float search_threshold(const float* w, int64_t n, float lo_value, Enough enough, Scratch& s) {
  unsigned lo = __float_as_uint(lo_value), hi = __float_as_uint(1.0f) + 1;  // w <= 1: the max is 1
  while (hi - lo > 1) {
    const unsigned step = (hi - lo + kSplits - 1) / kSplits;
    __syncthreads();  // every thread is done reading the previous pass's thresholds
    if (threadIdx.x < kSplits) s.thresholds[threadIdx.x] = __uint_as_float(min(lo + threadIdx.x * step, hi - 1));
    __syncthreads();
    int count[kSplits] = {};
    float mass[kSplits] = {};
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const float x = w[i];
#pragma unroll
      for (int j = 1; j < kSplits; ++j)
        if (x >= s.thresholds[j] && x > 0) ++count[j], mass[j] += x;
    }
    unsigned next = lo;
    for (int j = 1; j < kSplits; ++j) {
      const int c = block_reduce(count[j], add_i, 0, s.i);
      const double m = block_reduce(static_cast<double>(mass[j]), add_d, 0.0, s.d);
      if (enough(c, m)) next = __float_as_uint(s.thresholds[j]);
    }
    hi = next == lo ? min(lo + step, hi) : min(next + step, hi);
    lo = next;
  }
  return __uint_as_float(lo);
}

// ---- the cut: which tokens top_k and top_p keep ---------------------------------------------

// Keeps the tokens with w > threshold, and the `quota` lowest-id ones with w == threshold;
// never a zero weight. No top_k / top_p: threshold 0.
struct Cut {
  float threshold;
  int quota;
};

// Tokens strictly above t (how many, their mass) and tied at t, t > 0.
struct Band {
  int above;
  double mass_above;
  int ties;
};

__device__ Band band(const float* w, int64_t n, float t, Scratch& s) {
  int above = 0, ties = 0;
  double mass = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    above += w[i] > t;
    ties += w[i] == t && t > 0;
    if (w[i] > t) mass += w[i];
  }
  return {block_reduce(above, add_i, 0, s.i), block_reduce(mass, add_d, 0.0, s.d), block_reduce(ties, add_i, 0, s.i)};
}

// top_k's cut: t is the largest threshold keeping k tokens, so fewer than k lie above it and the
// rest of the k come from its ties.
__device__ Cut top_k_cut(const float* w, int64_t n, int k, Scratch& s) {
  const float t = search_threshold(w, n, 0.0f, [k](int count, double) { return count >= k; }, s);
  if (t == 0.0f) return {0.0f, INT_MAX};  // fewer than k nonzero weights: all of them
  return {t, k - band(w, n, t, s).above};
}

// top_p's cut inside `kept`: the likeliest tokens (lowest ids first among equals) until their
// mass reaches top_p of the kept mass, as the CPU kernel's prefix. t is the largest threshold
// whose tokens reach the target, so the mass above it falls short and ties at t make up the rest.
__device__ Cut top_p_cut(const float* w, int64_t n, Cut kept, float top_p, Scratch& s) {
  const Band at_kept = band(w, n, kept.threshold, s);
  const double kept_mass = at_kept.mass_above + static_cast<double>(min(kept.quota, at_kept.ties)) * kept.threshold;
  const double target = top_p * kept_mass;
  const float t = search_threshold(w, n, kept.threshold, [target](int, double mass) { return mass >= target; }, s);
  if (t == 0.0f) return kept;
  const Band at_t = band(w, n, t, s);
  const int available = t == kept.threshold ? min(kept.quota, at_t.ties) : at_t.ties;
  const double needed = ceil((target - at_t.mass_above) / t);
  return {t, static_cast<int>(fmin(fmax(needed, 1.0), static_cast<double>(available)))};
}

// ---- the draw -----------------------------------------------------------------------------

// Prefix sums over the block in thread order: `start` and `end` of this thread's v, and the
// total. Thread i + 1's start is computed exactly as thread i's end, so the runs tile [0, total).
template <typename T>
__device__ void block_scan(T v, T* warp_sums, T& start, T& end, T& total) {
  T incl = v;
  for (int o = 1; o < 32; o *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, incl, o);
    if (static_cast<int>(threadIdx.x % 32) >= o) incl += up;
  }
  const T incl_before = __shfl_up_sync(0xffffffffu, incl, 1);
  if (threadIdx.x % 32 == 31) warp_sums[threadIdx.x / 32] = incl;
  __syncthreads();
  T before = 0;
  total = 0;
  for (int wi = 0; wi < kWarps; ++wi) {
    if (wi < static_cast<int>(threadIdx.x / 32)) before += warp_sums[wi];
    total += warp_sums[wi];
  }
  start = threadIdx.x % 32 == 0 ? before : before + incl_before;
  end = before + incl;
  __syncthreads();  // warp_sums may be reused right after
}

// Walks a thread's run of tokens in order, calling fn(i) for each one `cut` keeps; tie_rank
// is the number of tied tokens before the run.
template <typename Fn>
__device__ void for_each_kept(const float* w, int64_t begin, int64_t end, Cut cut, int tie_rank, Fn fn) {
  for (int64_t i = begin; i < end; ++i) {
    const bool tie = w[i] == cut.threshold;
    if (w[i] > 0 && (w[i] > cut.threshold || (tie && tie_rank < cut.quota))) {
      if (!fn(i)) return;
    }
    tie_rank += tie;
  }
}

// The first token (in token order) at which the running sum of the kept weights passes u times
// their total; -1 when nothing is kept. Each thread owns a contiguous run of tokens; block scans
// of the runs' tie counts and sums find each tie's rank and the run to walk.
__device__ int draw(const float* w, int64_t n, Cut cut, double u, Scratch& s) {
  const int64_t per = (n + kThreads - 1) / kThreads;
  const int64_t begin = min64(n, threadIdx.x * per), end = min64(n, begin + per);
  int ties = 0;
  for (int64_t i = begin; i < end; ++i) ties += w[i] == cut.threshold;
  int tie_rank, tie_end, all_ties;
  block_scan(ties, s.i, tie_rank, tie_end, all_ties);
  double run = 0;
  int last = -1;
  for_each_kept(w, begin, end, cut, tie_rank, [&](int64_t i) {
    run += w[i];
    last = static_cast<int>(i);
    return true;
  });
  double run_start, run_end, total;
  if (threadIdx.x == 0) s.result = -1;
  block_scan(run, s.d, run_start, run_end, total);
  const double target = u * total;
  const int last_kept = block_reduce(last, [](int a, int b) { return a > b ? a : b; }, INT_MIN, s.i);
  if (run > 0 && run_start <= target && target < run_end) {
    double acc = run_start;
    int pick = last;
    for_each_kept(w, begin, end, cut, tie_rank, [&](int64_t i) {
      acc += w[i];
      if (acc <= target) return true;
      pick = static_cast<int>(i);
      return false;
    });
    s.result = pick;
  }
  __syncthreads();
  const int token = s.result >= 0 ? s.result : last_kept;  // rounding put the target past the end
  __syncthreads();
  return token;
}

__device__ int random_token(const SampleParams& p, int64_t r, const float* row, float* w, Scratch& s) {
  const int64_t n = p.vocab_size;
  const float xmax = row_max(row, n, s);
  if (!isfinite(xmax)) return argmax_below(row, n, ~0ull, s);  // everything banned, or an infinite logit
  const float inv_t = 1.0f / p.temperature[r];
  const float floor = p.min_p ? p.min_p[r] : 0.0f;  // relative to the most likely token's probability, 1
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float e = expf((row[i] - xmax) * inv_t);
    w[i] = e < floor ? 0.0f : e;  // NaN logits give NaN, which is never kept
  }
  __syncthreads();
  const int32_t k = p.top_k ? p.top_k[r] : 0;
  const float top_p = p.top_p ? p.top_p[r] : 1.0f;
  Cut cut{0.0f, INT_MAX};
  if (k > 0 && k < n) cut = top_k_cut(w, n, k, s);
  if (top_p < 1.0f) cut = top_p_cut(w, n, cut, top_p, s);
  const int token = draw(w, n, cut, uniform(p.seeds[r], p.counters[r]), s);
  return token >= 0 ? token : argmax_below(w, n, ~0ull, s);  // no mass left (NaN logits)
}

// ---- logprobs of the raw row -----------------------------------------------------------------

__device__ void write_logprobs(const SampleParams& p, int64_t r, const float* raw, int token, Scratch& s) {
  const int64_t n = p.vocab_size;
  const float xmax = row_max(raw, n, s);
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) sum += expf(raw[i] - xmax);
  const float lse = static_cast<float>(xmax + log(block_reduce(sum, add_d, 0.0, s.d)));
  int at_least = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) at_least += raw[i] >= raw[token];
  at_least = block_reduce(at_least, add_i, 0, s.i);
  if (threadIdx.x == 0) {
    if (p.sampled_logprobs) p.sampled_logprobs[r] = raw[token] - lse;
    if (p.sampled_ranks) p.sampled_ranks[r] = at_least;
  }
  unsigned long long below = ~0ull;  // the next most likely token after the previous one
  for (int64_t j = 0; p.top_token_ids && j < p.num_top; ++j) {
    const int t = argmax_below(raw, n, below, s);
    below = likelihood_key(raw[t], t);
    if (threadIdx.x == 0) {
      p.top_token_ids[r * p.num_top + j] = t;
      p.top_logprobs[r * p.num_top + j] = raw[t] - lse;
    }
  }
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p, float* weights, int* counts) {
  __shared__ Scratch s;
  const int64_t r = blockIdx.x;
  const float* raw = p.logits + r * p.logits_stride;
  float* work = weights + r * p.vocab_size;
  const float* row = penalize(p, r, raw, work, counts ? counts + r * p.vocab_size : nullptr) ? work : raw;
  const int token = p.temperature[r] < kGreedyTemperature ? argmax_below(row, p.vocab_size, ~0ull, s)
                                                          : random_token(p, r, row, work, s);
  if (threadIdx.x == 0) {
    p.sampled[r] = token;
    if (p.accepted) p.accepted[r] = p.draft_token_ids[r] >= 0 && token == p.draft_token_ids[r];
  }
  if (p.sampled_logprobs || p.sampled_ranks || p.top_token_ids) write_logprobs(p, r, raw, token, s);
}

}  // namespace

void sample(const SampleParams& p) {
  if (p.num_reqs == 0) return;
  const size_t row_elems = static_cast<size_t>(p.num_reqs) * p.vocab_size;
  auto* weights = static_cast<float*>(device_workspace(WorkspaceSlot::kSampleWeights, row_elems * sizeof(float),
                                                       "sample"));
  int* counts = nullptr;  // only when penalties are passed with token lists
  const bool lists = p.prompt_offsets || p.output_offsets;
  if ((p.output_offsets && (p.frequency_penalty || p.presence_penalty)) || (lists && p.repetition_penalty))
    counts = static_cast<int*>(device_workspace(WorkspaceSlot::kSampleCounts, row_elems * sizeof(int), "sample"));
  launch_kernel(sample_kernel, p.num_reqs, kThreads, 0, p, weights, counts);
  check_launch("sample");
}

void reserve_sample_workspaces(int64_t max_rows, int64_t vocab_size) {
  const size_t row_elems = static_cast<size_t>(max_rows) * vocab_size;
  device_workspace(WorkspaceSlot::kSampleWeights, row_elems * sizeof(float), "sample");
  device_workspace(WorkspaceSlot::kSampleCounts, row_elems * sizeof(int), "sample");
}

}  // namespace octavo::cuda
