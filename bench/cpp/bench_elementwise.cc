// Memory throughput of the elementwise kernels (rms_norm, fused_add_rms_norm, rotary_embedding,
// silu_and_mul, gelu_and_mul) on the active CPU ISA and the default thread count. Arguments are
// {tokens, width, dtype} with dtype 0 = float32, 1 = bfloat16; bytes/s counts every byte read or
// written once.
//   bench_elementwise --benchmark_filter=RmsNorm
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "octavo/cpu_isa.h"
#include "octavo/ops.h"
#include "octavo/tensor_view.h"
#include "octavo/threading.h"

namespace {

using octavo::DType;
using octavo::TensorView;

DType dtype_arg(int64_t arg) { return arg == 0 ? DType::kFloat32 : DType::kBFloat16; }

// An owned, contiguous, randomly filled tensor and its view.
struct Tensor {
  std::vector<unsigned char> bytes;
  TensorView view;

  Tensor(DType dtype, std::initializer_list<int64_t> shape, float scale = 1.0f) {
    view.dtype = dtype;
    view.ndim = static_cast<int>(shape.size());
    int64_t numel = 1;
    for (int i = view.ndim - 1; i >= 0; --i) {
      view.shape[i] = shape.begin()[i];
      view.strides[i] = numel;
      numel *= view.shape[i];
    }
    bytes.resize(static_cast<size_t>(numel) * octavo::dtype_size(dtype));
    view.data = bytes.data();
    fill(numel, scale);
  }
  int64_t nbytes() const { return static_cast<int64_t>(bytes.size()); }

 private:
  void fill(int64_t numel, float scale) {
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, scale);
    for (int64_t i = 0; i < numel; ++i) {
      const float f = normal(rng);
      if (view.dtype == DType::kFloat32) {
        std::memcpy(bytes.data() + 4 * i, &f, 4);
      } else {  // bfloat16: the top half of the float32 bits is close enough for timing
        uint32_t u;
        std::memcpy(&u, &f, 4);
        const uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
  }
};

void set_labels(benchmark::State& state) {
  state.SetLabel(state.range(2) == 0 ? "f32" : "bf16");
  state.counters["threads"] = octavo::get_num_threads();
}

// out = rms_norm(input) * weight. Reads input, writes out.
void BM_RmsNorm(benchmark::State& state) {
  const int64_t tokens = state.range(0), hidden = state.range(1);
  const DType dtype = dtype_arg(state.range(2));
  Tensor input(dtype, {tokens, hidden}), out(dtype, {tokens, hidden}), weight(dtype, {hidden});
  for (auto _ : state) octavo::rms_norm(out.view, input.view, weight.view, 1e-6);
  state.SetBytesProcessed(state.iterations() * (input.nbytes() + out.nbytes()));
  set_labels(state);
}

// residual += input; input = rms_norm(residual) * weight. Reads and writes both.
void BM_FusedAddRmsNorm(benchmark::State& state) {
  const int64_t tokens = state.range(0), hidden = state.range(1);
  const DType dtype = dtype_arg(state.range(2));
  Tensor input(dtype, {tokens, hidden}), residual(dtype, {tokens, hidden}), weight(dtype, {hidden});
  for (auto _ : state) octavo::fused_add_rms_norm(input.view, residual.view, weight.view, 1e-6);
  state.SetBytesProcessed(state.iterations() * 2 * (input.nbytes() + residual.nbytes()));
  set_labels(state);
}

// Llama-3-8B heads (32 query, 8 KV, head size 128) rotated in place; width = query heads.
void BM_RotaryEmbedding(benchmark::State& state) {
  const int64_t tokens = state.range(0), heads = state.range(1), kv_heads = heads / 4, head_size = 128;
  const DType dtype = dtype_arg(state.range(2));
  Tensor query(dtype, {tokens, heads * head_size}), key(dtype, {tokens, kv_heads * head_size});
  Tensor cache(DType::kFloat32, {8192, head_size}), positions(DType::kInt64, {tokens});
  int64_t* pos = positions.view.data_as<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) pos[t] = (t * 7919) % 8192;
  for (auto _ : state) octavo::rotary_embedding(positions.view, query.view, &key.view, head_size, cache.view, true);
  const int64_t cache_bytes = tokens * head_size * 4;
  const int64_t bytes = 2 * (query.nbytes() + key.nbytes()) + positions.nbytes() + cache_bytes;
  state.SetBytesProcessed(state.iterations() * bytes);
  set_labels(state);
}

// out = act(input[:, :d]) * input[:, d:]; width = d. Reads input, writes out.
template <bool kGelu>
void BM_GatedActivation(benchmark::State& state) {
  const int64_t tokens = state.range(0), d = state.range(1);
  const DType dtype = dtype_arg(state.range(2));
  Tensor input(dtype, {tokens, 2 * d}, 3.0f), out(dtype, {tokens, d});
  for (auto _ : state) {
    if (kGelu) octavo::gelu_and_mul(out.view, input.view, octavo::GeluApproximation::kTanh);
    else octavo::silu_and_mul(out.view, input.view);
  }
  state.SetBytesProcessed(state.iterations() * (input.nbytes() + out.nbytes()));
  set_labels(state);
}
void BM_SiluAndMul(benchmark::State& state) { BM_GatedActivation<false>(state); }
void BM_GeluTanhAndMul(benchmark::State& state) { BM_GatedActivation<true>(state); }

// Decode-like (1, 64 tokens) and prefill-like (4096 tokens) batches, float32 and bfloat16.
void hidden_shapes(benchmark::internal::Benchmark* b) {
  for (int64_t dtype : {0, 1}) {
    for (int64_t tokens : {1, 64, 4096}) b->Args({tokens, 4096, dtype});
  }
  b->ArgNames({"tokens", "hidden", "dtype"})->Unit(benchmark::kMicrosecond);
}
void head_shapes(benchmark::internal::Benchmark* b) {
  for (int64_t dtype : {0, 1}) {
    for (int64_t tokens : {1, 64, 4096}) b->Args({tokens, 32, dtype});
  }
  b->ArgNames({"tokens", "heads", "dtype"})->Unit(benchmark::kMicrosecond);
}
void mlp_shapes(benchmark::internal::Benchmark* b) {
  for (int64_t dtype : {0, 1}) {
    for (int64_t tokens : {1, 64, 4096}) b->Args({tokens, 4096, dtype});
    b->Args({1, 14336, dtype});  // one decode token of Llama-3-8B's MLP
  }
  b->ArgNames({"tokens", "d", "dtype"})->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_RmsNorm)->Apply(hidden_shapes);
BENCHMARK(BM_FusedAddRmsNorm)->Apply(hidden_shapes);
BENCHMARK(BM_RotaryEmbedding)->Apply(head_shapes);
BENCHMARK(BM_SiluAndMul)->Apply(mlp_shapes);
BENCHMARK(BM_GeluTanhAndMul)->Apply(mlp_shapes);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("octavo_cpu_isa", octavo::cpu_isa_name(octavo::active_cpu_isa()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
