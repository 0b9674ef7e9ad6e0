// Cost of one scheduler step (schedule() + update_from_output()) in C++, the per-step CPU
// overhead the engine pays on top of the forward pass.
//   bench_scheduler --benchmark_filter=Decode/256
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "octavo/scheduler.h"

namespace {

constexpr int kBlockSize = 16;
constexpr int kMaxModelLen = 4096;
constexpr int kPromptLen = 128;

std::vector<int32_t> prompt_for(int64_t seed, int len) {
  std::vector<int32_t> tokens(len);
  for (int i = 0; i < len; ++i) tokens[i] = static_cast<int32_t>((seed * 7919 + i * 104729) % 32000);
  return tokens;
}

octavo::RequestParams request(int64_t n, int prompt_len, int max_tokens) {
  octavo::RequestParams p;
  p.request_id = "req-" + std::to_string(n);
  p.prompt_token_ids = prompt_for(n, prompt_len);
  p.max_tokens = max_tokens;
  p.eos_token_id = -1;
  return p;
}

// Runs one step, feeding back one token per scheduled request.
void step(octavo::Scheduler& s, std::vector<int32_t>& sampled) {
  const octavo::SchedulerOutput& out = s.schedule();
  sampled.assign(out.num_reqs(), 42);
  benchmark::DoNotOptimize(s.update_from_output(sampled.data()));
}

// N requests decoding one token per step, with contexts growing from ~128 tokens.
void BM_DecodeStep(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  octavo::SchedulerConfig config;
  config.block_size = kBlockSize;
  config.max_model_len = kMaxModelLen;
  config.max_num_seqs = n;
  config.max_num_batched_tokens = std::max(n, 8192);
  config.num_blocks = n * (kMaxModelLen / kBlockSize) + 1;
  octavo::Scheduler s(config);
  for (int i = 0; i < n; ++i) s.add_request(request(i, kPromptLen, kMaxModelLen - kPromptLen));
  std::vector<int32_t> sampled;
  while (s.num_waiting() > 0) step(s, sampled);  // prefill everything first
  step(s, sampled);
  for (auto _ : state) step(s, sampled);
}
// Fixed iteration counts keep every request inside max_model_len.
BENCHMARK(BM_DecodeStep)->Arg(64)->Arg(256)->Arg(1024)->Iterations(3000)->Unit(benchmark::kMicrosecond);

// 256 slots under a 2048-token budget: decodes plus a stream of 512-token prompts that are
// chunked in, with finished requests (64 output tokens) replaced by new ones.
void BM_MixedStep(benchmark::State& state) {
  octavo::SchedulerConfig config;
  config.block_size = kBlockSize;
  config.max_model_len = kMaxModelLen;
  config.max_num_seqs = 256;
  config.max_num_batched_tokens = 2048;
  config.num_blocks = 256 * (1024 / kBlockSize) + 1;
  octavo::Scheduler s(config);
  int64_t next = 0;
  std::vector<int32_t> sampled;
  auto top_up = [&] {
    while (s.num_running() + s.num_waiting() < 272) s.add_request(request(next++, 512, 64));
  };
  for (int i = 0; i < 200; ++i) {  // reach a steady state
    top_up();
    step(s, sampled);
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    top_up();
    const octavo::SchedulerOutput& out = s.schedule();
    tokens += out.total_num_scheduled_tokens();
    sampled.assign(out.num_reqs(), 42);
    benchmark::DoNotOptimize(s.update_from_output(sampled.data()));
  }
  state.counters["tokens_per_step"] = static_cast<double>(tokens) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_MixedStep)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
