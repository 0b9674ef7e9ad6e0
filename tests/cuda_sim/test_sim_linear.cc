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
