// Mixture of experts on the CPU: the router's top-k (topk_softmax), the grouping of (token,
// slot) pairs by expert (moe_align), and the experts' MLP (fused_moe).
//
// fused_moe gathers the rows routed to each expert into one matrix and runs that expert's two
// projections through `linear` (this level's kernel: decode rows in registers, prefill on
// panels or AMX tiles, threads over slabs of the expert's output features), so each expert's
// weights stream once per call however many of the batch's tokens chose it. The weighted sum
// over a token's experts is kept in float32 and added in ascending expert order, the same for
// a token alone or in any batch.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "isa_kernels.h"
#include "octavo/status.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// Routers of fewer tokens than this run on the calling thread.
constexpr int64_t kSerialRouterTokens = 64;
// An expert's rows are projected this many at a time: bounds the scratch (a Mixtral-sized
// expert's gate_up rows are 28672 floats) while each chunk is still large enough for the
// prefill kernels to run at full speed.
constexpr int64_t kExpertRowChunk = 512;

// ---- topk_softmax -------------------------------------------------------------------------

template <typename T>
void score_row(const TopkParams& p, const T* logits, float* scores) {
  const int64_t E = p.num_experts;
  const float cap = static_cast<float>(p.args.softcap);
  for (int64_t e = 0; e < E; ++e) {
    const float x = to_float(logits[e]);
    scores[e] = cap > 0.0f ? cap * std::tanh(x / cap) : x;
  }
  if (p.args.scoring == MoeScoring::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
    return;
  }
  float top = scores[0];
  for (int64_t e = 1; e < E; ++e) top = scores[e] > top ? scores[e] : top;
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(scores[e] - top);
  for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
}

// Leaves eligible[e] true only for the experts of the topk_group best groups.
void keep_best_groups(const TopkParams& p, const float* scores, std::vector<char>& eligible) {
  const int64_t groups = p.args.num_expert_group, per_group = p.num_experts / groups;
  std::vector<float> best(groups);
  for (int64_t g = 0; g < groups; ++g) {
    best[g] = scores[g * per_group];
    for (int64_t e = 1; e < per_group; ++e) best[g] = std::fmax(best[g], scores[g * per_group + e]);
  }
  std::vector<char> kept(groups, 0);
  for (int64_t pick = 0; pick < p.args.topk_group; ++pick) {
    int64_t chosen = 0;  // the first group not kept yet, unless a later one scores higher
    while (kept[chosen]) ++chosen;
    for (int64_t g = chosen + 1; g < groups; ++g)
      if (!kept[g] && best[g] > best[chosen]) chosen = g;
    kept[chosen] = 1;
  }
  for (int64_t e = 0; e < p.num_experts; ++e) eligible[e] = kept[e / per_group];
}

template <typename T>
void route_token(const TopkParams& p, int64_t t, std::vector<float>& scores, std::vector<char>& eligible) {
  score_row(p, static_cast<const T*>(p.gating_output) + t * p.gating_stride, scores.data());
  eligible.assign(p.num_experts, 1);
  if (p.args.num_expert_group > 0) keep_best_groups(p, scores.data(), eligible);
  float* weights = p.topk_weights + t * p.top_k;
  int32_t* ids = p.topk_ids + t * p.top_k;
  float sum = 0.0f;
  for (int64_t slot = 0; slot < p.top_k; ++slot) {
    // Strictly greater: ties keep the lower id. A NaN score never wins over a number, and the
    // first eligible expert stands in when every score is NaN, so ids stay valid.
    int64_t chosen = -1;
    for (int64_t e = 0; e < p.num_experts; ++e)
      if (eligible[e] && (chosen < 0 || scores[e] > scores[chosen])) chosen = e;
    eligible[chosen] = 0;
    ids[slot] = static_cast<int32_t>(chosen);
    sum += weights[slot] = scores[chosen];
  }
  if (p.args.renormalize)
    for (int64_t slot = 0; slot < p.top_k; ++slot) weights[slot] /= sum;
}

template <typename T>
void run_topk(const TopkParams& p) {
  const int64_t grain = p.tokens < kSerialRouterTokens ? (p.tokens > 0 ? p.tokens : 1) : kSerialRouterTokens / 4;
  parallel_for(p.tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(p.num_experts);
    std::vector<char> eligible;
    for (int64_t t = begin; t < end; ++t) route_token<T>(p, t, scores, eligible);
  });
}

// ---- grouping by expert -------------------------------------------------------------------

// The flat indices (t * top_k + slot) of the pairs routed to each expert, ascending within an
// expert: expert e's are order[start[e], start[e + 1]). Ids of -1 are left out.
struct ExpertGroups {
  std::vector<int64_t> start;
  std::vector<int32_t> order;
};

ExpertGroups group_by_expert(const int32_t* ids, int64_t pairs, int64_t num_experts) {
  ExpertGroups g{std::vector<int64_t>(num_experts + 1, 0), {}};
  for (int64_t i = 0; i < pairs; ++i)
    if (ids[i] >= 0) ++g.start[ids[i] + 1];
  for (int64_t e = 0; e < num_experts; ++e) g.start[e + 1] += g.start[e];
  g.order.resize(g.start[num_experts]);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i)
    if (ids[i] >= 0) g.order[next[ids[i]]++] = static_cast<int32_t>(i);
  return g;
}

// ---- fused_moe ------------------------------------------------------------------------------

// Expert e's slice of a stack as linear's weight, for `rows` input rows of `in_features`.
LinearParams expert_linear(const ExpertStack& w, int64_t e, void* out, const void* input, int64_t rows,
                           int64_t in_features, DType dtype) {
  LinearParams lp{};
  lp.out = out;
  lp.input = input;
  lp.weight = static_cast<const uint8_t*>(w.weight) + e * w.expert_bytes;
  lp.scales = w.scales != nullptr ? w.scales + e * w.expert_scales : nullptr;
  lp.zeros = w.zeros != nullptr ? w.zeros + e * w.expert_zeros : nullptr;
  lp.rows = rows;
  lp.in_features = in_features;
  lp.out_features = w.rows;
  lp.in_stride = in_features;
  lp.out_stride = w.rows;
  lp.group_size = w.group_size;
  lp.dtype = dtype;
  lp.weight_format = w.format;
  return lp;
}

template <typename T>
struct ExpertScratch {
  std::unique_ptr<T[]> x, gate_up, act, y;  // [chunk, H], [chunk, 2I], [chunk, I], [chunk, H]
  ExpertScratch(int64_t rows, int64_t H, int64_t I)
      : x(new T[rows * H]), gate_up(new T[rows * 2 * I]), act(new T[rows * I]), y(new T[rows * H]) {}
};

// Rows order[0, m) of the step through expert e, each added into acc with its routing weight.
template <typename T>
void run_expert_rows(const FusedMoeParams& p, int64_t e, const int32_t* order, int64_t m, ExpertScratch<T>& s,
                     float* acc) {
  const int64_t H = p.hidden, I = p.intermediate;
  const T* hidden = static_cast<const T*>(p.hidden_states);
  for (int64_t i = 0; i < m; ++i) {
    const T* row = hidden + order[i] / p.top_k * p.in_stride;
    std::copy(row, row + H, s.x.get() + i * H);
  }
  linear(expert_linear(p.w13, e, s.gate_up.get(), s.x.get(), m, H, p.dtype));
  silu_and_mul(GatedActivationParams{s.act.get(), s.gate_up.get(), m, I, 2 * I, I, p.dtype});
  linear(expert_linear(p.w2, e, s.y.get(), s.act.get(), m, I, p.dtype));
  for (int64_t i = 0; i < m; ++i) {
    const float w = p.topk_weights[order[i]];
    float* a = acc + order[i] / p.top_k * H;
    const T* y = s.y.get() + i * H;
    for (int64_t h = 0; h < H; ++h) a[h] += w * to_float(y[h]);
  }
}

template <typename T>
void run_fused_moe(const FusedMoeParams& p) {
  const int64_t H = p.hidden;
  const ExpertGroups groups = group_by_expert(p.topk_ids, p.tokens * p.top_k, p.num_experts);
  std::vector<float> acc(p.tokens * H, 0.0f);
  int64_t most_rows = 0;
  for (int64_t e = 0; e < p.num_experts; ++e) most_rows = std::max(most_rows, groups.start[e + 1] - groups.start[e]);
  ExpertScratch<T> scratch(std::min(most_rows, kExpertRowChunk), H, p.intermediate);
  for (int64_t e = 0; e < p.num_experts; ++e)
    for (int64_t first = groups.start[e]; first < groups.start[e + 1]; first += kExpertRowChunk) {
      const int64_t m = std::min(kExpertRowChunk, groups.start[e + 1] - first);
      run_expert_rows<T>(p, e, groups.order.data() + first, m, scratch, acc.data());
    }
  T* out = static_cast<T*>(p.out);
  parallel_for(p.tokens, grain_for(p.tokens, H, 1 << 15, 1 << 13), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) out[t * p.out_stride + h] = from_float<T>(acc[t * H + h]);
  });
}

}  // namespace

void topk_softmax(const TopkParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return run_topk<float>(p);
    case DType::kBFloat16: return run_topk<bf16>(p);
    case DType::kFloat16: return run_topk<f16>(p);
    default: OCTAVO_CHECK(false, "topk_softmax: unsupported dtype " << dtype_name(p.dtype));
  }
}

void moe_align(const MoeAlignParams& p) {
  const ExpertGroups groups = group_by_expert(p.topk_ids, p.pairs, p.num_experts);
  const int32_t pad = static_cast<int32_t>(p.pairs);
  std::fill(p.sorted_token_ids, p.sorted_token_ids + p.capacity, pad);
  std::fill(p.expert_ids, p.expert_ids + p.capacity / p.block_size, -1);
  int64_t used = 0;
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const int64_t count = groups.start[e + 1] - groups.start[e];
    std::copy(groups.order.begin() + groups.start[e], groups.order.begin() + groups.start[e + 1],
              p.sorted_token_ids + used);
    const int64_t padded = (count + p.block_size - 1) / p.block_size * p.block_size;
    std::fill(p.expert_ids + used / p.block_size, p.expert_ids + (used + padded) / p.block_size,
              static_cast<int32_t>(e));
    used += padded;
  }
  *p.num_tokens_post_padded = static_cast<int32_t>(used);
}

void fused_moe(const FusedMoeParams& p) {
  if (p.tokens == 0) return;
  switch (p.dtype) {
    case DType::kFloat32: return run_fused_moe<float>(p);
    case DType::kBFloat16: return run_fused_moe<bf16>(p);
    case DType::kFloat16: return run_fused_moe<f16>(p);
    default: OCTAVO_CHECK(false, "fused_moe: unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
