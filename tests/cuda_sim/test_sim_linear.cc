// linear and dequantize: the CUDA kernels run by the simulator against the CPU kernels, for every
// weight format, with test_linear*.py's case lists. Decoded weights must be the CPU's floats bit
// for bit; products may differ by the summation order only.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "octavo/status.h"
#include "sim_test_util.h"

namespace {

using octavo::WeightFormat;
using sim_test::DType;
using sim_test::expect_refusal;
using sim_test::kQuantized;
using sim_test::Tensor;
using sim_test::TensorView;
using sim_test::Weight;

// Calls octavo::linear / dequantize with w's views of one device.
void run_linear(Tensor& out, const Tensor& x, const Weight& w, const Tensor* bias, bool cuda) {
  const Weight::Views v = w.on(cuda);
  const TensorView b = bias ? (cuda ? bias->cuda() : bias->cpu()) : TensorView{};
  octavo::linear(cuda ? out.cuda() : out.cpu(), cuda ? x.cuda() : x.cpu(), v.data, bias ? &b : nullptr, w.format,
                 v.quant());
}
void run_dequantize(Tensor& out, const Weight& w, bool cuda) {
  const Weight::Views v = w.on(cuda);
  octavo::dequantize(cuda ? out.cuda() : out.cpu(), v.data, w.format, v.quant());
}

std::string name(WeightFormat f, DType dtype) {
  return std::string(octavo::weight_format_name(f)) + " " + octavo::dtype_name(dtype);
}

TEST(SimLinear, DequantizeGivesTheCpuFloatsBitForBit) {
  std::mt19937 gen(31);
  for (WeightFormat f : kQuantized)
    for (auto [n, k32] : std::vector<std::pair<int64_t, int64_t>>{{1, 32}, {7, 96}, {64, 576}, {33, 1536}})
      for (DType dtype : sim_test::kFloatDTypes) {
        const int64_t k = sim_test::whole_blocks(f, k32);
        SCOPED_TRACE(name(f, dtype) + " " + std::to_string(n) + "x" + std::to_string(k));
        const Weight w(f, n, k, gen);
        Tensor cpu({n, k}, dtype), gpu({n, k}, dtype);
        run_dequantize(cpu, w, false);
        run_dequantize(gpu, w, true);
        EXPECT_TRUE(gpu.same_bytes(cpu));
      }
}

TEST(SimLinear, QuantizedWeightsMatchTheCpu) {
  std::mt19937 gen(32);
  const std::vector<std::array<int64_t, 3>> cases = {{1, 1, 32},   {1, 7, 64},   {2, 33, 96}, {3, 64, 576},
                                                     {4, 9, 1536}, {5, 130, 32}, {9, 17, 256}};
  for (WeightFormat f : kQuantized)
    for (DType dtype : sim_test::kFloatDTypes)
      for (auto [m, n, k32] : cases)
        for (bool with_bias : {false, true}) {
          const int64_t k = sim_test::whole_blocks(f, k32);
          SCOPED_TRACE(name(f, dtype) + " m,n,k " + std::to_string(m) + "," + std::to_string(n) + "," +
                       std::to_string(k) + (with_bias ? " bias" : ""));
          const Weight w(f, n, k, gen);
          const Tensor x = sim_test::randn({m, k}, dtype, gen), bias = sim_test::randn({n}, dtype, gen);
          Tensor cpu({m, n}, dtype), gpu({m, n}, dtype);
          run_linear(cpu, x, w, with_bias ? &bias : nullptr, false);
          run_linear(gpu, x, w, with_bias ? &bias : nullptr, true);
          sim_test::expect_matches_cpu(gpu, cpu);
        }
}

TEST(SimLinear, DenseWeightsMatchTheCpu) {
  std::mt19937 gen(33);
  for (DType dtype : sim_test::kFloatDTypes)
    for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{{1, 7, 64}, {3, 64, 576}, {6, 9, 1536}}) {
      SCOPED_TRACE(std::string(octavo::dtype_name(dtype)) + " m " + std::to_string(m));
      const Tensor x = sim_test::randn({m, k}, dtype, gen), w = sim_test::randn({n, k}, dtype, gen);
      const Tensor bias = sim_test::randn({n}, dtype, gen);
      Tensor cpu({m, n}, dtype), gpu({m, n}, dtype);
      const TensorView cpu_bias = bias.cpu(), gpu_bias = bias.cuda();
      octavo::linear(cpu.cpu(), x.cpu(), w.cpu(), &cpu_bias);
      octavo::linear(gpu.cuda(), x.cuda(), w.cuda(), &gpu_bias);
      sim_test::expect_matches_cpu(gpu, cpu);
    }
}

// The CPU kernel's promise, kept on CUDA: a quantized weight gives exactly what the dense kernel
// gives on its dequantized float32 weights (same floats, same order of sums).
TEST(SimLinear, QuantizedEqualsDenseOnTheDequantizedWeights) {
  std::mt19937 gen(34);
  for (WeightFormat f : kQuantized) {
    SCOPED_TRACE(octavo::weight_format_name(f));
    const int64_t m = 3, n = 21, k = sim_test::whole_blocks(f, 576);
    const Weight w(f, n, k, gen);
    const Tensor x = sim_test::randn({m, k}, DType::kFloat32, gen);
    Tensor floats({n, k}, DType::kFloat32), dense({m, n}, DType::kFloat32), quantized({m, n}, DType::kFloat32);
    run_dequantize(floats, w, true);
    octavo::linear(dense.cuda(), x.cuda(), floats.cuda(), nullptr);
    run_linear(quantized, x, w, nullptr, true);
    EXPECT_TRUE(quantized.same_bytes(dense));
  }
}

// Each output row is the same bits whatever the batch: one row alone, and in batches of every
// size the kernel splits differently (1, 2 and 4 input rows per CUDA block, and a remainder).
TEST(SimLinear, RowsDoNotDependOnTheBatch) {
  std::mt19937 gen(35);
  for (WeightFormat f : {WeightFormat::kQ4_0, WeightFormat::kQ6_K, WeightFormat::kInt4, WeightFormat::kFp8,
                         WeightFormat::kDense})
    for (DType dtype : sim_test::kFloatDTypes) {
      SCOPED_TRACE(name(f, dtype));
      const int64_t n = 10, k = 1536, batch = 11;
      const Weight quantized(f == WeightFormat::kDense ? WeightFormat::kInt8 : f, n, k, gen);
      const Tensor dense = sim_test::randn({n, k}, dtype, gen), x = sim_test::randn({batch, k}, dtype, gen);
      auto run = [&](int64_t m, Tensor& out) {
        Tensor rows({m, k}, dtype);
        std::memcpy(rows.data(), x.data(), static_cast<size_t>(m * k) * octavo::dtype_size(dtype));
        if (f == WeightFormat::kDense) octavo::linear(out.cuda(), rows.cuda(), dense.cuda(), nullptr);
        else run_linear(out, rows, quantized, nullptr, true);
      };
      Tensor all({batch, n}, dtype);
      run(batch, all);
      for (int64_t m : {1, 2, 3, 4, 5}) {
        Tensor some({m, n}, dtype);
        run(m, some);
        EXPECT_EQ(std::memcmp(some.data(), all.data(), static_cast<size_t>(m * n) * octavo::dtype_size(dtype)), 0)
            << "first " << m << " rows";
      }
    }
}

// Rows of a wider buffer, as a view of a fused projection's output gives.
TEST(SimLinear, TakesStridedInputAndOutput) {
  std::mt19937 gen(36);
  const int64_t m = 5, n = 12, k = 96, in_stride = k + 8, out_stride = n + 3;
  const Weight w(WeightFormat::kQ4_1, n, k, gen);
  const Tensor x = sim_test::randn({m, in_stride}, DType::kBFloat16, gen);
  Tensor cpu({m, out_stride}, DType::kBFloat16), gpu({m, out_stride}, DType::kBFloat16);
  auto rows = [](const Tensor& t, int64_t cols, bool cuda) {
    TensorView v = cuda ? t.cuda() : t.cpu();
    v.shape[1] = cols;
    return v;
  };
  for (bool cuda : {false, true}) {
    Weight::Views v = w.on(cuda);
    octavo::linear(rows(cuda ? gpu : cpu, n, cuda), rows(x, k, cuda), v.data, nullptr, w.format);
  }
  sim_test::expect_matches_cpu(gpu, cpu);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = n; c < out_stride; ++c) ASSERT_EQ(gpu.get(r * out_stride + c), 0.0f) << "the gap is untouched";
}

// linear with tensor_cores (linear_mma.cu) on the GPU, or the CPU's dense kernel on the weights
// dequantize writes in x's dtype: the product the tensor-core kernel must give.
void run_on_tensor_cores(Tensor& out, const Tensor& x, const Weight& w, const Tensor* bias) {
  const Weight::Views v = w.on(true);
  octavo::WeightQuant quant = v.quant();
  quant.tensor_cores = true;
  const TensorView b = bias ? bias->cuda() : TensorView{};
  octavo::linear(out.cuda(), x.cuda(), v.data, bias ? &b : nullptr, w.format, quant);
}
void run_on_dequantized(Tensor& out, const Tensor& x, const Weight& w, const Tensor* bias) {
  const int64_t n = out.shape()[1], k = x.shape()[1];
  Tensor weights({n, k}, x.dtype());
  run_dequantize(weights, w, false);
  const TensorView b = bias ? bias->cpu() : TensorView{};
  octavo::linear(out.cpu(), x.cpu(), weights.cpu(), bias ? &b : nullptr);
}

const DType kMmaDTypes[] = {DType::kBFloat16, DType::kFloat16};

// Every format, row counts below, at and past one 16-row tile, output features past a tile of 8,
// and K in whole runs of the warps' blocks (1536 = 3 runs of 16), a remainder (576 = 16 + 2) and
// less than a run (32, 96).
TEST(SimLinear, TensorCoresGiveTheProductOfTheDequantizedWeights) {
  std::mt19937 gen(38);
  const std::vector<std::array<int64_t, 3>> cases = {{1, 1, 32},  {2, 7, 96},   {5, 9, 576},
                                                     {16, 8, 1536}, {17, 33, 576}, {33, 12, 256}};
  for (WeightFormat f : kQuantized)
    for (DType dtype : kMmaDTypes)
      for (auto [m, n, k32] : cases) {
        const bool with_bias = m % 2 == 1;
        const int64_t k = sim_test::whole_blocks(f, k32);
        SCOPED_TRACE(name(f, dtype) + " m,n,k " + std::to_string(m) + "," + std::to_string(n) + "," +
                     std::to_string(k) + (with_bias ? " bias" : ""));
        const Weight w(f, n, k, gen);
        const Tensor x = sim_test::randn({m, k}, dtype, gen), bias = sim_test::randn({n}, dtype, gen);
        Tensor expected({m, n}, dtype), gpu({m, n}, dtype);
        run_on_dequantized(expected, x, w, with_bias ? &bias : nullptr);
        run_on_tensor_cores(gpu, x, w, with_bias ? &bias : nullptr);
        sim_test::expect_matches_cpu(gpu, expected);
      }
}

TEST(SimLinear, TensorCoresTakeDenseWeights) {
  std::mt19937 gen(39);
  for (DType dtype : kMmaDTypes) {
    SCOPED_TRACE(octavo::dtype_name(dtype));
    const int64_t m = 11, n = 20, k = 640;
    const Tensor x = sim_test::randn({m, k}, dtype, gen), w = sim_test::randn({n, k}, dtype, gen);
    Tensor cpu({m, n}, dtype), gpu({m, n}, dtype);
    octavo::linear(cpu.cpu(), x.cpu(), w.cpu(), nullptr);
    octavo::WeightQuant quant;
    quant.tensor_cores = true;
    octavo::linear(gpu.cuda(), x.cuda(), w.cuda(), nullptr, WeightFormat::kDense, quant);
    sim_test::expect_matches_cpu(gpu, cpu);
  }
}

// A row's output is the same bits whatever the batch: alone, in part of one 16-row tile, in a
// whole one, and in the second tile of a batch.
TEST(SimLinear, TensorCoreRowsDoNotDependOnTheBatch) {
  std::mt19937 gen(40);
  for (WeightFormat f : {WeightFormat::kQ4_K, WeightFormat::kInt4, WeightFormat::kFp8})
    for (DType dtype : kMmaDTypes) {
      SCOPED_TRACE(name(f, dtype));
      const int64_t n = 10, k = 1024, batch = 21;
      const Weight w(f, n, k, gen);
      const Tensor x = sim_test::randn({batch, k}, dtype, gen);
      auto run = [&](int64_t first, int64_t m, Tensor& out) {
        Tensor rows({m, k}, dtype);
        const size_t row_bytes = static_cast<size_t>(k) * octavo::dtype_size(dtype);
        std::memcpy(rows.data(), static_cast<const char*>(x.data()) + first * row_bytes, m * row_bytes);
        run_on_tensor_cores(out, rows, w, nullptr);
      };
      Tensor all({batch, n}, dtype);
      run(0, batch, all);
      const size_t out_row = static_cast<size_t>(n) * octavo::dtype_size(dtype);
      for (auto [first, m] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {0, 5}, {0, 16}, {16, 5}, {19, 1}}) {
        Tensor some({m, n}, dtype);
        run(first, m, some);
        EXPECT_EQ(std::memcmp(some.data(), static_cast<const char*>(all.data()) + first * out_row, m * out_row), 0)
            << "rows " << first << ".." << first + m - 1;
      }
    }
}

TEST(SimLinear, TensorCoresRefuseWhatTheyCannotTake) {
  std::mt19937 gen(41);
  const Weight w(WeightFormat::kInt4, 3, 64, gen);
  const Weight::Views on_gpu = w.on(true), on_cpu = w.on(false);
  octavo::WeightQuant gpu_quant = on_gpu.quant(), cpu_quant = on_cpu.quant();
  gpu_quant.tensor_cores = cpu_quant.tensor_cores = true;
  const Tensor floats = sim_test::randn({2, 64}, DType::kFloat32, gen);
  Tensor out({2, 3}, DType::kFloat32);
  expect_refusal([&] { octavo::linear(out.cuda(), floats.cuda(), on_gpu.data, nullptr, w.format, gpu_quant); },
                 "bfloat16 or float16 inputs, got float32");
  const Tensor halves = sim_test::randn({2, 64}, DType::kFloat16, gen);
  Tensor half_out({2, 3}, DType::kFloat16);
  expect_refusal([&] { octavo::linear(half_out.cpu(), halves.cpu(), on_cpu.data, nullptr, w.format, cpu_quant); },
                 "tensor_cores (linear on tensor cores) is for CUDA only");
  // Rows 68 elements apart: at 4-element boundaries (the GEMV's loads), not at 16-byte ones.
  const Tensor wide = sim_test::randn({2, 68}, DType::kFloat16, gen);
  TensorView rows = wide.cuda();
  rows.shape[1] = 64;
  expect_refusal([&] { octavo::linear(half_out.cuda(), rows, on_gpu.data, nullptr, w.format, gpu_quant); },
                 "input rows must start at 16-byte boundaries");
  octavo::linear(half_out.cuda(), rows, on_gpu.data, nullptr, w.format, on_gpu.quant());
}

TEST(SimLinear, WhatCudaCannotReadIsRefusedByName) {
  std::mt19937 gen(37);
  const Tensor x = sim_test::randn({2, 100}, DType::kFloat32, gen), w = sim_test::randn({3, 100}, DType::kFloat32, gen);
  Tensor out({2, 3}, DType::kFloat32);
  expect_refusal([&] { octavo::linear(out.cuda(), x.cuda(), w.cuda(), nullptr); }, "in_features 100");
  // An input row starting off a 4-element boundary (a view one element into a buffer).
  const Tensor wide = sim_test::randn({2, 65}, DType::kFloat32, gen);
  const Tensor w64 = sim_test::randn({3, 64}, DType::kFloat32, gen);
  TensorView shifted = wide.cuda();
  shifted.data = static_cast<float*>(shifted.data) + 1;
  shifted.shape[1] = 64;
  expect_refusal([&] { octavo::linear(out.cuda(), shifted, w64.cuda(), nullptr); }, "4-element boundaries");
  expect_refusal([&] { octavo::linear(out.cuda(), x.cuda(), w.cpu(), nullptr); }, "argument 'weight'");
  const Weight q(WeightFormat::kInt8, 3, 64, gen);
  Tensor floats({3, 64}, DType::kFloat32);
  const TensorView cpu_scales = q.scales.cpu();
  expect_refusal([&] { octavo::dequantize(floats.cuda(), q.data.cuda(), q.format, {&cpu_scales}); },
                 "argument 'scales'");
  // int4_a8 multiplies int8-rounded inputs on the CPU only; CUDA reads its weights as int4.
  const Weight a8(WeightFormat::kInt4A8, 3, 64, gen);
  const Weight::Views on_gpu = a8.on(true), on_cpu = a8.on(false);
  const Tensor x64 = sim_test::randn({2, 64}, DType::kFloat32, gen);
  expect_refusal([&] { octavo::linear(out.cuda(), x64.cuda(), on_gpu.data, nullptr, a8.format, on_gpu.quant()); },
                 "int4_a8 (int8 inputs) is for the CPU only");
  Tensor from_gpu({3, 64}, DType::kFloat32), from_cpu({3, 64}, DType::kFloat32);
  octavo::dequantize(from_gpu.cuda(), on_gpu.data, a8.format, on_gpu.quant());
  octavo::dequantize(from_cpu.cpu(), on_cpu.data, a8.format, on_cpu.quant());
  EXPECT_TRUE(from_gpu.same_bytes(from_cpu));
}

}  // namespace
