// sample and rejection_sample: argument checks, then the CPU or CUDA launcher. For CPU tensors token ids, CSR offsets
// and parameter values are validated here; the CUDA kernel cannot read them on the host, skips
// token ids outside the vocabulary, and relies on the engine's validation of SamplingParams.
#include <cmath>
#include <vector>

#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

// Every tensor lives where the logits do.
template <typename T>
const T* optional_vector(const TensorView* t, const char* arg, DType dtype, int64_t size, const TensorView& logits) {
  if (!t) return nullptr;
  ops::check_vector(*t, arg, dtype, size, logits, "logits");
  return t->data_as<T>();
}

template <typename T>
T* optional_matrix(const TensorView* t, const char* arg, DType dtype, int64_t rows, int64_t* cols,
                   const TensorView& logits) {
  if (!t) return nullptr;
  ops::check_same_device(*t, arg, logits, "logits");
  check_dtype(*t, arg, dtype);
  check_ndim(*t, arg, 2);
  check_size(*t, arg, 0, rows);
  check_contiguous(*t, arg);
  *cols = t->shape[1];
  return t->data_as<T>();
}

// A CSR list of token ids per request: offsets [num_reqs + 1] into ids, every id in [0, vocab).
void token_lists(const TensorView* offsets, const char* offsets_arg, const TensorView* ids, const char* ids_arg,
                 int64_t num_reqs, int64_t vocab, const TensorView& logits, const int32_t** offsets_out,
                 const int32_t** ids_out) {
  OCTAVO_CHECK((offsets == nullptr) == (ids == nullptr),
               "'" << offsets_arg << "' and '" << ids_arg << "' must be given together");
  if (!offsets) return;
  const int32_t* off = optional_vector<int32_t>(offsets, offsets_arg, DType::kInt32, num_reqs + 1, logits);
  check_ndim(*ids, ids_arg, 1);
  const int32_t* tok = optional_vector<int32_t>(ids, ids_arg, DType::kInt32, ids->shape[0], logits);
  *offsets_out = off;
  *ids_out = tok;
  if (ops::is_cuda(logits)) return;
  OCTAVO_CHECK(off[0] == 0 && off[num_reqs] == ids->shape[0],
               "'" << offsets_arg << "' must start at 0 and end at the length of '" << ids_arg << "' ("
                   << ids->shape[0] << ")");
  for (int64_t r = 0; r < num_reqs; ++r) {
    OCTAVO_CHECK(off[r] <= off[r + 1], "'" << offsets_arg << "' must be non-decreasing (at " << r << ")");
  }
  for (int64_t i = 0; i < ids->shape[0]; ++i) {
    OCTAVO_CHECK(tok[i] >= 0 && tok[i] < vocab, ids_arg << "[" << i << "] = " << tok[i]
                                                        << " is not a token id (vocabulary size " << vocab << ")");
  }
}

// The bias lists: token_lists' checks, values [N] float32 beside the ids and, on the CPU, each
// token at most once per row (a second entry would be added twice on the CPU and once on CUDA);
// only_listed [B] int32.
void bias_lists(const SampleArgs& a, int64_t num_reqs, int64_t vocab, SampleParams* p) {
  token_lists(a.bias_offsets, "bias_offsets", a.bias_token_ids, "bias_token_ids", num_reqs, vocab, a.logits,
              &p->bias_offsets, &p->bias_token_ids);
  OCTAVO_CHECK((a.bias_values == nullptr) == (a.bias_offsets == nullptr),
               "'bias_values' must be given with 'bias_offsets' and 'bias_token_ids'");
  if (a.bias_values) {
    p->bias_values = optional_vector<float>(a.bias_values, "bias_values", DType::kFloat32, a.bias_token_ids->shape[0],
                                            a.logits);
  }
  p->only_listed = optional_vector<int32_t>(a.only_listed, "only_listed", DType::kInt32, num_reqs, a.logits);
  if (!p->bias_offsets || ops::is_cuda(a.logits)) return;
  std::vector<int32_t> row_of(static_cast<size_t>(vocab), -1);
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int32_t i = p->bias_offsets[r]; i < p->bias_offsets[r + 1]; ++i) {
      const int32_t t = p->bias_token_ids[i];
      OCTAVO_CHECK(row_of[t] != r, "bias_token_ids lists token " << t << " twice for request " << r);
      row_of[t] = static_cast<int32_t>(r);
      OCTAVO_CHECK(!std::isnan(p->bias_values[i]) && p->bias_values[i] != INFINITY,
                   "bias_values[" << i << "] must be finite or -inf, got " << p->bias_values[i]);
    }
  }
}

// True if some of the n values differ from `neutral` (false for an absent tensor).
bool any_not(const float* values, int64_t n, float neutral) {
  for (int64_t i = 0; values && i < n; ++i) {
    if (values[i] != neutral) return true;
  }
  return false;
}

SampleParams checked_params(const SampleArgs& a) {
  check_dtype(a.logits, "logits", DType::kFloat32);
  check_ndim(a.logits, "logits", 2);
  const ops::Rows rows = ops::as_rows(a.logits, "logits");
  const int64_t n = rows.rows;
  OCTAVO_CHECK(rows.cols > 0, "argument 'logits' must have a non-empty vocabulary dimension");
  SampleParams p{};
  p.logits = a.logits.data_as<float>();
  p.num_reqs = n;
  p.vocab_size = rows.cols;
  p.logits_stride = rows.stride;
  p.temperature = optional_vector<float>(&a.temperature, "temperature", DType::kFloat32, n, a.logits);
  p.top_k = optional_vector<int32_t>(a.top_k, "top_k", DType::kInt32, n, a.logits);
  p.top_p = optional_vector<float>(a.top_p, "top_p", DType::kFloat32, n, a.logits);
  p.min_p = optional_vector<float>(a.min_p, "min_p", DType::kFloat32, n, a.logits);
  const auto penalty = [&](const TensorView* t, const char* arg) {
    return optional_vector<float>(t, arg, DType::kFloat32, n, a.logits);
  };
  p.repetition_penalty = penalty(a.repetition_penalty, "repetition_penalty");
  p.frequency_penalty = penalty(a.frequency_penalty, "frequency_penalty");
  p.presence_penalty = penalty(a.presence_penalty, "presence_penalty");
  p.seeds = optional_vector<int64_t>(&a.seeds, "seeds", DType::kInt64, n, a.logits);
  p.counters = optional_vector<int64_t>(&a.counters, "counters", DType::kInt64, n, a.logits);
  p.sampled = const_cast<int32_t*>(optional_vector<int32_t>(&a.sampled, "sampled", DType::kInt32, n, a.logits));
  p.sampled_logprobs = const_cast<float*>(optional_vector<float>(a.sampled_logprobs, "sampled_logprobs",
                                                                 DType::kFloat32, n, a.logits));
  p.sampled_ranks =
      const_cast<int32_t*>(optional_vector<int32_t>(a.sampled_ranks, "sampled_ranks", DType::kInt32, n, a.logits));
  int64_t ids_cols = 0, lp_cols = 0;
  p.top_token_ids = optional_matrix<int32_t>(a.top_token_ids, "top_token_ids", DType::kInt32, n, &ids_cols, a.logits);
  p.top_logprobs = optional_matrix<float>(a.top_logprobs, "top_logprobs", DType::kFloat32, n, &lp_cols, a.logits);
  OCTAVO_CHECK((p.top_token_ids == nullptr) == (p.top_logprobs == nullptr) && ids_cols == lp_cols,
               "'top_token_ids' and 'top_logprobs' must be given together, with the same shape [num_reqs, n]");
  OCTAVO_CHECK(ids_cols <= p.vocab_size, "cannot return " << ids_cols << " top logprobs from a vocabulary of "
                                                          << p.vocab_size);
  p.num_top = ids_cols;
  token_lists(a.prompt_offsets, "prompt_offsets", a.prompt_token_ids, "prompt_token_ids", n, p.vocab_size, a.logits,
              &p.prompt_offsets, &p.prompt_token_ids);
  token_lists(a.output_offsets, "output_offsets", a.output_token_ids, "output_token_ids", n, p.vocab_size, a.logits,
              &p.output_offsets, &p.output_token_ids);
  bias_lists(a, n, p.vocab_size, &p);
  return p;
}

void launch(const SampleParams& p, const SampleArgs& a) {
  const int64_t n = p.num_reqs;
  if (ops::runs_on_cuda(a.logits, "logits")) {
    // The host reads no CUDA tensor's values, so neutral penalties cannot be told from active
    // ones there: penalties come with the token lists they apply to, or not at all.
    OCTAVO_CHECK(!p.repetition_penalty || p.prompt_offsets || p.output_offsets,
                 "on CUDA, repetition_penalty needs the prompt and/or output token lists (even when neutral)");
    OCTAVO_CHECK(!(p.frequency_penalty || p.presence_penalty) || p.output_offsets,
                 "on CUDA, frequency_penalty and presence_penalty need 'output_offsets' and 'output_token_ids' "
                 "(even when neutral)");
    cuda::sample(p);
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    OCTAVO_CHECK(p.temperature[r] >= 0, "temperature[" << r << "] must be >= 0, got " << p.temperature[r]);
    if (p.top_p) OCTAVO_CHECK(p.top_p[r] > 0 && p.top_p[r] <= 1, "top_p[" << r << "] must be in (0, 1], got " << p.top_p[r]);
    if (p.min_p) OCTAVO_CHECK(p.min_p[r] >= 0 && p.min_p[r] <= 1, "min_p[" << r << "] must be in [0, 1], got " << p.min_p[r]);
    if (p.repetition_penalty) {
      OCTAVO_CHECK(p.repetition_penalty[r] > 0, "repetition_penalty[" << r << "] must be > 0, got "
                                                                      << p.repetition_penalty[r]);
    }
  }
  // Neutral penalties (1 / 0 everywhere) need no token lists; active ones do.
  OCTAVO_CHECK(!any_not(p.repetition_penalty, n, 1.0f) || p.prompt_offsets || p.output_offsets,
               "repetition_penalty needs the prompt and/or output token lists");
  OCTAVO_CHECK(!(any_not(p.frequency_penalty, n, 0.0f) || any_not(p.presence_penalty, n, 0.0f)) || p.output_offsets,
               "frequency_penalty and presence_penalty need 'output_offsets' and 'output_token_ids'");
  cpu_dispatch(sample, p);
}

}  // namespace

void sample(const SampleArgs& a) { launch(checked_params(a), a); }

void rejection_sample(const SampleArgs& a, const TensorView& draft_token_ids, const TensorView& accepted) {
  SampleParams p = checked_params(a);
  p.draft_token_ids = optional_vector<int32_t>(&draft_token_ids, "draft_token_ids", DType::kInt32, p.num_reqs, a.logits);
  p.accepted = const_cast<int32_t*>(optional_vector<int32_t>(&accepted, "accepted", DType::kInt32, p.num_reqs, a.logits));
  for (int64_t r = 0; !ops::is_cuda(a.logits) && r < p.num_reqs; ++r) {
    OCTAVO_CHECK(p.draft_token_ids[r] >= -1 && p.draft_token_ids[r] < p.vocab_size,
                 "draft_token_ids[" << r << "] = " << p.draft_token_ids[r] << " is neither -1 nor a token id "
                                    << "(vocabulary size " << p.vocab_size << ")");
  }
  launch(p, a);
}

}  // namespace octavo
