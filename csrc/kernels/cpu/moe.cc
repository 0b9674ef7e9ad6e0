// Mixture of experts on the CPU: the router's top-k (topk_softmax), the grouping of (token,
// slot) pairs by expert (moe_align), and the experts' MLP (fused_moe).
//
// fused_moe gathers the rows routed to each expert into one matrix and runs that expert's two
// projections through `linear` (this level's kernel: decode rows in registers, prefill on
// panels or AMX tiles), so each expert's weights stream once per call however many of the
// batch's tokens chose it. Threads take slabs of (expert, output features) from one job per
// projection for all the experts at once. The weighted sum over a token's experts is kept in
// float32 and added in ascending expert order: a token gets the same bits alone or in any batch
// that keeps each of its experts on the same side of linear's row-count switches (and, for
// quantized experts with 16-bit activations, of dispatch_compute's).
#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa_kernels.h"
#include "octavo/status.h"
#include "parallel.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
namespace {

// Routers of fewer tokens than this run on the calling thread.
constexpr int64_t kSerialRouterTokens = 64;
// (token, expert) pairs are projected this many at a time: bounds the scratch (a Mixtral-sized
// expert's gate_up rows are 28672 floats) while each batch is still large enough for the prefill
// kernels to run at full speed.
constexpr int64_t kBatchRows = 1024;
// A projection's jobs: about this many slabs of output features per thread (uneven experts
// still balance), each at least 32 rows.
constexpr int64_t kSlabsPerThread = 4;
// Copies and sums below this many elements run on the calling thread; larger ones in chunks of
// at least kMinChunkElems.
constexpr int64_t kSerialElems = 1 << 15;
constexpr int64_t kMinChunkElems = 1 << 13;
constexpr int64_t kAddColumns = 256;  // columns per job of the weighted sum
constexpr int64_t kBf16FromRows = 32;  // see dispatch_compute

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

// Whether score a beats b in a top-k: a number beats NaN, a higher score a lower one. Scans keep
// the first of equals, so ties go to the lower id (the CUDA kernel's rule too).
bool beats(float a, float b) { return a > b || (std::isnan(b) && !std::isnan(a)); }

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
      if (!kept[g] && beats(best[g], best[chosen])) chosen = g;
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
    // The first eligible expert stands in when every score is NaN, so ids stay valid.
    int64_t chosen = -1;
    for (int64_t e = 0; e < p.num_experts; ++e)
      if (eligible[e] && (chosen < 0 || beats(scores[e], scores[chosen]))) chosen = e;
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

// A run of the batch's rows that one expert takes: rows [begin, end) of the batch matrices.
struct Segment {
  int64_t expert, begin, end;
};

// One job of a projection: output features [first, first + count) of a segment's rows.
struct Slab {
  int64_t segment, first, count;
};

// Slabs of each segment's `n` output features, about kSlabsPerThread per thread over the batch,
// in multiples of 32 rows (the tile layout's panels never split).
std::vector<Slab> slabs_of(const std::vector<Segment>& segments, int64_t n) {
  const int64_t wanted = static_cast<int64_t>(get_num_threads()) * kSlabsPerThread;
  int64_t size = (static_cast<int64_t>(segments.size()) * n + wanted - 1) / wanted;
  size = std::min(n, std::max<int64_t>(32, (size + 31) / 32 * 32));
  std::vector<Slab> slabs;
  for (int64_t seg = 0; seg < static_cast<int64_t>(segments.size()); ++seg)
    for (int64_t first = 0; first < n; first += size) slabs.push_back({seg, first, std::min(size, n - first)});
  return slabs;
}

// Whether `linear` rounds the inputs of a stack's products to int8 (W4A8, W8A8).
bool rounds_inputs(const ExpertStack& w) {
  return w.format == WeightFormat::kInt4A8 || w.format == WeightFormat::kInt8A8;
}

// Whether a stack's weights decode to float32 in `linear` (every format but dense and the
// bfloat16 tiles, which multiply in the activations' type, and those that round the inputs).
bool decodes_to_float(const ExpertStack& w) {
  return w.format != WeightFormat::kDense && w.format != WeightFormat::kBf16Tiles && !rounds_inputs(w);
}

// `linear`'s arguments for out[seg.begin:seg.end, slab] = in[seg.begin:seg.end, :] · the slab of
// seg's expert's weightᵀ.
LinearParams slab_params(const ExpertStack& w, const Segment& seg, const Slab& slab, void* out, const void* in,
                         int64_t in_features, DType dtype) {
  const int64_t n = w.rows, row_bytes = w.expert_bytes / n, elem = static_cast<int64_t>(dtype_size(dtype));
  const int64_t expert = seg.expert;
  LinearParams lp{};
  lp.weight = static_cast<const uint8_t*>(w.weight) + expert * w.expert_bytes + slab.first * row_bytes;
  lp.scales = w.scales != nullptr ? w.scales + expert * w.expert_scales + slab.first * (w.expert_scales / n) : nullptr;
  lp.zeros = w.zeros != nullptr ? w.zeros + expert * w.expert_zeros + slab.first * (w.expert_zeros / n) : nullptr;
  lp.group_size = w.group_size;
  lp.weight_format = w.format;
  lp.out = static_cast<uint8_t*>(out) + (seg.begin * n + slab.first) * elem;
  lp.input = static_cast<const uint8_t*>(in) + seg.begin * in_features * elem;
  lp.rows = seg.end - seg.begin;
  lp.in_features = in_features;
  lp.out_features = slab.count;
  lp.in_stride = in_features;
  lp.out_stride = n;
  lp.dtype = dtype;
  return lp;
}

// Whether `linear` multiplies w's quantized weights by bfloat16 inputs as they are at `rows` rows
// (int8 on AMX tiles from 4 rows), rather than decoding them to float32.
bool keeps_bf16(const ExpertStack& w, int64_t in_features, int64_t rows) {
  LinearParams lp{};
  lp.weight_format = w.format;
  lp.dtype = DType::kBFloat16;
  lp.rows = rows;
  lp.in_features = in_features;
  return linear_keeps_bf16(lp);
}

// Whether a product's quantized weights go to `linear` dequantized to bfloat16: with bfloat16
// activations (bfloat16 products run on AMX tiles or vdpbf16ps, at several times float32's rate
// for prefill-sized row counts), unless the kernel keeps bfloat16 inputs for this format. Such a
// format is kept at any row count: the few rows below the kernel's start cost less on the vector
// kernel than a dequantized copy of the weights.
bool to_dense_bf16(const ExpertStack& w, const LinearParams& lp) {
  return lp.dtype == DType::kBFloat16 && decodes_to_float(w) &&
         !keeps_bf16(w, lp.in_features, std::max(lp.rows, kBf16FromRows));
}

// lp's weights dequantized into `buffer` as a dense bfloat16 matrix.
void dequantize_into(LinearParams& lp, std::vector<bf16>& buffer) {
  buffer.resize(lp.out_features * lp.in_features);
  LinearParams dq = lp;
  dq.out = buffer.data();
  dequantize(dq);
  lp.weight = buffer.data();
  lp.scales = nullptr;
  lp.zeros = nullptr;
  lp.weight_format = WeightFormat::kDense;
}

// out[begin:end, :] = in[begin:end, :] · expert's weightᵀ for every segment. Usually all
// segments' slabs run in one parallel job (each slab `linear` on the calling thread), so a decode
// step's few rows per expert wake the pool once per projection, not once per expert. With fewer
// experts than slabs (a prefill's few large experts), each expert's whole product is instead one
// `linear` call that splits it over the threads: the kernel then prepares its inputs once (W4A8:
// rounds them to int8) rather than once per slab (OLMoE-sized experts at 2048 tokens: that
// rounding was a tenth of the time). Not where a slab would be dequantized: a whole expert's
// bfloat16 copy would not stay in the cache.
void project(const ExpertStack& w, const std::vector<Segment>& segments, void* out, const void* in,
             int64_t in_features, DType dtype) {
  const std::vector<Slab> slabs = slabs_of(segments, w.rows);
  const auto whole = [&](const Segment& seg) {
    return slab_params(w, seg, {0, 0, w.rows}, out, in, in_features, dtype);
  };
  bool dequantizes = false;
  for (const Segment& seg : segments) dequantizes = dequantizes || to_dense_bf16(w, whole(seg));
  if (!dequantizes && slabs.size() > segments.size()) {
    for (const Segment& seg : segments) linear(whole(seg));
    return;
  }
  parallel_for(static_cast<int64_t>(slabs.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> buffer;
    for (int64_t i = begin; i < end; ++i) {
      LinearParams lp = slab_params(w, segments[slabs[i].segment], slabs[i], out, in, in_features, dtype);
      if (to_dense_bf16(w, lp)) dequantize_into(lp, buffer);
      linear(lp);
    }
  });
}

// The calling thread's buffer `slot`, at least `count` elements of U, kept for the next call: a
// prefill's buffers are tens of MB, and fresh ones cost their page faults on every call (OLMoE-
// sized w4a8 experts at 512 tokens: 61.3 -> 58.6 ms). The price is that memory staying allocated
// (a Mixtral-sized layer's float32 batch: 210 MB). Not thread_scratch: `linear` runs on this
// thread too and uses those slots.
enum KeptSlot { kKeptX, kKeptGateUp, kKeptAct, kKeptY, kKeptAcc, kKeptSlots };
template <typename U>
U* kept_buffer(KeptSlot slot, int64_t count) {
  struct Buffer {
    std::unique_ptr<U[]> data;
    int64_t count = 0;
  };
  thread_local Buffer buffers[kKeptSlots];
  Buffer& b = buffers[slot];
  if (b.count < count) {
    b.data.reset();  // the old one goes first: peak memory is the new size
    b.data.reset(new U[count]);
    b.count = count;
  }
  return b.data.get();
}

// out[0, n) = in[0, n), each value through float32 (as to_float and from_float convert it).
template <typename T, typename U>
void convert_row(const T* in, U* out, int64_t n) {
  int64_t h = 0;
  for (; h + kW <= n; h += kW) VecF::load(in + h).store(out + h);
  for (; h < n; ++h) out[h] = from_float<U>(to_float(in[h]));
}

// C: the type the experts compute in (see run_fused_moe).
template <typename C>
struct BatchScratch {
  C *x, *gate_up, *act, *y;  // [rows, H], [rows, 2I], [rows, I], [rows, H]
  BatchScratch(int64_t rows, int64_t H, int64_t I)
      : x(kept_buffer<C>(kKeptX, rows * H)), gate_up(kept_buffer<C>(kKeptGateUp, rows * 2 * I)),
        act(kept_buffer<C>(kKeptAct, rows * I)), y(kept_buffer<C>(kKeptY, rows * H)) {}
};

// The pairs order[0, rows) (grouped by expert in `segments`) through their experts, each result
// added into acc with its routing weight. T: the activations' type.
template <typename T, typename C>
void run_batch(const FusedMoeParams& p, const int32_t* order, int64_t rows, const std::vector<Segment>& segments,
               BatchScratch<C>& s, float* acc) {
  const int64_t H = p.hidden, I = p.intermediate;
  const T* hidden = static_cast<const T*>(p.hidden_states);
  parallel_for(rows, grain_for(rows, H, kSerialElems, kMinChunkElems), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) convert_row(hidden + order[i] / p.top_k * p.in_stride, s.x + i * H, H);
  });
  const DType compute = std::is_same_v<C, float> ? DType::kFloat32 : p.dtype;
  project(p.w13, segments, s.gate_up, s.x, H, compute);
  silu_and_mul(GatedActivationParams{s.act, s.gate_up, rows, I, 2 * I, I, compute});
  project(p.w2, segments, s.y, s.act, I, compute);
  // Columns split over threads, rows in order: each token's sum keeps ascending expert order.
  const int64_t blocks = (H + kAddColumns - 1) / kAddColumns;
  parallel_for(blocks, grain_for(blocks, rows * kAddColumns, kSerialElems, kMinChunkElems), [&](int64_t b0, int64_t b1) {
    const int64_t h0 = b0 * kAddColumns, h1 = std::min(H, b1 * kAddColumns);
    for (int64_t i = 0; i < rows; ++i) {
      const float w = p.topk_weights[order[i]];
      float* a = acc + order[i] / p.top_k * H;
      const C* y = s.y + i * H;
      int64_t h = h0;
      for (; h + kW <= h1; h += kW) (VecF::load(a + h) + VecF::set1(w) * VecF::load(y + h)).store(a + h);
      for (; h < h1; ++h) a[h] += w * to_float(y[h]);
    }
  });
}

// Where the batch of pairs that starts at `first` ends: after at most kBatchRows pairs, and at the
// start of an expert's rows where one lies inside that, so that an expert's rows are split
// between batches only where they alone pass kBatchRows. Every batch streams its experts' weights
// from memory: Mixtral-sized experts of about 512 rows each (2048 tokens) were read two or three
// times over when batches ended at fixed counts.
int64_t batch_end(const ExpertGroups& groups, int64_t first) {
  const int64_t total = static_cast<int64_t>(groups.order.size());
  const int64_t limit = std::min(total, first + kBatchRows);
  if (limit == total) return total;
  const auto after = std::upper_bound(groups.start.begin(), groups.start.end(), limit);  // the first start past it
  const int64_t boundary = *(after - 1);  // start[0] = 0 <= limit, so there is one
  return boundary > first ? boundary : limit;
}

template <typename T, typename C>
void run_fused_moe(const FusedMoeParams& p, const ExpertGroups& groups) {
  const int64_t H = p.hidden;
  const int64_t total = static_cast<int64_t>(groups.order.size());
  float* acc = kept_buffer<float>(kKeptAcc, p.tokens * H);
  std::fill(acc, acc + p.tokens * H, 0.0f);
  BatchScratch<C> scratch(std::min(total, kBatchRows), H, p.intermediate);
  int64_t expert = 0;
  for (int64_t first = 0, last = 0; first < total; first = last) {
    last = batch_end(groups, first);
    std::vector<Segment> segments;
    for (; expert < p.num_experts && groups.start[expert] < last; ++expert) {
      const int64_t begin = std::max(groups.start[expert], first), end = std::min(groups.start[expert + 1], last);
      if (begin < end) segments.push_back({expert, begin - first, end - first});
      if (groups.start[expert + 1] > last) break;  // the expert goes on in the next batch
    }
    run_batch<T, C>(p, groups.order.data() + first, last - first, segments, scratch, acc);
  }
  T* out = static_cast<T*>(p.out);
  parallel_for(p.tokens, grain_for(p.tokens, H, kSerialElems, kMinChunkElems), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) convert_row(acc + t * H, out + t * p.out_stride, H);
  });
}

// Quantized experts with 16-bit activations: a call whose experts average fewer rows than
// kBf16FromRows computes in float32 (the kernel then skips converting the activations on every
// read: int4 at one token about 1.25x as fast, and intermediate results are not rounded to 16
// bits); from kBf16FromRows on, bfloat16 activations multiply each slab's weights dequantized to
// bfloat16 (OLMoE-sized int4 experts at 512 tokens: about 2.7x the float32 path on AMX, see
// bench/RESULTS.md), which rounds the weights to bfloat16 as a bfloat16 checkpoint's would be.
// Where `linear` multiplies the weights by bfloat16 inputs as they are (int8 on AMX tiles, from 4
// rows), bfloat16 activations from there on, and nothing is dequantized (to_dense_bf16).
//
// W4A8 and W8A8 experts (int4_a8, int8_a8) are never dequantized: their products round the
// inputs to int8 at every row count (AMX tiles from linear_int8_tiles.h's tiles_from_rows on). Below
// kBf16FromRows they compute in float32 (one rounding per projection); from there on bfloat16
// activations stay bfloat16, as a bfloat16 model's intermediates would, and half the bytes move
// (Mixtral-sized W8A8 experts at 2048 tokens: about 0.9x the float32 path's time, OLMoE-sized
// 0.85-0.95x).
template <typename T>
void dispatch_compute(const FusedMoeParams& p) {
  const ExpertGroups groups = group_by_expert(p.topk_ids, p.tokens * p.top_k, p.num_experts);
  int64_t experts = 0;  // those with rows
  for (int64_t e = 0; e < p.num_experts; ++e) experts += groups.start[e + 1] > groups.start[e];
  const int64_t pairs = groups.start[p.num_experts];
  const int64_t rows = pairs / std::max<int64_t>(experts, 1);
  if (rounds_inputs(p.w13) || rounds_inputs(p.w2)) {
    if (std::is_same_v<T, bf16> && rows >= kBf16FromRows) return run_fused_moe<T, T>(p, groups);
    return run_fused_moe<T, float>(p, groups);
  }
  if (std::is_same_v<T, float> || !decodes_to_float(p.w13) || !decodes_to_float(p.w2))
    return run_fused_moe<T, T>(p, groups);
  const bool kept = keeps_bf16(p.w13, p.hidden, rows) && keeps_bf16(p.w2, p.intermediate, rows);
  if (std::is_same_v<T, bf16> && (rows >= kBf16FromRows || kept)) return run_fused_moe<T, T>(p, groups);
  run_fused_moe<T, float>(p, groups);
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
    case DType::kFloat32: return dispatch_compute<float>(p);
    case DType::kBFloat16: return dispatch_compute<bf16>(p);
    case DType::kFloat16: return dispatch_compute<f16>(p);
    default: OCTAVO_CHECK(false, "fused_moe: unsupported dtype " << dtype_name(p.dtype));
  }
}

}  // namespace octavo::cpu::OCTAVO_ISA
