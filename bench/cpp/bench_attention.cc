// Decode attention over the paged cache, straight from C++ (no Python in the loop), and this
// machine's copy bandwidth measured in the same run for scale.
//   bench_attention --benchmark_filter=Decode
// bytes_per_second of BM_Decode counts the K and V bytes read, comparable to BM_CopyBandwidth.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "octavo/ops.h"
#include "octavo/tensor_view.h"

namespace {

constexpr int64_t kHeadSize = 128;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kNumKvHeads = 8;

octavo::TensorView view(void* data, octavo::DType dtype, std::vector<int64_t> shape) {
  octavo::TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

// bfloat16 bit patterns of small random values (the top half of a float32).
std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) {
    const float f = dist(gen);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

void BM_CopyBandwidth(benchmark::State& state) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_CopyBandwidth)->Unit(benchmark::kMillisecond)->UseRealTime();

// args: batch, context, query heads (GQA ratio = heads / 8 KV heads)
void BM_Decode(benchmark::State& state) {
  const int64_t batch = state.range(0), context = state.range(1), heads = state.range(2);
  const int64_t blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  const int64_t num_blocks = batch * blocks_per_seq + 1;
  const size_t cache_elems = static_cast<size_t>(num_blocks * kNumKvHeads * kBlockSize * kHeadSize);
  std::vector<uint16_t> key_cache = random_bf16(cache_elems, 1), value_cache = random_bf16(cache_elems, 2);
  std::vector<uint16_t> query = random_bf16(static_cast<size_t>(batch * heads * kHeadSize), 3);
  std::vector<uint16_t> out(query.size());
  std::vector<int32_t> tables(static_cast<size_t>(batch * blocks_per_seq));
  std::iota(tables.begin(), tables.end(), 1);
  std::shuffle(tables.begin(), tables.end(), std::mt19937(4));  // a real pool hands out blocks in any order
  std::vector<int32_t> starts(batch + 1), seq_lens(batch, static_cast<int32_t>(context));
  std::iota(starts.begin(), starts.end(), 0);

  using octavo::DType;
  const auto cache_shape = std::vector<int64_t>{num_blocks, kNumKvHeads, kBlockSize, kHeadSize};
  const octavo::TensorView o = view(out.data(), DType::kBFloat16, {batch, heads, kHeadSize});
  const octavo::TensorView q = view(query.data(), DType::kBFloat16, {batch, heads, kHeadSize});
  const octavo::TensorView k = view(key_cache.data(), DType::kBFloat16, cache_shape);
  const octavo::TensorView v = view(value_cache.data(), DType::kBFloat16, cache_shape);
  const octavo::TensorView qsl = view(starts.data(), DType::kInt32, {batch + 1});
  const octavo::TensorView sl = view(seq_lens.data(), DType::kInt32, {batch});
  const octavo::TensorView bt = view(tables.data(), DType::kInt32, {batch, blocks_per_seq});
  for (auto _ : state) {
    octavo::paged_attention(o, q, k, v, qsl, sl, bt, 1.0 / 11.3137);
    benchmark::DoNotOptimize(out.data());
  }
  const int64_t kv_bytes = 2 * batch * context * kNumKvHeads * kHeadSize * 2;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kv_bytes);
}
BENCHMARK(BM_Decode)
    ->ArgsProduct({{1, 8, 32}, {512, 2048, 8192}, {24, 32}})
    ->ArgNames({"batch", "context", "heads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
