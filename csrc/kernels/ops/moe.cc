// topk_softmax, moe_align and fused_moe: argument checks, then the CPU or CUDA launcher.
#include <cmath>
#include <tuple>

#include "cpu/isa_kernels.h"
#include "cuda/cuda_kernels.h"
#include "octavo/status.h"
#include "op_checks.h"

namespace octavo {
namespace {

// A contiguous int32 [rows, cols] tensor on ref's device.
void check_ids(const TensorView& t, const char* arg, int64_t rows, int64_t cols, const TensorView& ref,
               const char* ref_arg) {
  ops::check_same_device(t, arg, ref, ref_arg);
  check_dtype(t, arg, DType::kInt32);
  check_ndim(t, arg, 2);
  check_contiguous(t, arg);
  if (rows >= 0) check_size(t, arg, 0, rows);
  if (cols >= 0) check_size(t, arg, 1, cols);
}

// Every id in [-1, num_experts): the host reads CPU ids before a kernel indexes with them (the
// CUDA kernels skip ids outside that range instead; reading them here would be a copy per call).
void check_expert_ids(const TensorView& ids, int64_t num_experts) {
  if (ops::is_cuda(ids)) return;
  const int32_t* v = ids.data_as<const int32_t>();
  for (int64_t i = 0, n = ids.numel(); i < n; ++i)
    OCTAVO_CHECK_INDEX(v[i] >= -1 && v[i] < num_experts, "argument 'topk_ids' holds expert " << v[i] << ", outside [0, "
                                                                                             << num_experts
                                                                                             << ") (and -1 for none)");
}

// `t` without its first dimension, at index 0: expert 0's slice of a stack.
TensorView first_slice(const TensorView& t) {
  TensorView s = t;
  s.ndim = t.ndim - 1;
  for (int i = 0; i < s.ndim; ++i) {
    s.shape[i] = t.shape[i + 1];
    s.strides[i] = t.strides[i + 1];
  }
  return s;
}

// Checks an expert stack whose slices stand for `k` inputs each; returns it in launcher form.
ExpertStack check_stack(const ExpertWeights& w, const char* arg, int64_t num_experts, int64_t k,
                        const TensorView& ref) {
  OCTAVO_CHECK(w.weight != nullptr, "argument '" << arg << "' is missing");
  const TensorView& weight = *w.weight;
  OCTAVO_CHECK(weight.ndim == 3, "argument '" << arg << "' must be [num_experts, rows, row bytes or inputs], got "
                                              << weight.ndim << " dimension(s)");
  check_size(weight, arg, 0, num_experts);
  check_contiguous(weight, arg);
  const TensorView slice = first_slice(weight);
  TensorView scales, zeros;
  WeightQuant quant{nullptr, nullptr, w.quant.group_size};
  for (const auto& [stacked, sliced, slot, name] :
       {std::tuple{w.quant.scales, &scales, &quant.scales, "scales"},
        std::tuple{w.quant.zeros, &zeros, &quant.zeros, "zeros"}}) {
    if (stacked == nullptr) continue;
    OCTAVO_CHECK(stacked->ndim >= 2, "argument '" << name << "' of '" << arg << "' must be stacked per expert");
    check_size(*stacked, name, 0, num_experts);
    check_contiguous(*stacked, name);
    *sliced = first_slice(*stacked);
    *slot = sliced;
  }
  LinearParams p{};
  const int64_t rows = ops::check_weight(slice, w.format, quant, ref, "hidden_states", k, p);
  const int64_t scale_elems = quant.scales != nullptr ? quant.scales->numel() : 0;
  const int64_t zero_elems = quant.zeros != nullptr ? quant.zeros->numel() : 0;
  return ExpertStack{weight.data, p.scales, p.zeros, rows, slice.numel() * static_cast<int64_t>(dtype_size(weight.dtype)),
                     scale_elems, zero_elems, p.group_size, w.format};
}

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto* x = static_cast<const char*>(a);
  const auto* y = static_cast<const char*>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

void topk_softmax(const TensorView& topk_weights, const TensorView& topk_ids, const TensorView& gating_output,
                  const TopkArgs& args) {
  ops::check_float(gating_output, "gating_output");
  const ops::Rows g = ops::last_dim_rows(gating_output, "gating_output");
  OCTAVO_CHECK(topk_weights.ndim == 2, "argument 'topk_weights' must be [tokens, top_k], got "
                                           << topk_weights.ndim << " dimension(s)");
  const int64_t k = topk_weights.shape[1], E = g.cols;
  ops::check_same_device(topk_weights, "topk_weights", gating_output, "gating_output");
  check_dtype(topk_weights, "topk_weights", DType::kFloat32);
  check_contiguous(topk_weights, "topk_weights");
  check_size(topk_weights, "topk_weights", 0, g.rows);
  check_ids(topk_ids, "topk_ids", g.rows, k, gating_output, "gating_output");
  OCTAVO_CHECK(E >= 1, "argument 'gating_output' must score at least one expert");
  int64_t eligible = E;
  if (args.num_expert_group > 0) {
    OCTAVO_CHECK(E % args.num_expert_group == 0, "num_expert_group " << args.num_expert_group << " must divide the "
                                                                     << E << " experts");
    OCTAVO_CHECK(args.topk_group >= 1 && args.topk_group <= args.num_expert_group,
                 "topk_group must be in [1, num_expert_group = " << args.num_expert_group << "], got "
                                                                 << args.topk_group);
    eligible = E / args.num_expert_group * args.topk_group;
  } else {
    OCTAVO_CHECK(args.num_expert_group == 0, "num_expert_group must be >= 0, got " << args.num_expert_group);
  }
  OCTAVO_CHECK(k >= 1 && k <= eligible, "top_k must be in [1, " << eligible << "] (the experts a token may choose), got "
                                                                 << k);
  OCTAVO_CHECK(args.softcap >= 0.0 && std::isfinite(args.softcap), "softcap must be finite and >= 0, got "
                                                                       << args.softcap);
  TopkParams p{topk_weights.data_as<float>(), topk_ids.data_as<int32_t>(), gating_output.data, g.rows, E, k, g.stride,
               gating_output.dtype, args};
  if (ops::runs_on_cuda(gating_output, "gating_output")) cuda::topk_softmax(p);
  else cpu_dispatch(topk_softmax, p);
}

void moe_align(const TensorView& topk_ids, int64_t num_experts, int64_t block_size, const TensorView& sorted_token_ids,
               const TensorView& expert_ids, const TensorView& num_tokens_post_padded) {
  check_ids(topk_ids, "topk_ids", -1, -1, topk_ids, "topk_ids");
  OCTAVO_CHECK(num_experts >= 1, "num_experts must be >= 1, got " << num_experts);
  OCTAVO_CHECK(block_size >= 1, "block_size must be >= 1, got " << block_size);
  const int64_t pairs = topk_ids.numel(), capacity = pairs + num_experts * (block_size - 1);
  OCTAVO_CHECK(capacity < (int64_t{1} << 31), "moe_align: " << pairs << " pairs padded for " << num_experts
                                                            << " experts overflow int32 indices");
  ops::check_vector(sorted_token_ids, "sorted_token_ids", DType::kInt32, capacity, topk_ids, "topk_ids");
  ops::check_vector(expert_ids, "expert_ids", DType::kInt32, capacity / block_size, topk_ids, "topk_ids");
  ops::check_vector(num_tokens_post_padded, "num_tokens_post_padded", DType::kInt32, 1, topk_ids, "topk_ids");
  check_expert_ids(topk_ids, num_experts);
  MoeAlignParams p{topk_ids.data_as<const int32_t>(), sorted_token_ids.data_as<int32_t>(), expert_ids.data_as<int32_t>(),
                   num_tokens_post_padded.data_as<int32_t>(), pairs, num_experts, block_size, capacity};
  if (ops::runs_on_cuda(topk_ids, "topk_ids")) cuda::moe_align(p);
  else cpu_dispatch(moe_align, p);
}

void fused_moe(const TensorView& out, const TensorView& hidden, const ExpertWeights& w13, const ExpertWeights& w2,
               const TensorView& topk_weights, const TensorView& topk_ids) {
  const auto [in, o] = ops::float_in_out(out, "out", hidden);
  OCTAVO_CHECK(o.rows == in.rows && o.cols == in.cols, "argument 'out' must be [" << in.rows << ", " << in.cols
                                                                                  << "] like 'hidden_states', got "
                                                                                  << o.rows << " rows of " << o.cols);
  OCTAVO_CHECK(w13.weight != nullptr && w13.weight->ndim == 3, "argument 'w13' must be [num_experts, 2 * "
                                                               "intermediate, ...]");
  const int64_t E = w13.weight->shape[0];
  const ExpertStack gate_up = check_stack(w13, "w13", E, in.cols, hidden);
  OCTAVO_CHECK(gate_up.rows % 2 == 0, "argument 'w13' must hold gate and up rows (an even count), got "
                                          << gate_up.rows);
  const ExpertStack down = check_stack(w2, "w2", E, gate_up.rows / 2, hidden);
  OCTAVO_CHECK(down.rows == in.cols, "argument 'w2' must have " << in.cols << " rows per expert (the hidden size), got "
                                                                << down.rows);
  OCTAVO_CHECK(topk_weights.ndim == 2, "argument 'topk_weights' must be [tokens, top_k]");
  const int64_t k = topk_weights.shape[1];
  ops::check_same_device(topk_weights, "topk_weights", hidden, "hidden_states");
  check_dtype(topk_weights, "topk_weights", DType::kFloat32);
  check_contiguous(topk_weights, "topk_weights");
  check_size(topk_weights, "topk_weights", 0, in.rows);
  check_ids(topk_ids, "topk_ids", in.rows, k, hidden, "hidden_states");
  check_expert_ids(topk_ids, E);
  const int64_t row_bytes = in.cols * static_cast<int64_t>(dtype_size(hidden.dtype));
  OCTAVO_CHECK(in.rows == 0 || !overlaps(out.data, (o.rows - 1) * o.stride * static_cast<int64_t>(dtype_size(out.dtype)) +
                                                       row_bytes,
                                         hidden.data, (in.rows - 1) * in.stride *
                                                          static_cast<int64_t>(dtype_size(hidden.dtype)) + row_bytes),
               "argument 'out' must not overlap 'hidden_states'");
  FusedMoeParams p{out.data, hidden.data, topk_weights.data_as<const float>(), topk_ids.data_as<const int32_t>(),
                   gate_up, down, in.rows, in.cols, gate_up.rows / 2, E, k, in.stride, o.stride, hidden.dtype};
  if (ops::runs_on_cuda(hidden, "hidden_states")) {
    for (const ExpertStack* w : {&gate_up, &down})
      OCTAVO_CHECK(w->format != WeightFormat::kInt4A8 && w->format != WeightFormat::kInt8A8,
                   "experts in weight format " << weight_format_name(w->format)
                                               << " (int8 inputs) run on the CPU only; CUDA multiplies "
                                               << (w->format == WeightFormat::kInt4A8 ? "int4" : "int8"));
    cuda::fused_moe(p);
  } else {
    cpu_dispatch(fused_moe, p);
  }
}

}  // namespace octavo
