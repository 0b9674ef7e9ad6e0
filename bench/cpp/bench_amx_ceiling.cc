// The ceiling of the int8 AMX tile products that linear's W4A8 / W8A8 panels run on
// (csrc/kernels/cpu/linear_int8_tiles.h): the same 32 x 32 block loop (two input tiles, two
// weight tiles, four tdpbssd per step of 64 inputs), on one thread, with nothing else around it
// (no packing, rounding or epilogue), over operands of a given size. Arguments are {K, input
// blocks, weight panels}: the loop multiplies every block (32 rows x K int8) with every panel
// (K x 32) in turn, so the blocks' and panels' bytes say from which cache level the tiles load.
// The counter "MAC/s" is int8 multiply-adds per second; bench/RESULTS.md compares it with what
// fused_moe reaches.
//   bench_amx_ceiling
#include <benchmark/benchmark.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "octavo/cpu_isa.h"

namespace {

constexpr int64_t kStepBytes = 2 * 1024;  // two 16 x 64 int8 tiles per step of 64 inputs

// Palette 1, tiles 0-7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      bytes_per_row[i] = 64;
      rows[i] = 16;
    }
  }
};

__attribute__((target("amx-tile,amx-int8"))) void block_loop(const uint8_t* a, const uint8_t* b, int64_t steps,
                                                              int64_t blocks, int64_t panels, int32_t* sums) {
  const int64_t block_bytes = steps * kStepBytes;
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t j = 0; j < panels; ++j) {
      const uint8_t* x = a + i * block_bytes;
      const uint8_t* w = b + j * block_bytes;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < steps; ++kb) {
        _tile_loadd(4, x + kb * kStepBytes, 64);
        _tile_loadd(5, x + kb * kStepBytes + 1024, 64);
        _tile_loadd(6, w + kb * kStepBytes, 64);
        _tile_loadd(7, w + kb * kStepBytes + 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(0, sums, 64);
      _tile_stored(1, sums + 256, 64);
      _tile_stored(2, sums + 512, 64);
      _tile_stored(3, sums + 768, 64);
    }
}

__attribute__((target("amx-tile"))) void load_config() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

void BM_Int8TileProducts(benchmark::State& state) {
  // kAmx is AMX-TILE + AMX-BF16 granted by the OS; linear's int8 tiles run at that level too.
  if (!octavo::cpu_isa_supported(octavo::CpuIsa::kAmx)) {
    state.SkipWithError("this CPU (or OS) has no AMX");
    return;
  }
  const int64_t K = state.range(0), blocks = state.range(1), panels = state.range(2), steps = K / 64;
  const size_t block_bytes = static_cast<size_t>(steps * kStepBytes);
  auto* a = static_cast<uint8_t*>(std::aligned_alloc(4096, blocks * block_bytes));
  auto* b = static_cast<uint8_t*>(std::aligned_alloc(4096, panels * block_bytes));
  std::memset(a, 1, blocks * block_bytes);
  std::memset(b, 1, panels * block_bytes);
  alignas(64) int32_t sums[1024];
  load_config();  // cpu_isa_supported asked the OS for the tile state already
  for (auto _ : state) {
    block_loop(a, b, steps, blocks, panels, sums);
    benchmark::DoNotOptimize(sums);
  }
  release_tiles();
  state.counters["MAC/s"] = benchmark::Counter(static_cast<double>(32 * 32 * K * blocks * panels),
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["input KiB"] = static_cast<double>(blocks * block_bytes >> 10);
  state.counters["weight KiB"] = static_cast<double>(panels * block_bytes >> 10);
  std::free(a);
  std::free(b);
}

// {K, input blocks, weight panels}: both in L1; inputs in L2 against 1 MB of panels (linear's
// panel groups, kGroupBytes); inputs past L2 against those panels, at Mixtral's gate_up K (4096)
// and down K (14336), as fused_moe's prefill at 2048 tokens meets them.
BENCHMARK(BM_Int8TileProducts)
    ->Args({512, 1, 1})
    ->Args({4096, 1, 8})
    ->Args({4096, 32, 8})
    ->Args({14336, 8, 2})
    ->MinTime(1.0);

}  // namespace

#endif  // x86-64

BENCHMARK_MAIN();
