// Each op takes torch tensors / numpy arrays (viewed zero-copy through DLPack), releases the GIL
// and calls the C++ op of the same name. Outputs are preallocated by the caller, as in vLLM. The
// call goes through run_op (op_graph.h), which also keeps it while a CPU graph records: its lambda
// holds what it reads by value (PyTensors, and any struct that points into them is built inside).
#include "bind_ops.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "octavo/cpu_isa.h"
#include "octavo/ops.h"
#include "octavo/status.h"
#include "octavo/threading.h"
#include "op_graph.h"
#include "tensor_from_python.h"

namespace py = pybind11;

namespace octavo::python {
namespace {

// A possibly-None tensor argument: view() is null for None.
struct OptTensor {
  std::optional<PyTensor> t;
  OptTensor(py::handle obj, const char* arg) {
    if (!obj.is_none()) t = tensor_view_from_python(obj, arg);
  }
  const TensorView* view() const { return t ? &t->view : nullptr; }
};

PyTensor tensor(py::handle obj, const char* arg) { return tensor_view_from_python(obj, arg); }

// sample's and rejection_sample's tensors: the five every call passes, then the optional ones as
// keyword arguments named after SampleArgs' fields. Holds the views while the op runs.
struct SampleTensors {
  SampleTensors(py::handle logits, py::handle temperature, py::handle seeds, py::handle counters,
                py::handle sampled, const py::kwargs& optional)
      : logits_(tensor(logits, "logits")), temperature_(tensor(temperature, "temperature")),
        seeds_(tensor(seeds, "seeds")), counters_(tensor(counters, "counters")), sampled_(tensor(sampled, "sampled")) {
    args.logits = logits_.view;
    args.temperature = temperature_.view;
    args.seeds = seeds_.view;
    args.counters = counters_.view;
    args.sampled = sampled_.view;
    for (const auto& [key, value] : optional) {
      const std::string name = py::str(key);
      const auto field = std::find_if(kOptional, std::end(kOptional), [&](const auto& f) { return name == f.first; });
      OCTAVO_CHECK_TYPE(field != std::end(kOptional), "unexpected keyword argument '" << name << "'");
      if (value.is_none()) continue;
      const PyTensor& t = optional_.emplace(name, tensor(value, field->first)).first->second;
      args.*(field->second) = &t.view;
    }
  }

  SampleArgs args;

 private:
  static constexpr std::pair<const char*, const TensorView* SampleArgs::*> kOptional[] = {
      {"top_k", &SampleArgs::top_k},
      {"top_p", &SampleArgs::top_p},
      {"min_p", &SampleArgs::min_p},
      {"repetition_penalty", &SampleArgs::repetition_penalty},
      {"frequency_penalty", &SampleArgs::frequency_penalty},
      {"presence_penalty", &SampleArgs::presence_penalty},
      {"prompt_offsets", &SampleArgs::prompt_offsets},
      {"prompt_token_ids", &SampleArgs::prompt_token_ids},
      {"output_offsets", &SampleArgs::output_offsets},
      {"output_token_ids", &SampleArgs::output_token_ids},
      {"bias_offsets", &SampleArgs::bias_offsets},
      {"bias_token_ids", &SampleArgs::bias_token_ids},
      {"bias_values", &SampleArgs::bias_values},
      {"only_listed", &SampleArgs::only_listed},
      {"sampled_logprobs", &SampleArgs::sampled_logprobs},
      {"sampled_ranks", &SampleArgs::sampled_ranks},
      {"top_token_ids", &SampleArgs::top_token_ids},
      {"top_logprobs", &SampleArgs::top_logprobs},
  };
  PyTensor logits_, temperature_, seeds_, counters_, sampled_;
  std::map<std::string, PyTensor> optional_;  // nodes stay put: args point into them
};

CpuIsa parse_isa(const std::string& name) {
  for (CpuIsa isa : kAllCpuIsas) {
    if (name == cpu_isa_name(isa)) return isa;
  }
  OCTAVO_CHECK(false, "CPU ISA must be 'scalar', 'avx2', 'avx512', 'avx512_bf16' or 'amx', got '" << name << "'");
  return CpuIsa::kScalar;
}

GeluApproximation parse_gelu(const std::string& name) {
  if (name == "none") return GeluApproximation::kNone;
  if (name == "tanh") return GeluApproximation::kTanh;
  OCTAVO_CHECK(false, "approximate must be 'none' or 'tanh', got '" << name << "'");
  return GeluApproximation::kNone;
}

void bind_kernels(py::module_& ops) {
  ops.def(
      "rms_norm",
      [](py::handle out, py::handle input, py::handle weight, double eps, bool weight_offset) {
        PyTensor o = tensor(out, "out"), i = tensor(input, "input"), w = tensor(weight, "weight");
        run_op([=] {
          rms_norm(o.view, i.view, w.view, eps, weight_offset);
        });
      },
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("eps"), py::arg("weight_offset") = false,
      "out = input / sqrt(mean(input^2) + eps) * weight (or * (1 + weight) with weight_offset).");
  ops.def(
      "fused_add_rms_norm",
      [](py::handle input, py::handle residual, py::handle weight, double eps, bool weight_offset) {
        PyTensor i = tensor(input, "input"), r = tensor(residual, "residual"), w = tensor(weight, "weight");
        run_op([=] {
          fused_add_rms_norm(i.view, r.view, w.view, eps, weight_offset);
        });
      },
      py::arg("input"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("weight_offset") = false,
      "residual += input; input = rms_norm(residual) * weight, both in place.");
  ops.def(
      "rotary_embedding",
      [](py::handle positions, py::handle query, py::handle key, int64_t head_size, py::handle cos_sin_cache,
         bool is_neox) {
        PyTensor p = tensor(positions, "positions"), q = tensor(query, "query");
        PyTensor c = tensor(cos_sin_cache, "cos_sin_cache");
        OptTensor k(key, "key");
        run_op([=] {
          rotary_embedding(p.view, q.view, k.view(), head_size, c.view, is_neox);
        });
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("head_size"), py::arg("cos_sin_cache"),
      py::arg("is_neox"), "Rotates query and key (may be None) in place by position.");
  ops.def(
      "silu_and_mul",
      [](py::handle out, py::handle input) {
        PyTensor o = tensor(out, "out"), i = tensor(input, "input");
        run_op([=] {
          silu_and_mul(o.view, i.view);
        });
      },
      py::arg("out"), py::arg("input"), "out = silu(input[..., :d]) * input[..., d:].");
  ops.def(
      "gelu_and_mul",
      [](py::handle out, py::handle input, const std::string& approximate) {
        PyTensor o = tensor(out, "out"), i = tensor(input, "input");
        const GeluApproximation a = parse_gelu(approximate);
        run_op([=] {
          gelu_and_mul(o.view, i.view, a);
        });
      },
      py::arg("out"), py::arg("input"), py::arg("approximate") = "none",
      "out = gelu(input[..., :d]) * input[..., d:]; approximate is 'none' (erf) or 'tanh'.");
  ops.def(
      "linear",
      [](py::handle out, py::handle input, py::handle weight, py::handle bias, const std::string& weight_format,
         py::handle scales, py::handle zeros, int64_t group_size, bool int8_inputs, bool tensor_cores) {
        PyTensor o = tensor(out, "out"), i = tensor(input, "input"), w = tensor(weight, "weight");
        OptTensor b(bias, "bias"), s(scales, "scales"), z(zeros, "zeros");
        const WeightFormat f = parse_weight_format(weight_format.c_str());
        run_op([=] {  // the quantization fields point into this lambda's own copies of s and z
          linear(o.view, i.view, w.view, b.view(), f,
                 WeightQuant{s.view(), z.view(), group_size, int8_inputs, tensor_cores});
        });
      },
      py::arg("out"), py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      py::arg("weight_format") = "dense", py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
      py::arg("group_size") = 0, py::arg("int8_inputs") = false, py::arg("tensor_cores") = false,
      "out = input @ weight.T (+ bias), for small row counts (decode). weight_format 'dense': weight [N, K] "
      "contiguous in input's dtype; GGUF blocks ('q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'iq4_nl': of 32 "
      "weights; 'q3_k', 'q4_k', 'q5_k', 'q6_k': of 256): uint8 [N, K / block weights * block bytes]; "
      "'int8': int8 [N, K] with float32 scales [N]; 'int4': uint8 [N, K / 2] with float32 scales and uint8 zeros "
      "[N, K / group_size]; 'bf16_tiles': uint8 [N, K * 2] from pack_bf16_tiles (CPU). int8_inputs (GGUF "
      "blocks, CPU): each input row is rounded to int8 per block of 32 inputs and multiplied as integers. "
      "tensor_cores (CUDA, bfloat16 / float16 input): multiplied on tensor cores, up to 16 rows per read of the "
      "weight, with the weights rounded to input's dtype (the result of dequantize's weights in that dtype).");
  ops.def(
      "dequantize",
      [](py::handle out, py::handle weight, const std::string& weight_format, py::handle scales, py::handle zeros,
         int64_t group_size) {
        PyTensor o = tensor(out, "out"), w = tensor(weight, "weight");
        OptTensor s(scales, "scales"), z(zeros, "zeros");
        const WeightFormat f = parse_weight_format(weight_format.c_str());
        run_op([=] {
          dequantize(o.view, w.view, f, WeightQuant{s.view(), z.view(), group_size});
        });
      },
      py::arg("out"), py::arg("weight"), py::arg("weight_format"), py::arg("scales") = py::none(),
      py::arg("zeros") = py::none(), py::arg("group_size") = 0,
      "out [N, K] float32, bfloat16 or float16 = the weights a quantized weight stands for (arguments as "
      "linear's); GGUF formats exactly as the gguf package dequantizes them, rounded to out's dtype.");
  ops.def(
      "pack_bf16_tiles",
      [](py::handle out, py::handle weight) {
        PyTensor o = tensor(out, "out"), w = tensor(weight, "weight");
        run_op([=] {
          pack_bf16_tiles(o.view, w.view);
        });
      },
      py::arg("out"), py::arg("weight"),
      "out uint8 [N, K * 2] = the bfloat16 weight [N, K] (CPU, N and K multiples of 32) in weight format "
      "'bf16_tiles': AMX weight tiles, read by linear without repacking; dequantize restores it exactly.");
  ops.def(
      "topk_softmax",
      [](py::handle topk_weights, py::handle topk_ids, py::handle gating_output, bool renormalize,
         const std::string& scoring, int64_t num_expert_group, int64_t topk_group, double softcap) {
        PyTensor w = tensor(topk_weights, "topk_weights"), i = tensor(topk_ids, "topk_ids"),
                 g = tensor(gating_output, "gating_output");
        OCTAVO_CHECK(scoring == "softmax" || scoring == "sigmoid",
                     "scoring must be 'softmax' or 'sigmoid', got '" << scoring << "'");
        const TopkArgs args{renormalize, scoring == "softmax" ? MoeScoring::kSoftmax : MoeScoring::kSigmoid,
                            num_expert_group, topk_group, softcap};
        run_op([=] {
          topk_softmax(w.view, i.view, g.view, args);
        });
      },
      py::arg("topk_weights"), py::arg("topk_ids"), py::arg("gating_output"), py::arg("renormalize") = false,
      py::arg("scoring") = "softmax", py::arg("num_expert_group") = 0, py::arg("topk_group") = 0,
      py::arg("softcap") = 0.0,
      "The router: topk_weights float32 [T, k] and topk_ids int32 [T, k] = each token's k best experts by "
      "softmax (or sigmoid) of gating_output [T, E] (soft-capped first when softcap > 0); num_expert_group / "
      "topk_group: only the experts of the topk_group best groups compete; renormalize: weights sum to 1.");
  ops.def(
      "moe_align",
      [](py::handle topk_ids, int64_t num_experts, int64_t block_size, py::handle sorted_token_ids,
         py::handle expert_ids, py::handle num_tokens_post_padded) {
        PyTensor i = tensor(topk_ids, "topk_ids"), s = tensor(sorted_token_ids, "sorted_token_ids"),
                 e = tensor(expert_ids, "expert_ids"), n = tensor(num_tokens_post_padded, "num_tokens_post_padded");
        run_op([=] {
          moe_align(i.view, num_experts, block_size, s.view, e.view, n.view);
        });
      },
      py::arg("topk_ids"), py::arg("num_experts"), py::arg("block_size"), py::arg("sorted_token_ids"),
      py::arg("expert_ids"), py::arg("num_tokens_post_padded"),
      "vLLM's moe_align_block_size: the flat (token * k + slot) indices of topk_ids grouped by expert, each "
      "expert's run padded with T * k to a multiple of block_size; expert_ids names each block's expert.");
  ops.def(
      "fused_moe",
      [](py::handle out, py::handle hidden_states, py::handle w13, py::handle w2, py::handle topk_weights,
         py::handle topk_ids, const std::string& w13_format, py::handle w13_scales, py::handle w13_zeros,
         int64_t w13_group_size, const std::string& w2_format, py::handle w2_scales, py::handle w2_zeros,
         int64_t w2_group_size) {
        PyTensor o = tensor(out, "out"), h = tensor(hidden_states, "hidden_states"), a = tensor(w13, "w13"),
                 b = tensor(w2, "w2"), w = tensor(topk_weights, "topk_weights"), i = tensor(topk_ids, "topk_ids");
        OptTensor as(w13_scales, "w13_scales"), az(w13_zeros, "w13_zeros"), bs(w2_scales, "w2_scales"),
            bz(w2_zeros, "w2_zeros");
        const WeightFormat f13 = parse_weight_format(w13_format.c_str()), f2 = parse_weight_format(w2_format.c_str());
        run_op([=] {  // the weights' fields point into this lambda's own copies of the tensors
          const ExpertWeights gate_up{&a.view, f13, WeightQuant{as.view(), az.view(), w13_group_size}};
          const ExpertWeights down{&b.view, f2, WeightQuant{bs.view(), bz.view(), w2_group_size}};
          fused_moe(o.view, h.view, gate_up, down, w.view, i.view);
        });
      },
      py::arg("out"), py::arg("hidden_states"), py::arg("w13"), py::arg("w2"), py::arg("topk_weights"),
      py::arg("topk_ids"), py::arg("w13_format") = "dense", py::arg("w13_scales") = py::none(),
      py::arg("w13_zeros") = py::none(), py::arg("w13_group_size") = 0, py::arg("w2_format") = "dense",
      py::arg("w2_scales") = py::none(), py::arg("w2_zeros") = py::none(), py::arg("w2_group_size") = 0,
      "out [T, H] = sum over k of topk_weights * down_e(silu(gate_e(x)) * up_e(x)), e = topk_ids (-1: none). "
      "w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], dense or in a linear weight format with "
      "scales / zeros stacked per expert.");
  ops.def("weight_block_bytes", [](const std::string& f) { return weight_block_bytes(parse_weight_format(f.c_str())); },
          py::arg("weight_format"),
          "Bytes per block of weight_block_weights weights in weight_format (0 for 'dense').");
  ops.def("weight_block_weights",
          [](const std::string& f) { return weight_block_weights(parse_weight_format(f.c_str())); },
          py::arg("weight_format"), "Weights per block in weight_format: 256 for the K-quants, else 32.");
  ops.def(
      "reshape_and_cache",
      [](py::handle key, py::handle value, py::handle key_cache, py::handle value_cache, py::handle slot_mapping,
         double k_scale, double v_scale) {
        PyTensor k = tensor(key, "key"), v = tensor(value, "value"), kc = tensor(key_cache, "key_cache");
        PyTensor vc = tensor(value_cache, "value_cache"), s = tensor(slot_mapping, "slot_mapping");
        run_op([=] {
          reshape_and_cache(k.view, v.view, kc.view, vc.view, s.view, k_scale, v_scale);
        });
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      py::kw_only(), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
      "Writes key/value [T, Hkv, D] into the paged caches [num_blocks, Hkv, block_size, D] by slot. On the CPU "
      "the caches may hold another float dtype than key/value (a kv_cache_dtype): each value is rounded to it. "
      "float8_e4m3fn caches (CPU and CUDA) hold key / k_scale and value / v_scale, saturated at +-448.");
  ops.def(
      "paged_attention",
      [](py::handle out, py::handle query, py::handle key_cache, py::handle value_cache, py::handle query_start_loc,
         py::handle seq_lens, py::handle block_tables, double scale, int64_t sliding_window, double softcap,
         py::handle plan, int64_t num_decodes, double k_scale, double v_scale) {
        PyTensor o = tensor(out, "out"), q = tensor(query, "query"), kc = tensor(key_cache, "key_cache");
        PyTensor vc = tensor(value_cache, "value_cache"), qsl = tensor(query_start_loc, "query_start_loc");
        PyTensor sl = tensor(seq_lens, "seq_lens"), bt = tensor(block_tables, "block_tables");
        OptTensor pl(plan, "plan");
        run_op([=] {
          paged_attention(o.view, q.view, kc.view, vc.view, qsl.view, sl.view, bt.view, scale, sliding_window, softcap,
                          pl.view(), num_decodes, k_scale, v_scale);
        });
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("query_start_loc"),
      py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("sliding_window") = 0,
      py::arg("softcap") = 0.0, py::arg("plan") = py::none(), py::arg("num_decodes") = 0, py::kw_only(),
      py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
      "Causal attention of a mixed prefill/decode batch over the paged KV cache (on the CPU of any float dtype, "
      "read as float32; on CUDA the query's; or float8_e4m3fn on both). k_scale, v_scale: a float8_e4m3fn cache's "
      "(reshape_and_cache's); other caches take 1.0. plan: None, or "
      "plan_paged_attention's result for this batch, on the query's device (used on CUDA, ignored on the CPU). "
      "num_decodes: how many leading sequences have one query token each (CUDA runs them in the decode kernels; "
      "0 says nothing).");
  ops.def(
      "plan_paged_attention",
      [](py::handle plan, py::handle query_start_loc, int64_t num_heads, int64_t num_kv_heads) {
        PyTensor pl = tensor(plan, "plan"), qsl = tensor(query_start_loc, "query_start_loc");
        run_op([=] {
          plan_paged_attention(pl.view, qsl.view, num_heads, num_kv_heads);
        });
      },
      py::arg("plan"), py::arg("query_start_loc"), py::arg("num_heads"), py::arg("num_kv_heads"),
      "Fills plan [B + 1] int32 (CPU) from query_start_loc [B + 1] int32 (CPU): paged_attention's batch layout "
      "for the CUDA kernels, computed on the host once per step.");
  ops.def(
      "apply_token_bitmask",
      [](py::handle logits, py::handle bitmask, py::handle indices) {
        PyTensor l = tensor(logits, "logits"), b = tensor(bitmask, "bitmask");
        OptTensor i(indices, "indices");
        run_op([=] {
          apply_token_bitmask(l.view, b.view, i.view());
        });
      },
      py::arg("logits"), py::arg("bitmask"), py::arg("indices") = py::none(),
      "Sets logits [B, V] float32 to -inf where the int32 bitmask [N, ceil(V / 32)] has a clear bit (row "
      "indices[i], or i); see include/octavo/ops.h.");
  ops.def(
      "sample",
      [](py::handle logits, py::handle temperature, py::handle seeds, py::handle counters, py::handle sampled,
         const py::kwargs& optional) {
        const SampleTensors t(logits, temperature, seeds, counters, sampled, optional);
        refuse_while_recording("sample");
        py::gil_scoped_release nogil;
        sample(t.args);
      },
      py::arg("logits"), py::arg("temperature"), py::arg("seeds"), py::arg("counters"), py::arg("sampled"),
      "Samples one token per row of logits with per-request parameters; the optional tensors are keyword "
      "arguments named as SampleArgs' fields (top_k, ..., top_logprobs); see include/octavo/ops.h.");
  ops.def(
      "rejection_sample",
      [](py::handle logits, py::handle temperature, py::handle seeds, py::handle counters, py::handle sampled,
         py::handle draft_token_ids, py::handle accepted, const py::kwargs& optional) {
        const SampleTensors t(logits, temperature, seeds, counters, sampled, optional);
        PyTensor d = tensor(draft_token_ids, "draft_token_ids"), a = tensor(accepted, "accepted");
        refuse_while_recording("rejection_sample");
        py::gil_scoped_release nogil;
        rejection_sample(t.args, d.view, a.view);
      },
      py::arg("logits"), py::arg("temperature"), py::arg("seeds"), py::arg("counters"), py::arg("sampled"),
      py::arg("draft_token_ids"), py::arg("accepted"),
      "Speculative decoding's verification: sample() on every row, accepted[b] = 1 where row b's token is "
      "draft_token_ids[b]; the optional tensors as sample()'s; see include/octavo/ops.h.");
}

}  // namespace

void bind_ops(py::module_& m) {
  m.def("get_num_threads", &get_num_threads, "Threads used by the CPU kernels.");
  m.def("set_num_threads", &set_num_threads, py::arg("n"), "Sets the threads used by the CPU kernels (n >= 1).");
  m.def("cpu_isa", [] { return std::string(cpu_isa_name(active_cpu_isa())); },
        "The compiled CPU kernel level in use: 'scalar', 'avx2', 'avx512', 'avx512_bf16' or 'amx'.");
  m.def("supported_cpu_isas", [] {
    py::list out;
    for (CpuIsa isa : kAllCpuIsas) {
      if (cpu_isa_supported(isa)) out.append(cpu_isa_name(isa));
    }
    return out;
  }, "CPU kernel levels this machine can run, lowest first.");
  m.def("set_cpu_isa", [](const std::string& name) { set_cpu_isa(parse_isa(name)); }, py::arg("name"),
        "Selects the CPU kernel level ('scalar', 'avx2', 'avx512', 'avx512_bf16', 'amx'); for tests and benchmarks.");
  py::module_ ops = m.def_submodule("ops", "Octavo's kernels; outputs are preallocated by the caller.");
  bind_kernels(ops);
}

}  // namespace octavo::python
