// sample's CUDA kernel (csrc/kernels/cuda/sampling.cu) run by the simulator, through the public
// op with CUDA views, against the CPU kernel (the same op with CPU views) and a float64
// reference: test_sampling.py's cases, which a GPU runs through test_cuda_sampling.py.
//
// Both kernels draw with the same u = uniform(seed, counter) (sample_random.h) by inverse CDF in
// token order, so a draw is a pure function of its row, parameters, seed and counter. The
// kernels compute the probabilities with different exp implementations and sum in different
// orders, so they may disagree only where a float rounding can move a boundary (the draw's
// target, the top_p cut, the min_p floor, the k-th weight). The reference says where that cannot
// happen ("robust"), and there both kernels must pick exactly its token. Greedy decoding and
// the penalties are the same float operations on both, so they agree everywhere.
//
// The simulator runs each of a row's 1024 threads as a fiber, and the threshold searches of
// top_k / top_p cost hundreds of block barriers and thousands of warp shuffles per row (~60 ms
// each here), so filtered draws are few (tens per case); the statistical bounds use unfiltered
// and min_p draws, which cost under 2 ms each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "octavo/ops.h"
#include "octavo/status.h"
#include "sample_random.h"
#include "sim_test_util.h"

namespace {

using octavo::DeviceType;
using octavo::TensorView;
using sim_test::DType;
using sim_test::Tensor;

constexpr double kInf = INFINITY;
constexpr float kPadding = 1e30f;  // between padded rows: a kernel that read it would pick it

// ---- A batch of requests and running it ------------------------------------------------------

// One request's parameters, neutral by default, and its token lists.
struct Request {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  float repetition = 1.0f, frequency = 0.0f, presence = 0.0f;
  std::vector<int32_t> prompt, output, banned;    // banned: bias entries of -inf
  std::vector<std::pair<int32_t, float>> biases;  // further entries (token, value), after the bans
  int32_t only_listed = 0;                        // ban every token not in banned or biases
  int64_t seed = 0, counter = 0;
};

// Rows of logits, `stride` floats apart (stride > vocab: padded rows, as a slice of a wider
// tensor), and one request per row.
struct Batch {
  int64_t vocab, stride;
  std::vector<float> logits;
  std::vector<Request> requests;
  bool penalties = false;  // pass the penalty values and the prompt / output lists
  bool logprobs = false;   // ask for the sampled tokens' logprobs and ranks
  int64_t num_top = 0;     // and for this many top tokens per row
  std::vector<int32_t> drafts;  // one per row: run rejection_sample with them (empty: sample)

  Batch(int64_t v, int64_t rows, int64_t pad = 0)
      : vocab(v), stride(v + pad), logits(static_cast<size_t>(rows * (v + pad)), kPadding), requests(rows) {}
  int64_t rows() const { return static_cast<int64_t>(requests.size()); }
  float* row(int64_t r) { return logits.data() + r * stride; }
  const float* row(int64_t r) const { return logits.data() + r * stride; }
  void set_row(int64_t r, const std::vector<float>& values) { std::copy(values.begin(), values.end(), row(r)); }
};

// n copies of one row and request, with counters 0..n-1: n draws from one distribution.
Batch draws(const std::vector<float>& row, int64_t n, const Request& q) {
  Batch b(static_cast<int64_t>(row.size()), n);
  for (int64_t r = 0; r < n; ++r) {
    b.set_row(r, row);
    b.requests[r] = q;
    b.requests[r].counter = r;
  }
  b.penalties = q.repetition != 1.0f || q.frequency != 0.0f || q.presence != 0.0f;
  return b;
}

std::vector<float> randn(int64_t n, std::mt19937& gen, double scale = 1.0) {
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(gen);
  return x;
}

struct Output {
  std::vector<int32_t> sampled, ranks, top_ids, accepted;
  std::vector<float> logprobs, top_logprobs;
};

// A request field of every row, as a [rows] tensor of its type.
template <typename T>
Tensor per_row(const Batch& b, T Request::*field) {
  constexpr DType dtype = std::is_same_v<T, float>     ? DType::kFloat32
                          : std::is_same_v<T, int32_t> ? DType::kInt32
                                                       : DType::kInt64;
  Tensor t({b.rows()}, dtype);
  for (int64_t r = 0; r < b.rows(); ++r) t.as<T>()[r] = b.requests[r].*field;
  return t;
}

// A token list of every row in CSR form: offsets [rows + 1] and ids, int32.
struct Csr {
  Tensor offsets, ids;
};

// The bias entries of every row (its bans at -inf, then its biases) in CSR form, with their values.
struct Biases {
  Tensor offsets, ids, values;
  bool any = false;  // some row lists a token or bans the unlisted ones
};
Biases biases(const Batch& b) {
  std::vector<int32_t> offsets{0}, ids;
  std::vector<float> values;
  bool only = false;
  for (const Request& q : b.requests) {
    for (int32_t t : q.banned) ids.push_back(t), values.push_back(-INFINITY);
    for (const auto& [t, v] : q.biases) ids.push_back(t), values.push_back(v);
    offsets.push_back(static_cast<int32_t>(ids.size()));
    only = only || q.only_listed;
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  Biases c{Tensor({b.rows() + 1}, DType::kInt32), Tensor({n}, DType::kInt32), Tensor({n}, DType::kFloat32), n > 0 || only};
  std::copy(offsets.begin(), offsets.end(), c.offsets.as<int32_t>());
  std::copy(ids.begin(), ids.end(), c.ids.as<int32_t>());
  std::copy(values.begin(), values.end(), c.values.as<float>());
  return c;
}
Csr csr(const Batch& b, std::vector<int32_t> Request::*list) {
  std::vector<int32_t> offsets{0}, ids;
  for (const Request& q : b.requests) {
    ids.insert(ids.end(), (q.*list).begin(), (q.*list).end());
    offsets.push_back(static_cast<int32_t>(ids.size()));
  }
  Csr c{Tensor({b.rows() + 1}, DType::kInt32), Tensor({static_cast<int64_t>(ids.size())}, DType::kInt32)};
  std::copy(offsets.begin(), offsets.end(), c.offsets.as<int32_t>());
  std::copy(ids.begin(), ids.end(), c.ids.as<int32_t>());
  return c;
}

template <typename T>
std::vector<T> values(const Tensor& t) {
  const T* data = static_cast<const T*>(t.data());
  return std::vector<T>(data, data + t.numel());
}

// octavo::sample on `device` (kCUDA: the simulator; kCPU: the CPU kernel). Biases and bans are
// passed when some row has any.
Output run(const Batch& b, DeviceType device) {
  const int64_t rows = b.rows();
  Tensor logits({rows, b.stride}, DType::kFloat32);
  std::copy(b.logits.begin(), b.logits.end(), logits.as<float>());
  const Tensor temperature = per_row(b, &Request::temperature), top_k = per_row(b, &Request::top_k),
               top_p = per_row(b, &Request::top_p), min_p = per_row(b, &Request::min_p),
               repetition = per_row(b, &Request::repetition), frequency = per_row(b, &Request::frequency),
               presence = per_row(b, &Request::presence), seeds = per_row(b, &Request::seed),
               counters = per_row(b, &Request::counter), only_listed = per_row(b, &Request::only_listed);
  const Csr prompt = csr(b, &Request::prompt), output = csr(b, &Request::output);
  const Biases bias = biases(b);
  Tensor sampled({rows}, DType::kInt32), logprobs({rows}, DType::kFloat32), ranks({rows}, DType::kInt32);
  Tensor top_ids({rows, b.num_top}, DType::kInt32), top_logprobs({rows, b.num_top}, DType::kFloat32);

  const auto view = [device](const Tensor& t) { return t.view(device); };
  TensorView logits_view = view(logits);
  logits_view.shape[1] = b.vocab;  // strides stay {stride, 1}
  const TensorView top_k_v = view(top_k), top_p_v = view(top_p), min_p_v = view(min_p),
                   repetition_v = view(repetition), frequency_v = view(frequency), presence_v = view(presence),
                   prompt_offsets = view(prompt.offsets), prompt_ids = view(prompt.ids),
                   output_offsets = view(output.offsets), output_ids = view(output.ids),
                   bias_offsets = view(bias.offsets), bias_ids = view(bias.ids), bias_values = view(bias.values),
                   only_listed_v = view(only_listed), logprobs_v = view(logprobs),
                   ranks_v = view(ranks), top_ids_v = view(top_ids), top_logprobs_v = view(top_logprobs);
  octavo::SampleArgs a;
  a.logits = logits_view;
  a.temperature = view(temperature);
  a.top_k = &top_k_v;
  a.top_p = &top_p_v;
  a.min_p = &min_p_v;
  if (b.penalties) {
    a.repetition_penalty = &repetition_v;
    a.frequency_penalty = &frequency_v;
    a.presence_penalty = &presence_v;
    a.prompt_offsets = &prompt_offsets;
    a.prompt_token_ids = &prompt_ids;
    a.output_offsets = &output_offsets;
    a.output_token_ids = &output_ids;
  }
  if (bias.any) {
    a.bias_offsets = &bias_offsets;
    a.bias_token_ids = &bias_ids;
    a.bias_values = &bias_values;
    a.only_listed = &only_listed_v;
  }
  a.seeds = view(seeds);
  a.counters = view(counters);
  a.sampled = view(sampled);
  if (b.logprobs) {
    a.sampled_logprobs = &logprobs_v;
    a.sampled_ranks = &ranks_v;
  }
  if (b.num_top > 0) {
    a.top_token_ids = &top_ids_v;
    a.top_logprobs = &top_logprobs_v;
  }
  Tensor drafts({rows}, DType::kInt32), accepted({rows}, DType::kInt32);
  if (b.drafts.empty()) {
    octavo::sample(a);
  } else {
    std::copy(b.drafts.begin(), b.drafts.end(), drafts.as<int32_t>());
    octavo::rejection_sample(a, view(drafts), view(accepted));
  }
  return {values<int32_t>(sampled), values<int32_t>(ranks), values<int32_t>(top_ids),
          b.drafts.empty() ? std::vector<int32_t>{} : values<int32_t>(accepted), values<float>(logprobs),
          values<float>(top_logprobs)};
}

std::vector<int32_t> sim(const Batch& b) { return run(b, DeviceType::kCUDA).sampled; }
std::vector<int32_t> cpu(const Batch& b) { return run(b, DeviceType::kCPU).sampled; }

// The token a single request draws on the simulator.
int32_t sim_one(const std::vector<float>& row, const Request& q, bool penalties = false) {
  Batch b = draws(row, 1, q);
  b.requests[0].counter = q.counter;
  b.penalties = b.penalties || penalties;
  return sim(b)[0];
}

// ---- The float64 reference ---------------------------------------------------------------------

// vLLM's biases, bans and penalties on one row (test_sampling.py's `penalized`), in float as both
// kernels compute them (the same operations in the same order), so that only the kernels'
// exp and sums can differ from the reference below.
std::vector<double> penalized(const float* row, int64_t vocab, const Request& q) {
  std::vector<float> x(row, row + vocab);
  if (q.only_listed) std::fill(x.begin(), x.end(), -INFINITY);
  for (const auto& [t, v] : q.biases) x[t] = row[t] + v;
  for (int32_t t : q.banned) x[t] = -INFINITY;
  std::vector<int> seen(static_cast<size_t>(vocab), 0), count(static_cast<size_t>(vocab), 0);
  for (int32_t t : q.prompt) seen[t] = 1;
  for (int32_t t : q.output) seen[t] = 1, ++count[t];
  for (int64_t i = 0; i < vocab; ++i) {
    if (seen[i]) x[i] = x[i] > 0 ? x[i] / q.repetition : x[i] * q.repetition;
    if (count[i] > 0) x[i] = x[i] - q.frequency * static_cast<float>(count[i]) - q.presence;
  }
  return std::vector<double>(x.begin(), x.end());
}

// Tokens likeliest first, the lowest id first among equals; NaN ranks as -inf.
std::vector<int> likeliest_first(const std::vector<double>& x) {
  std::vector<int> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  const auto rank = [&x](int t) { return std::isnan(x[t]) ? -kInf : x[t]; };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank(a) > rank(b); });
  return order;
}

// a and b within `tolerance`: a float rounding in the kernels could put them either way.
bool near(double a, double b, double tolerance) { return !(std::fabs(a - b) > tolerance); }

// The reference's draw for one request: its token, whether rounding could change it, and the
// distribution it was drawn from (the kept tokens' renormalized probabilities).
struct Draw {
  int token = -1;
  bool robust = true;
  std::vector<double> probs;
};

// How far from a boundary float rounding in the kernels can move a draw, relative to the value
// compared. Weights: the kernels' exp is within 2.5e-7 of the exact one (the exponent is rounded
// as theirs, below), so weights, and sums of weights in double, are within 2.5e-7 relative:
// a fourth of the margin.
// Masses of the top_p cut: the CUDA kernel's threshold search sums each thread's few dozen
// weights in float, within 3e-6.
constexpr double kWeightMargin = 1e-6;
constexpr double kMassMargin = 1e-5;

// The inverse-CDF draw over `kept` (any order) at u, in token order: the first token at which
// the running sum of weights passes u times their total. Not robust when the target lies
// within rounding of the boundaries of the picked token's interval.
Draw inverse_cdf(std::vector<int> kept, const std::vector<double>& w, double u) {
  std::sort(kept.begin(), kept.end());
  double total = 0;
  for (int t : kept) total += w[t];
  const double target = u * total, tolerance = kWeightMargin * total;
  Draw d;
  d.probs.assign(w.size(), 0.0);
  for (int t : kept) d.probs[t] = w[t] / total;
  double cum = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    const double before = cum;
    cum += w[kept[i]];
    if (cum > target || i + 1 == kept.size()) {  // past the end by rounding: the last token
      d.token = kept[i];
      d.robust = (i == 0 || !near(before, target, tolerance)) &&
                 (i + 1 == kept.size() || !near(cum, target, tolerance));
      break;
    }
  }
  return d;
}

// min_p, top_k, top_p in vLLM's order on the penalized row x, then the inverse-CDF draw in token
// order at u = uniform(seed, counter).
Draw reference(const std::vector<double>& x, const Request& q) {
  const int64_t n = static_cast<int64_t>(x.size());
  const std::vector<int> order = likeliest_first(x);
  const double top = x[order[0]];
  if (q.temperature < octavo::sampling::kGreedyTemperature || !std::isfinite(top)) {  // argmax
    Draw d;
    d.token = order[0];
    d.probs.assign(x.size(), 0.0);
    d.probs[d.token] = 1;
    // The penalized logits are the kernels' own floats: only an exact tie is a coin toss.
    d.robust = n == 1 || x[order[1]] != top;
    return d;
  }
  bool robust = true;
  // Weights relative to the likeliest token's (1); min_p is a floor on them.
  std::vector<double> w(x.size(), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) continue;  // never kept
    // The exponent as the kernels round it; only the exp itself is exact here.
    const float exponent = (static_cast<float>(x[i]) - static_cast<float>(top)) * (1.0f / q.temperature);
    w[i] = std::exp(static_cast<double>(exponent));
    if (w[i] < 1e-30) w[i] = 0;  // the kernels flush some of these to 0; they can never be drawn
    if (q.min_p > 0 && w[i] > 0) {
      robust &= !near(w[i], q.min_p, kWeightMargin * q.min_p);
      if (w[i] < q.min_p) w[i] = 0;
    }
  }
  std::vector<int> kept;
  for (int t : order)
    if (w[t] > 0) kept.push_back(t);
  const size_t k = static_cast<size_t>(q.top_k);
  if (q.top_k > 0 && q.top_k < n && kept.size() > k) {
    // Equal logits give equal weights on both kernels, which then keep the lower ids.
    const int last = kept[k - 1], next = kept[k];
    robust &= x[last] == x[next] || !near(w[last], w[next], kWeightMargin * w[last]);
    kept.resize(k);
  }
  const double u = octavo::sampling::uniform(q.seed, q.counter);
  if (q.top_p >= 1) {
    Draw d = inverse_cdf(kept, w, u);
    d.robust &= robust;
    return d;
  }
  // top_p keeps the shortest likeliest prefix whose mass reaches top_p of the kept mass. With
  // thousands of candidates a rounding of that mass can move the cut by a token or two: the
  // draw is robust if every such cut gives the same token, robustly.
  std::vector<double> mass(kept.size() + 1, 0.0);  // mass[m]: of the first m kept tokens
  for (size_t i = 0; i < kept.size(); ++i) mass[i + 1] = mass[i] + w[kept[i]];
  const double target = q.top_p * mass.back(), tolerance = kMassMargin * mass.back();
  size_t cut = 1;
  while (cut < kept.size() && mass[cut] < target) ++cut;
  Draw d = inverse_cdf(std::vector<int>(kept.begin(), kept.begin() + cut), w, u);
  d.robust &= robust;
  for (size_t m = 1; m <= kept.size(); ++m) {
    const bool possible = mass[m] >= target - tolerance && (m == 1 || mass[m - 1] < target + tolerance);
    if (!possible || m == cut) continue;
    const Draw other = inverse_cdf(std::vector<int>(kept.begin(), kept.begin() + m), w, u);
    d.robust &= other.robust && other.token == d.token;
  }
  return d;
}

Draw reference(const Batch& b, int64_t r) {
  return reference(penalized(b.row(r), b.vocab, b.requests[r]), b.requests[r]);
}

// The batch on the simulator and on the CPU, each row against the reference: where rounding
// cannot decide the draw, both kernels pick the reference's token; elsewhere the simulator's
// token is still one the reference keeps, or the CPU's. Greedy rows agree exactly everywhere.
// At least `min_robust` of the rows must be robust, so that the exact check has teeth, and the
// kernels must agree on at least 98% of them. Returns the simulator's output.
Output expect_matches_reference(const Batch& b, double min_robust = 0.9) {
  const Output sim = run(b, DeviceType::kCUDA);
  const Output cpu = run(b, DeviceType::kCPU);
  int robust = 0, agree = 0;
  for (int64_t r = 0; r < b.rows(); ++r) {
    const Draw ref = reference(b, r);
    const int32_t got = sim.sampled[r];
    agree += got == cpu.sampled[r];
    if (got < 0 || got >= b.vocab) {
      ADD_FAILURE() << "row " << r << ": token " << got << " is not in the vocabulary";
      continue;
    }
    if (b.requests[r].temperature < octavo::sampling::kGreedyTemperature) EXPECT_EQ(got, cpu.sampled[r]) << "row " << r;
    if (ref.robust) {
      ++robust;
      EXPECT_EQ(got, ref.token) << "row " << r;
      EXPECT_EQ(cpu.sampled[r], ref.token) << "row " << r << " (cpu)";
    } else {
      EXPECT_TRUE(ref.probs[got] > 0 || got == cpu.sampled[r]) << "row " << r << ": token " << got;
    }
  }
  EXPECT_GE(robust, min_robust * b.rows()) << "too few rows away from rounding boundaries to test";
  EXPECT_GE(agree, 0.98 * b.rows()) << "the simulator and the CPU disagree too often";
  return sim;
}

// ---- Statistics -------------------------------------------------------------------------------

std::vector<double> frequencies(const std::vector<int32_t>& tokens, int64_t vocab) {
  std::vector<double> f(static_cast<size_t>(vocab), 0.0);
  for (int32_t t : tokens) f[t] += 1.0 / static_cast<double>(tokens.size());
  return f;
}

double total_variation(const std::vector<int32_t>& tokens, const std::vector<double>& probs) {
  const std::vector<double> f = frequencies(tokens, static_cast<int64_t>(probs.size()));
  double tv = 0;
  for (size_t i = 0; i < probs.size(); ++i) tv += 0.5 * std::fabs(f[i] - probs[i]);
  return tv;
}

// What total_variation averages over n exact draws (each frequency ~ normal around p).
double expected_total_variation(const std::vector<double>& probs, int64_t n) {
  double tv = 0;
  for (double p : probs) tv += 0.5 * std::sqrt(2 * p * (1 - p) / (M_PI * static_cast<double>(n)));
  return tv;
}

// Pearson's chi-squared of the draws against probs, with the bins expecting fewer than 5
// draws pooled into one; returns (statistic, degrees of freedom).
std::pair<double, int> chi_squared(const std::vector<int32_t>& tokens, const std::vector<double>& probs) {
  const double n = static_cast<double>(tokens.size());
  const std::vector<double> f = frequencies(tokens, static_cast<int64_t>(probs.size()));
  double chi2 = 0, pooled_expected = 0, pooled_count = 0;
  int bins = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    const double expected = probs[i] * n, count = f[i] * n;
    if (expected < 5) {
      pooled_expected += expected, pooled_count += count;
      continue;
    }
    chi2 += (count - expected) * (count - expected) / expected;
    ++bins;
  }
  if (pooled_expected > 0) {
    chi2 += (pooled_count - pooled_expected) * (pooled_count - pooled_expected) / pooled_expected;
    ++bins;
  }
  return {chi2, bins - 1};
}

// The draws follow probs: total variation within twice what exact draws average, and a
// chi-squared within 6 standard deviations of its mean (test_sampling.py's bound).
void expect_distribution(const std::vector<int32_t>& tokens, const std::vector<double>& probs) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  EXPECT_LT(total_variation(tokens, probs), 2 * expected_total_variation(probs, n));
  const auto [chi2, df] = chi_squared(tokens, probs);
  EXPECT_LT(chi2, df + 6 * std::sqrt(2.0 * df));
}

// ---- Greedy --------------------------------------------------------------------------------

int argmax(const float* row, int64_t n) { return static_cast<int>(std::max_element(row, row + n) - row); }

TEST(SimSampling, GreedyIsArgmax) {
  const float temperatures[] = {0, 1e-6f, 0, 0, 0, 0, 0, 0, 9e-6f};
  for (int64_t vocab : {1, 7, 1000, 4099, 32000}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    std::mt19937 gen(static_cast<unsigned>(vocab));
    Batch b(vocab, 9, /*pad=*/5);  // rows 5 floats apart, the gap a huge logit
    for (int64_t r = 0; r < b.rows(); ++r) {
      b.set_row(r, randn(vocab, gen));
      b.requests[r].temperature = temperatures[r];
    }
    const std::vector<int32_t> got = sim(b);
    EXPECT_EQ(got, cpu(b));
    for (int64_t r = 0; r < b.rows(); ++r) EXPECT_EQ(got[r], argmax(b.row(r), vocab)) << "row " << r;
  }
}

TEST(SimSampling, GreedyTiesTakeTheLowestIdAndNaNNeverWins) {
  const int64_t vocab = 300;
  Batch b(vocab, 8);
  for (int64_t r = 0; r < b.rows(); ++r) {
    std::fill(b.row(r), b.row(r) + vocab, r == 2 ? -INFINITY : 0.0f);
    b.requests[r].temperature = 0;
  }
  b.row(0)[7] = b.row(0)[250] = 2.0f;  // test_sampling.py's three rows
  b.row(1)[0] = b.row(1)[299] = 1.0f;
  std::fill(b.row(3), b.row(3) + vocab, -1.0f);  // -0 ties with +0: the lower id
  b.row(3)[8] = 0.0f, b.row(3)[3] = -0.0f;
  b.row(4)[0] = b.row(4)[40] = NAN;  // NaN loses to every number
  b.row(4)[41] = 0.5f;
  std::fill(b.row(5), b.row(5) + vocab, NAN);  // nothing but NaN: still a token
  b.row(6)[100] = b.row(6)[200] = INFINITY;  // the first infinite logit
  std::fill(b.row(7), b.row(7) + vocab, -INFINITY);  // random, everything masked: the argmax
  b.row(7)[299] = INFINITY;
  b.requests[7].temperature = 1;
  const std::vector<int32_t> got = sim(b);
  EXPECT_EQ(got, (std::vector<int32_t>{7, 0, 0, 3, 41, 0, 100, 299}));
  EXPECT_EQ(got, cpu(b));
}

// Rows with penalties against the float64 reference (test_sampling.py's case), and the CPU.
TEST(SimSampling, GreedyWithPenaltiesMatchesReference) {
  std::mt19937 gen(1);
  const int64_t rows = 24, vocab = 3000;
  Batch b(vocab, rows);
  b.penalties = true;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    b.set_row(r, randn(vocab, gen, 3.0));
    // Penalize the likeliest tokens so that the penalties decide the argmax.
    std::vector<double> x(b.row(r), b.row(r) + vocab);
    const std::vector<int> top = likeliest_first(x);
    Request& q = b.requests[r];
    q.temperature = 0;
    for (int i = 0; i < 10; ++i) q.prompt.push_back(top[gen() % 40]);
    q.prompt.push_back(static_cast<int32_t>(r));
    for (int i = 0; i < 12; ++i) q.output.push_back(top[gen() % 40]);
    if (r % 3 == 0) q.banned = {top[0], top[1]};
    q.repetition = unit(gen) + 0.5f;
    q.frequency = unit(gen) - 0.2f;
    q.presence = unit(gen) - 0.2f;
  }
  const Output got = expect_matches_reference(b);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> ref = penalized(b.row(r), vocab, b.requests[r]);
    EXPECT_GE(ref[got.sampled[r]], *std::max_element(ref.begin(), ref.end()) - 1e-5) << "row " << r;
  }
}

TEST(SimSampling, PenaltiesMoveTheArgmax) {
  const std::vector<float> row = {2.0f, 1.5f, 0.5f, -1.0f, -0.2f};
  const auto greedy = [](std::vector<int32_t> prompt, std::vector<int32_t> output, float repetition = 1,
                         float frequency = 0, float presence = 0) {
    Request q;
    q.temperature = 0;
    q.prompt = std::move(prompt), q.output = std::move(output);
    q.repetition = repetition, q.frequency = frequency, q.presence = presence;
    return q;
  };
  EXPECT_EQ(sim_one(row, greedy({}, {})), 0);
  EXPECT_EQ(sim_one(row, greedy({0}, {}, 2.0f), true), 1);  // 2.0 / 2 = 1.0 < 1.5
  // Negative logits are multiplied: -0.2 * 10 = -2 falls below -1.0.
  EXPECT_EQ(sim_one({-1.0f, -0.2f, -3.0f}, greedy({}, {1}, 10.0f), true), 0);
  // Frequency counts every occurrence: 2.0 - 0.2 * 3 = 1.4 < 1.5; once: 1.8 > 1.5.
  EXPECT_EQ(sim_one(row, greedy({}, {0, 0, 0}, 1, 0.2f), true), 1);
  EXPECT_EQ(sim_one(row, greedy({}, {0}, 1, 0.2f), true), 0);
  EXPECT_EQ(sim_one(row, greedy({}, {0, 0, 0, 0}, 1, 0, 0.6f), true), 1);  // presence counts once: 1.4
  EXPECT_EQ(sim_one(row, greedy({}, {2}, 1, 0, -2.0f), true), 2);           // negative penalties reward
  EXPECT_EQ(sim_one(row, greedy({0}, {}, 1, 5.0f, 5.0f), true), 0);          // prompt: repetition only
  // A token in both lists, or listed twice, is penalized by repetition once: 2.0 / 1.5 > 1.5 / 1.5.
  EXPECT_EQ(sim_one(row, greedy({0, 0, 1}, {0, 1}, 1.5f), true), 0);
}

// Each row's token counts live in a workspace that the kernel leaves zeroed: a count that
// survived its row, or its call, would move a later argmax.
TEST(SimSampling, PenaltyCountsResetBetweenRowsAndCalls) {
  Batch b = draws({2.0f, 1.5f, 0.0f}, 40, Request{});
  b.penalties = true;
  for (Request& q : b.requests) q.temperature = 0, q.frequency = 0.2f, q.output = {0};
  b.requests[0].output = {0, 0, 0, 0, 0};  // 2.0 - 1.0 < 1.5
  std::vector<int32_t> expected(40, 0);
  expected[0] = 1;
  EXPECT_EQ(sim(b), expected);
  b.requests[0].output = {0};
  EXPECT_EQ(sim(b), std::vector<int32_t>(40, 0));
}

// ---- Bans ------------------------------------------------------------------------------------

TEST(SimSampling, BannedTokensAreNeverSampled) {
  std::mt19937 gen(2);
  const std::vector<float> row = randn(64, gen, 2.0);
  const std::vector<int> order = likeliest_first(std::vector<double>(row.begin(), row.end()));
  Request q;
  q.banned = {order[0], order[1], order[2], order[3], order[4], 3, 17};
  const Batch b = draws(row, 400, q);
  const std::vector<int32_t> got = expect_matches_reference(b).sampled;
  for (int32_t t : got) EXPECT_EQ(std::count(q.banned.begin(), q.banned.end(), t), 0) << t;
  Request greedy = q;
  greedy.temperature = 0;
  EXPECT_EQ(sim_one(row, greedy), order[5]);
  Request only_40;
  for (int t = 0; t < 64; ++t)
    if (t != 40) only_40.banned.push_back(t);
  EXPECT_EQ(sim(draws(row, 20, only_40)), std::vector<int32_t>(20, 40));
}

// Biases (logit_bias) move tokens up and down before sampling; only_listed (allowed_token_ids)
// keeps only the listed tokens, each with its own bias, bans among them.
TEST(SimSampling, BiasesAndOnlyListedTokensFollowTheReference) {
  std::mt19937 gen(11);
  const std::vector<float> row = randn(96, gen, 1.5);
  const std::vector<int> order = likeliest_first(std::vector<double>(row.begin(), row.end()));
  Request up;
  up.biases = {{order[90], 8.0f}, {order[0], -100.0f}, {order[1], 0.5f}};
  const std::vector<int32_t> got = expect_matches_reference(draws(row, 300, up)).sampled;
  EXPECT_GT(std::count(got.begin(), got.end(), order[90]), 150);  // e^8 outweighs the rest
  EXPECT_EQ(std::count(got.begin(), got.end(), order[0]), 0);
  Request listed;
  listed.only_listed = 1;
  listed.biases = {{5, 0.0f}, {17, 1.0f}};
  listed.banned = {order[0]};  // listed as a ban: still banned
  const std::vector<int32_t> only = expect_matches_reference(draws(row, 200, listed)).sampled;
  for (int32_t t : only) EXPECT_TRUE(t == 5 || t == 17) << t;
  Request greedy = listed;
  greedy.temperature = 0;
  EXPECT_EQ(sim_one(row, greedy), row[17] + 1.0f >= row[5] ? 17 : 5);
}

// vLLM's order: the bias first, then the penalties on the biased logit; a token the prompt and
// the output list several times is penalized once (the CUDA kernel's claims).
TEST(SimSampling, PenaltiesApplyToTheBiasedLogitOnce) {
  std::vector<float> row(32, 0.0f);
  row[3] = 2.0f, row[9] = 1.0f;
  Request q;
  q.temperature = 0;
  q.biases = {{9, 3.0f}};                          // 1 + 3 = 4: above token 3
  q.prompt = {9, 9, 9}, q.output = {9, 9};         // then / 2.5 = 1.6: below it again
  q.repetition = 2.5f;
  Batch b = draws(row, 1, q);
  b.penalties = true;
  EXPECT_EQ(sim(b), std::vector<int32_t>{3});
  EXPECT_EQ(cpu(b), std::vector<int32_t>{3});
  b.requests[0].repetition = 1.5f;  // 4 / 1.5 = 2.67: above
  EXPECT_EQ(sim(b), std::vector<int32_t>{9});
  EXPECT_EQ(cpu(b), std::vector<int32_t>{9});
}

// The CPU refuses a token listed twice in one row, or a bias of +inf / NaN.
TEST(SimSampling, BiasListsAreCheckedOnTheCpu) {
  const std::vector<float> row(16, 0.0f);
  const auto refused = [&](const Request& q, const char* text) {
    try {
      cpu(draws(row, 2, q));
      ADD_FAILURE() << "accepted: " << text;
    } catch (const octavo::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  Request twice;
  twice.banned = {4};
  twice.biases = {{4, 1.0f}};
  refused(twice, "twice");
  Request infinite;
  infinite.biases = {{4, INFINITY}};
  refused(infinite, "finite or -inf");
}

// Token ids are validated on the host only for CPU tensors; the CUDA kernel skips ids outside
// the vocabulary instead of writing outside the row.
TEST(SimSampling, OutOfVocabularyIdsAreSkippedOnCuda) {
  std::mt19937 gen(8);
  const std::vector<float> row = randn(50, gen);
  const int top = argmax(row.data(), 50);
  Request clean;
  clean.banned = {top};
  clean.output = {7};
  clean.repetition = 3.0f, clean.frequency = 1.0f;
  Request stray = clean;
  stray.banned = {-1, top, 50, 1 << 30};
  stray.output = {-5, 50, 7};
  stray.prompt = {100000};
  Batch with_stray = draws(row, 6, stray), without = draws(row, 6, clean);
  without.requests[0].temperature = with_stray.requests[0].temperature = 0;  // and a greedy row
  EXPECT_EQ(sim(with_stray), expect_matches_reference(without, 1.0).sampled);
  try {
    cpu(with_stray);
    ADD_FAILURE() << "the CPU accepted token ids outside the vocabulary";
  } catch (const octavo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a token id"), std::string::npos) << e.what();
  }
}

// ---- Random sampling: distributions ---------------------------------------------------------

std::vector<double> softmax(const std::vector<double>& x, double temperature) {
  const double top = *std::max_element(x.begin(), x.end());
  std::vector<double> p(x.size());
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += p[i] = std::exp((x[i] - top) / temperature);
  for (double& v : p) v /= sum;
  return p;
}

TEST(SimSampling, TemperatureSamplingMatchesSoftmax) {
  for (auto [vocab, temperature] : std::vector<std::pair<int, float>>{{16, 1.0f}, {37, 0.7f}, {37, 2.5f}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab) + " temperature " + std::to_string(temperature));
    std::mt19937 gen(static_cast<unsigned>(vocab));
    const std::vector<float> row = randn(vocab, gen, 1.5);
    Request q;
    q.temperature = temperature;
    const std::vector<int32_t> tokens = expect_matches_reference(draws(row, 1000, q)).sampled;
    expect_distribution(tokens, softmax(std::vector<double>(row.begin(), row.end()), temperature));
  }
}

TEST(SimSampling, RandomSamplingFollowsThePenalizedDistribution) {
  std::mt19937 gen(7);
  const std::vector<float> row = randn(20, gen);
  Request q;
  q.temperature = 0.8f;
  q.prompt = {3, 4, 5}, q.output = {5, 5, 6, 7, 7, 7}, q.banned = {0};
  q.repetition = 1.5f, q.frequency = 0.3f, q.presence = 0.2f;
  const std::vector<int32_t> tokens = expect_matches_reference(draws(row, 1000, q)).sampled;
  expect_distribution(tokens, softmax(penalized(row.data(), 20, q), 0.8));
}

// min_p needs no search, so its draws are cheap enough for statistics.
TEST(SimSampling, MinPSamplingMatchesTheFloorDistribution) {
  std::mt19937 gen(3);
  const std::vector<float> row = randn(100, gen, 2.0);
  Request q;
  q.min_p = 0.1f;
  const Batch b = draws(row, 1000, q);
  const std::vector<int32_t> tokens = expect_matches_reference(b).sampled;
  const Draw ref = reference(b, 0);
  for (int32_t t : tokens) EXPECT_GT(ref.probs[t], 0) << t;
  expect_distribution(tokens, ref.probs);
}

// ---- Random sampling: what top_k, top_p and min_p keep ------------------------------------------

Request filters(float temperature, int32_t top_k, float top_p, float min_p) {
  Request q;
  q.temperature = temperature, q.top_k = top_k, q.top_p = top_p, q.min_p = min_p;
  return q;
}

// test_sampling.py's parameter sets, a few draws each (see the top of the file): each is
// checked against the reference's inverse CDF, so the kept set and its weights must be exact.
TEST(SimSampling, FiltersKeepTheReferenceSetAndWeights) {
  std::mt19937 gen(3);
  const std::vector<float> row = randn(100, gen, 2.0);
  for (const Request& q : {filters(1, 5, 1, 0), filters(1, 0, 0.6f, 0), filters(0.8f, 10, 0.5f, 0),
                           filters(1.5f, 20, 0.9f, 0.05f), filters(1, 1, 1, 0), filters(1, 0, 1e-6f, 0)}) {
    SCOPED_TRACE("top_k " + std::to_string(q.top_k) + " top_p " + std::to_string(q.top_p));
    const Batch b = draws(row, 12, q);
    const std::vector<int32_t> tokens = expect_matches_reference(b, 1.0).sampled;
    const std::set<int32_t> distinct(tokens.begin(), tokens.end());
    const Draw ref = reference(b, 0);
    const auto kept = std::count_if(ref.probs.begin(), ref.probs.end(), [](double p) { return p > 0; });
    if (kept > 1) EXPECT_GT(distinct.size(), 1u) << "every draw gave the same token";
  }
}

TEST(SimSampling, FiltersOnLargeVocabularies) {
  struct Case {
    int64_t vocab;
    double scale;
    Request q;
  };
  for (const Case& c : {Case{50000, 3.0, filters(1, 0, 0.9f, 0)},  // peaked: a few candidates
                        Case{50000, 3.0, filters(1, 50, 0.95f, 0)},
                        Case{6000, 0.3, filters(1, 0, 0.5f, 0)},  // flat: thousands of candidates
                        Case{6000, 0.3, filters(1, 3000, 1, 0.2f)}}) {
    SCOPED_TRACE("vocab " + std::to_string(c.vocab) + " top_k " + std::to_string(c.q.top_k));
    std::mt19937 gen(4);
    const std::vector<int32_t> tokens = expect_matches_reference(draws(randn(c.vocab, gen, c.scale), 6, c.q), 1.0)
                                            .sampled;
    EXPECT_GT(std::set<int32_t>(tokens.begin(), tokens.end()).size(), 1u);
  }
}

// Equal weights: inverse CDF over m kept tokens of weight 1 picks the floor(u * m)-th, exactly
// (sums of ones are exact in both kernels).
int32_t nth_of_equal(const Request& q, int m) {
  return static_cast<int32_t>(std::floor(octavo::sampling::uniform(q.seed, q.counter) * m));
}

// n draws from a row whose likeliest tokens (ids `top`, or all tokens when empty) are equal,
// the rest far less likely; the filters must keep the first `kept` of them.
void expect_equal_weight_draws(int64_t vocab, const Request& q, int kept, int n, const std::vector<int>& top = {}) {
  std::vector<float> row(static_cast<size_t>(vocab), top.empty() ? 0.0f : -5.0f);
  for (int t : top) row[t] = 0.0f;
  const Batch b = draws(row, n, q);
  const std::vector<int32_t> got = sim(b);
  EXPECT_EQ(got, cpu(b));
  for (int64_t r = 0; r < n; ++r) {
    const int i = nth_of_equal(b.requests[r], kept);
    EXPECT_EQ(got[r], top.empty() ? i : top[i]) << "draw " << r;
  }
}

TEST(SimSampling, TiesAtTheThresholdsKeepTheLowestIds) {
  // test_sampling.py: top_k over 40 equal tokens keeps ids 0..2; top_p = 0.11 of 40 keeps 5 (4.4).
  expect_equal_weight_draws(40, filters(1, 3, 1, 0), 3, 16);
  expect_equal_weight_draws(40, filters(1, 0, 0.11f, 0), 5, 16);
  // Ties spread over every thread of the block: 32000 equal tokens, 31.25 per thread.
  expect_equal_weight_draws(32000, filters(1, 1500, 1, 0), 1500, 4);
  expect_equal_weight_draws(32000, filters(1, 0, 0.3f, 0), 9601, 4);  // 0.3f * 32000 = 9600.0004
  expect_equal_weight_draws(32000, filters(1, 20000, 0.5f, 0), 10000, 4);  // top_p of the top_k
  // top_p reached exactly: 0.5 of 4 equal tokens is 2 of them, of 2 is 1; and a single token.
  expect_equal_weight_draws(4, filters(1, 0, 0.5f, 0), 2, 8);
  expect_equal_weight_draws(2, filters(1, 0, 0.5f, 0), 1, 4);
  expect_equal_weight_draws(1, filters(1, 5, 0.5f, 0), 1, 2);
  // min_p = 1 keeps the tokens tied at the top, top_k the first of them, top_p its share.
  expect_equal_weight_draws(300, filters(1, 0, 1, 1.0f), 3, 8, {5, 9, 200});
  expect_equal_weight_draws(300, filters(1, 2, 1, 0), 2, 4, {5, 9, 200});
  expect_equal_weight_draws(300, filters(1, 0, 0.6f, 0.5f), 2, 4, {5, 9, 200});  // 1.8 of 3
  // A tie straddling the top_k cut below a distinct likelier group: 5 and 9, then 1 and 3.
  std::vector<float> row(40, 0.0f);
  row[5] = row[9] = 2.0f;
  for (int t : {1, 3, 7, 11, 13}) row[t] = 1.0f;
  const Batch b = draws(row, 16, filters(1, 4, 1, 0));
  const std::vector<int32_t> got = expect_matches_reference(b, 1.0).sampled;
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), (std::set<int32_t>{1, 3, 5, 9}));
}

TEST(SimSampling, TemperatureZeroIgnoresFilters) {
  EXPECT_EQ(sim_one({0.0f, 3.0f, 1.0f}, filters(0, 1, 0.1f, 0.9f)), 1);
}

// NaN logits are never drawn (both kernels weigh them 0); the rest of the row keeps its
// distribution.
TEST(SimSampling, NaNLogitsAreNeverDrawn) {
  std::mt19937 gen(9);
  std::vector<float> row = randn(64, gen);
  for (int t : {0, 5, argmax(row.data(), 64), 63}) row[t] = NAN;
  const std::vector<int32_t> tokens = expect_matches_reference(draws(row, 200, Request{}), 1.0).sampled;
  for (int32_t t : tokens) EXPECT_FALSE(std::isnan(row[t])) << t;
  EXPECT_GT(std::set<int32_t>(tokens.begin(), tokens.end()).size(), 10u);
  expect_matches_reference(draws(row, 8, filters(1, 10, 1, 0)), 1.0);
}

// ---- Seeds and batches ----------------------------------------------------------------------

TEST(SimSampling, SameSeedAndCounterGiveTheSameToken) {
  std::mt19937 gen(5);
  const std::vector<float> row = randn(1000, gen);
  Request q = filters(1, 0, 1, 0.02f);
  q.seed = 1234;
  const std::vector<int32_t> first = sim(draws(row, 200, q));
  EXPECT_EQ(first, sim(draws(row, 200, q)));
  EXPECT_GT(std::set<int32_t>(first.begin(), first.end()).size(), 50u);  // other counters: other draws
  q.seed = 1235;
  const std::vector<int32_t> other = sim(draws(row, 200, q));
  int differ = 0;
  for (size_t i = 0; i < first.size(); ++i) differ += first[i] != other[i];
  EXPECT_GT(differ, 100);  // another seed: another stream
}

// test_sampling.py's request_batch: eight requests with different parameters and lists, seeds
// and counters.
Batch request_batch() {
  std::mt19937 gen(6);
  const int64_t vocab = 2053;
  Batch b(vocab, 8, /*pad=*/3);
  b.penalties = b.logprobs = true;
  b.num_top = 4;
  const float temperature[] = {1.0f, 0.0f, 0.7f, 1.3f, 1.0f, 0.0f, 0.9f, 1.1f};
  const int32_t top_k[] = {0, 5, 40, 0, 7, 0, 1000, 0};
  const float top_p[] = {0.9f, 1.0f, 1.0f, 0.5f, 1.0f, 0.3f, 0.95f, 1.0f};
  const float min_p[] = {0.0f, 0.1f, 0.0f, 0.0f, 0.05f, 0.0f, 0.0f, 0.2f};
  const float repetition[] = {1.2f, 1.0f, 1.1f, 1.0f, 0.8f, 1.5f, 1.0f, 1.0f};
  const float frequency[] = {0.0f, 0.3f, 0.0f, 0.5f, 0.0f, 0.0f, 0.1f, 0.0f};
  const float presence[] = {0.1f, 0.0f, 0.0f, 0.5f, 0.0f, 0.2f, 0.0f, 0.0f};
  const auto tokens = [&](int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(gen() % vocab));
    return t;
  };
  for (int r = 0; r < 8; ++r) {
    b.set_row(r, randn(vocab, gen, 2.0));
    Request& q = b.requests[r];
    q = filters(temperature[r], top_k[r], top_p[r], min_p[r]);
    q.repetition = repetition[r], q.frequency = frequency[r], q.presence = presence[r];
    q.prompt = tokens(static_cast<int>(gen() % 30));
    q.output = tokens(static_cast<int>(gen() % 30));
    q.banned = tokens(3 * (r % 2));
    std::sort(q.banned.begin(), q.banned.end());  // each token once per row: the bias lists' contract
    q.banned.erase(std::unique(q.banned.begin(), q.banned.end()), q.banned.end());
    if (r % 4 == 1) {  // a token the row does not ban, pushed up
      int32_t t = static_cast<int32_t>(gen() % vocab);
      while (std::count(q.banned.begin(), q.banned.end(), t)) t = static_cast<int32_t>((t + 1) % vocab);
      q.biases = {{t, 2.5f}};
    }
    q.seed = r % 2 ? 99 : -7 - (int64_t{1} << 40);
    q.counter = r * 7 + 3;
  }
  return b;
}

Batch select(const Batch& b, const std::vector<int>& rows) {
  Batch s(b.vocab, static_cast<int64_t>(rows.size()));
  s.penalties = b.penalties, s.logprobs = b.logprobs, s.num_top = b.num_top;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::copy(b.row(rows[i]), b.row(rows[i]) + b.vocab, s.row(static_cast<int64_t>(i)));
    s.requests[i] = b.requests[rows[i]];
  }
  return s;
}

TEST(SimSampling, ARequestGetsTheSameResultAloneOrInABatch) {
  const Batch batch = request_batch();
  const Output all = expect_matches_reference(batch, 1.0);
  for (int request : {0, 3, 4, 6}) {
    for (const std::vector<int>& rows : std::vector<std::vector<int>>{{request}, {request, 2, 5}, {1, 7, request}}) {
      const Output part = run(select(batch, rows), DeviceType::kCUDA);
      const size_t i = static_cast<size_t>(std::find(rows.begin(), rows.end(), request) - rows.begin());
      SCOPED_TRACE("request " + std::to_string(request) + " at " + std::to_string(i));
      EXPECT_EQ(part.sampled[i], all.sampled[request]);
      EXPECT_EQ(part.ranks[i], all.ranks[request]);
      EXPECT_EQ(part.logprobs[i], all.logprobs[request]);
      for (int j = 0; j < batch.num_top; ++j) {
        EXPECT_EQ(part.top_ids[i * batch.num_top + j], all.top_ids[request * batch.num_top + j]);
        EXPECT_EQ(part.top_logprobs[i * batch.num_top + j], all.top_logprobs[request * batch.num_top + j]);
      }
    }
  }
}

// ---- Logprobs of the raw logits ----------------------------------------------------------------

// The raw rows' log-softmax in float64: sampled logprobs, ranks (tokens at least as likely) and
// the top-n tokens (likeliest first, lower ids first among equals) with their logprobs.
void expect_logprobs_of_raw_logits(const Batch& b, const Output& got) {
  for (int64_t r = 0; r < b.rows(); ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const float* row = b.row(r);
    const std::vector<double> x(row, row + b.vocab);
    const std::vector<int> order = likeliest_first(x);
    double sum = 0;
    for (double v : x) sum += std::exp(v - x[order[0]]);
    const double lse = x[order[0]] + std::log(sum);
    const int32_t token = got.sampled[r];
    EXPECT_NEAR(got.logprobs[r], x[token] - lse, 1e-5 * (1 + std::fabs(x[token] - lse)));
    EXPECT_EQ(got.ranks[r], std::count_if(x.begin(), x.end(), [&](double v) { return v >= x[token]; }));
    for (int64_t j = 0; j < b.num_top; ++j) {
      const double expected = x[order[j]] - lse;
      EXPECT_EQ(got.top_ids[r * b.num_top + j], order[j]) << "top " << j;
      EXPECT_NEAR(got.top_logprobs[r * b.num_top + j], expected, 1e-5 * (1 + std::fabs(expected))) << "top " << j;
    }
  }
}

// rejection_sample draws each row as sample() does and accepts the rows whose token is the draft.
TEST(SimSampling, RejectionSampleAcceptsTheRowsThatDrawTheirDraft) {
  Batch batch = request_batch();
  const Output plain = run(batch, DeviceType::kCUDA);
  for (int64_t r = 0; r < batch.rows(); ++r) {  // right, wrong, none
    const int32_t token = plain.sampled[static_cast<size_t>(r)];
    batch.drafts.push_back(r % 3 == 0 ? token : r % 3 == 1 ? (token + 1) % static_cast<int32_t>(batch.vocab) : -1);
  }
  for (DeviceType device : {DeviceType::kCUDA, DeviceType::kCPU}) {
    const Output verified = run(batch, device);
    EXPECT_EQ(verified.sampled, plain.sampled);
    EXPECT_EQ(verified.logprobs, plain.logprobs);
    for (int64_t r = 0; r < batch.rows(); ++r) {
      EXPECT_EQ(verified.accepted[static_cast<size_t>(r)], r % 3 == 0 ? 1 : 0) << "row " << r;
    }
  }
  batch.drafts[2] = static_cast<int32_t>(batch.vocab);  // not a token: the CPU refuses it
  EXPECT_THROW(run(batch, DeviceType::kCPU), octavo::Error);
}

TEST(SimSampling, LogprobsRanksAndTopNMatchLogSoftmax) {
  const float temperatures[] = {0.0f, 1.0f, 0.5f, 2.0f, 1.0f, 0.0f};
  for (int64_t vocab : {5, 1000, 30011}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    std::mt19937 gen(static_cast<unsigned>(vocab));
    Batch b(vocab, 6);
    b.penalties = b.logprobs = true;
    b.num_top = std::min<int64_t>(5, vocab);
    for (int64_t r = 0; r < b.rows(); ++r) {
      b.set_row(r, randn(vocab, gen, 4.0));
      // Penalties and temperature must not change the logprobs, which are of the raw logits.
      b.requests[r] = filters(temperatures[r], 3, 1, 0);
      b.requests[r].output = {0, 1, 2};
      b.requests[r].repetition = 1.5f, b.requests[r].presence = 1.0f;
      b.requests[r].counter = r;
    }
    const Output got = expect_matches_reference(b, 1.0);
    expect_logprobs_of_raw_logits(b, got);
    const Output reference_cpu = run(b, DeviceType::kCPU);
    EXPECT_EQ(got.top_ids, reference_cpu.top_ids);
    EXPECT_EQ(got.ranks, reference_cpu.ranks);
  }
}

TEST(SimSampling, GreedyTokenHasRankOneAndTopNTiesById) {
  Batch b = draws({1.0f, 3.0f, 2.0f, 3.0f, 2.0f, 0.0f}, 1, filters(0, 0, 1, 0));
  b.logprobs = true;
  b.num_top = 6;
  const Output got = run(b, DeviceType::kCUDA);
  EXPECT_EQ(got.sampled[0], 1);
  EXPECT_EQ(got.ranks[0], 2);  // both 3.0 count
  EXPECT_EQ(got.top_ids, (std::vector<int32_t>{1, 3, 2, 4, 0, 5}));
  expect_logprobs_of_raw_logits(b, got);
  Batch plain = draws({0.0f, 5.0f, 1.0f}, 1, filters(0, 0, 1, 0));
  plain.logprobs = true;
  EXPECT_EQ(run(plain, DeviceType::kCUDA).ranks[0], 1);
}

// ---- Realistic vocabularies -----------------------------------------------------------------

// A decode step of a few requests over a real vocabulary, the logits a slice of padded rows:
// greedy, nucleus, top_k with min_p, and plain sampling, with penalties, bans and logprobs.
TEST(SimSampling, RealisticVocabulariesWithPaddedRows) {
  for (int64_t vocab : {32000, 49152}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    std::mt19937 gen(static_cast<unsigned>(vocab));
    Batch b(vocab, 4, /*pad=*/64);
    b.penalties = b.logprobs = true;
    b.num_top = 5;
    const Request params[] = {filters(0, 0, 1, 0), filters(0.8f, 0, 0.9f, 0), filters(1.2f, 40, 1, 0.05f),
                              filters(1, 0, 1, 0)};
    for (int64_t r = 0; r < b.rows(); ++r) {
      b.set_row(r, randn(vocab, gen, 3.0));
      Request& q = b.requests[r];
      q = params[r];
      q.seed = 1000 + r, q.counter = 17 * r;
      for (int i = 0; i < 50; ++i) q.prompt.push_back(static_cast<int32_t>(gen() % vocab));
      for (int i = 0; i < 20; ++i) q.output.push_back(q.prompt[gen() % 50]);
      q.repetition = 1.1f, q.frequency = 0.2f * static_cast<float>(r), q.presence = 0.3f;
      if (r % 2) q.banned = {argmax(b.row(r), vocab), 0, static_cast<int32_t>(vocab - 1)};
    }
    expect_logprobs_of_raw_logits(b, expect_matches_reference(b, 1.0));
  }
}

// ---- Arguments only the CUDA path checks ------------------------------------------------------

// test_cuda_sampling.py's case: the host cannot read CUDA penalty values, so penalties without
// their token lists are refused even when neutral.
TEST(SimSampling, PenaltiesWithoutTokenListsAreRefused) {
  const auto refused = [](const std::function<void()>& call, const std::string& message) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const octavo::Error& e) {
      EXPECT_EQ(e.kind(), octavo::ErrorKind::kValue);
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  std::mt19937 gen(10);
  Batch b(10, 2);
  b.set_row(0, randn(10, gen)), b.set_row(1, randn(10, gen));
  Tensor logits({2, 10}, DType::kFloat32), ones({2}, DType::kFloat32), zeros({2}, DType::kFloat32),
      seeds({2}, DType::kInt64), counters({2}, DType::kInt64), sampled({2}, DType::kInt32),
      offsets({3}, DType::kInt32), ids({1}, DType::kInt32);
  std::copy(b.logits.begin(), b.logits.end(), logits.as<float>());
  ones.set(0, 1), ones.set(1, 1);
  offsets.set(1, 1), offsets.set(2, 1), ids.set(0, 3);
  const TensorView ones_v = ones.cuda(), zeros_v = zeros.cuda(), offsets_v = offsets.cuda(), ids_v = ids.cuda();
  const auto args = [&] {
    octavo::SampleArgs a;
    a.logits = logits.cuda(), a.temperature = ones.cuda(), a.seeds = seeds.cuda(), a.counters = counters.cuda();
    a.sampled = sampled.cuda();
    return a;
  };
  refused(
      [&] {
        octavo::SampleArgs a = args();
        a.repetition_penalty = &ones_v;
        octavo::sample(a);
      },
      "repetition_penalty needs the prompt and/or output token lists");
  refused(
      [&] {
        octavo::SampleArgs a = args();
        a.presence_penalty = &zeros_v;
        octavo::sample(a);
      },
      "frequency_penalty and presence_penalty need");
  octavo::SampleArgs a = args();  // with the output lists, neutral penalties are fine
  a.repetition_penalty = &ones_v, a.frequency_penalty = &zeros_v;
  a.output_offsets = &offsets_v, a.output_token_ids = &ids_v;
  octavo::sample(a);
  for (int r = 0; r < 2; ++r) {
    const int32_t token = sampled.as<int32_t>()[r];
    EXPECT_EQ(token, reference(b, r).token) << "row " << r;
  }
}

}  // namespace
