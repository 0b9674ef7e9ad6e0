// rms_norm, fused_add_rms_norm, the gated activations, rotary_embedding and reshape_and_cache:
// the CUDA kernels run by the simulator against the CPU kernels on the same inputs, with
// test_cuda_ops.py's case list (which a GPU runs on the real device).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "sim_test_util.h"

namespace {

using octavo::GeluApproximation;
using sim_test::DType;
using sim_test::Tensor;
using sim_test::TensorView;

std::string name(DType dtype) { return octavo::dtype_name(dtype); }

// Rows [rows, cols] of a buffer whose rows are `stride` elements apart.
TensorView rows_of(const Tensor& base, int64_t rows, int64_t cols, int64_t stride, octavo::DeviceType device) {
  TensorView t = base.view(device);
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = stride;
  t.strides[1] = 1;
  return t;
}

Tensor uniform_weight(int64_t n, DType dtype, std::mt19937& gen) {
  Tensor w({n}, dtype);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  for (int64_t i = 0; i < n; ++i) w.set(i, u(gen));
  return w;
}

TEST(SimElementwise, RmsNorm) {
  std::mt19937 gen(1234);
  for (DType dtype : sim_test::kFloatDTypes)
    for (auto [rows, hidden] : std::vector<std::pair<int64_t, int64_t>>{{1, 17}, {5, 4095}, {64, 1024}, {3, 576}, {2, 8192}})
      for (bool weight_offset : {false, true}) {
        SCOPED_TRACE(name(dtype) + " " + std::to_string(rows) + "x" + std::to_string(hidden));
        const Tensor x = sim_test::randn({rows, hidden}, dtype, gen, 2.0), w = uniform_weight(hidden, dtype, gen);
        Tensor cpu(x.shape(), dtype), gpu(x.shape(), dtype);
        octavo::rms_norm(cpu.cpu(), x.cpu(), w.cpu(), 1e-6, weight_offset);
        octavo::rms_norm(gpu.cuda(), x.cuda(), w.cuda(), 1e-6, weight_offset);
        sim_test::expect_matches_cpu(gpu, cpu);
      }
}

// A row stride wider than the row (a view into a larger buffer, as the fused QKV output gives).
TEST(SimElementwise, FusedAddRmsNormOnStridedRows) {
  std::mt19937 gen(7);
  for (DType dtype : sim_test::kFloatDTypes)
    for (int64_t hidden : {64, 4096, 100}) {
      SCOPED_TRACE(name(dtype) + " hidden " + std::to_string(hidden));
      const int64_t rows = 9, stride = hidden + 8;
      Tensor cpu_base = sim_test::randn({rows, stride}, dtype, gen), gpu_base = cpu_base;
      Tensor cpu_residual = sim_test::randn({rows, hidden}, dtype, gen), gpu_residual = cpu_residual;
      const Tensor w = uniform_weight(hidden, dtype, gen);
      octavo::fused_add_rms_norm(rows_of(cpu_base, rows, hidden, stride, octavo::DeviceType::kCPU), cpu_residual.cpu(),
                                 w.cpu(), 1e-5);
      octavo::fused_add_rms_norm(rows_of(gpu_base, rows, hidden, stride, octavo::DeviceType::kCUDA),
                                 gpu_residual.cuda(), w.cuda(), 1e-5);
      EXPECT_TRUE(gpu_residual.same_bytes(cpu_residual)) << "one rounding of the same sum";
      sim_test::expect_matches_cpu(gpu_base, cpu_base);
      for (int64_t r = 0; r < rows; ++r)  // the gap between rows is untouched
        for (int64_t c = hidden; c < stride; ++c) ASSERT_EQ(gpu_base.get(r * stride + c), cpu_base.get(r * stride + c));
    }
}

// q's heads inside a fused QKV output [tokens, heads, head_size]: tokens `stride` apart, wider
// than their heads (rms_norm reads the rows in groups of heads).
TEST(SimElementwise, RmsNormOverHeadsOfStridedTokens) {
  std::mt19937 gen(11);
  for (DType dtype : sim_test::kFloatDTypes)
    for (auto [tokens, heads, size] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{5, 4, 64}, {3, 9, 100}}) {
      SCOPED_TRACE(name(dtype) + " " + std::to_string(tokens) + "x" + std::to_string(heads));
      const int64_t stride = heads * size + 3 * size;
      const Tensor base = sim_test::randn({tokens, stride}, dtype, gen, 2.0), w = uniform_weight(size, dtype, gen);
      Tensor cpu({tokens, heads, size}, dtype), gpu({tokens, heads, size}, dtype);
      const auto heads_of = [&](octavo::DeviceType device) {
        TensorView t = base.view(device);
        t.ndim = 3;
        t.shape[0] = tokens, t.shape[1] = heads, t.shape[2] = size;
        t.strides[0] = stride, t.strides[1] = size, t.strides[2] = 1;
        return t;
      };
      octavo::rms_norm(cpu.cpu(), heads_of(octavo::DeviceType::kCPU), w.cpu(), 1e-6, true);
      octavo::rms_norm(gpu.cuda(), heads_of(octavo::DeviceType::kCUDA), w.cuda(), 1e-6, true);
      sim_test::expect_matches_cpu(gpu, cpu);
      // Each head against the same head normalized on its own.
      Tensor one({1, size}, dtype);
      const TensorView head = rows_of(base, 1, size, stride, octavo::DeviceType::kCPU);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          TensorView at = head;
          at.data = static_cast<char*>(head.data) + (t * stride + h * size) * octavo::dtype_size(dtype);
          octavo::rms_norm(one.cpu(), at, w.cpu(), 1e-6, true);
          for (int64_t c = 0; c < size; ++c) ASSERT_EQ(cpu.get((t * heads + h) * size + c), one.get(c));
        }
    }
}

TEST(SimElementwise, GatedActivations) {
  std::mt19937 gen(99);
  for (DType dtype : sim_test::kFloatDTypes)
    for (auto [rows, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 64}, {9, 1536}, {4, 13}, {300, 8}})
      for (const char* op : {"silu", "gelu_none", "gelu_tanh"}) {
        SCOPED_TRACE(name(dtype) + " " + op + " " + std::to_string(rows) + "x" + std::to_string(d));
        const Tensor x = sim_test::randn({rows, 2 * d}, dtype, gen, 3.0);
        Tensor cpu({rows, d}, dtype), gpu({rows, d}, dtype);
        const std::string which = op;
        if (which == "silu") {
          octavo::silu_and_mul(cpu.cpu(), x.cpu());
          octavo::silu_and_mul(gpu.cuda(), x.cuda());
        } else {
          const auto approximate = which == "gelu_tanh" ? GeluApproximation::kTanh : GeluApproximation::kNone;
          octavo::gelu_and_mul(cpu.cpu(), x.cpu(), approximate);
          octavo::gelu_and_mul(gpu.cuda(), x.cuda(), approximate);
        }
        sim_test::expect_matches_cpu(gpu, cpu);
      }
}

// [max_position, rot_dim]: cos of each position's angles, then their sin.
Tensor cos_sin_cache(int64_t max_position, int64_t rot_dim) {
  Tensor cache({max_position, rot_dim}, DType::kFloat32);
  for (int64_t p = 0; p < max_position; ++p)
    for (int64_t i = 0; i < rot_dim / 2; ++i) {
      const double angle = static_cast<double>(p) / std::pow(10000.0, 2.0 * static_cast<double>(i) / rot_dim);
      cache.set(p * rot_dim + i, std::cos(angle));
      cache.set(p * rot_dim + rot_dim / 2 + i, std::sin(angle));
    }
  return cache;
}

// The packed kernel where heads and halves are whole 16-byte packs, the one-pair kernel where
// not: (80, 40) in 16 bits, and a query whose rows are one element wider than its heads.
TEST(SimElementwise, RotaryEmbedding) {
  std::mt19937 gen(5);
  const int64_t tokens = 7, heads = 8, kv_heads = 2;
  const std::vector<std::pair<int64_t, int64_t>> dims{{64, 64}, {128, 128}, {128, 64}, {256, 256}, {64, 32}, {80, 40}};
  for (DType dtype : sim_test::kFloatDTypes)
    for (DType index : {DType::kInt32, DType::kInt64})
      for (auto [head_size, rot_dim] : dims)
        for (bool is_neox : {true, false})
          for (int64_t pad : {0, 1}) {
            SCOPED_TRACE(name(dtype) + " " + name(index) + " head_size " + std::to_string(head_size) + " rot_dim " +
                         std::to_string(rot_dim) + (is_neox ? " neox" : " gptj") + " pad " + std::to_string(pad));
            Tensor positions({tokens}, index);
            for (int64_t t = 0; t < tokens; ++t) positions.set(t, static_cast<double>(gen() % 4096));
            const int64_t stride = heads * head_size + pad;
            Tensor cpu_q = sim_test::randn({tokens, stride}, dtype, gen), gpu_q = cpu_q;
            Tensor cpu_k = sim_test::randn({tokens, kv_heads, head_size}, dtype, gen), gpu_k = cpu_k;
            const Tensor cache = cos_sin_cache(4096, rot_dim);
            const TensorView ck = cpu_k.cpu(), gk = gpu_k.cuda();
            octavo::rotary_embedding(positions.cpu(), rows_of(cpu_q, tokens, heads * head_size, stride, octavo::DeviceType::kCPU),
                                     &ck, head_size, cache.cpu(), is_neox);
            octavo::rotary_embedding(positions.cuda(),
                                     rows_of(gpu_q, tokens, heads * head_size, stride, octavo::DeviceType::kCUDA), &gk,
                                     head_size, cache.cuda(), is_neox);
            sim_test::expect_matches_cpu(gpu_q, cpu_q);  // the pad column too: untouched on both
            sim_test::expect_matches_cpu(gpu_k, cpu_k);
          }
}

// On the device nothing reads positions on the host, so the kernel itself leaves a token with a
// position outside the cache untouched.
TEST(SimElementwise, RotaryEmbeddingSkipsPositionsOutsideTheCache) {
  std::mt19937 gen(6);
  Tensor q = sim_test::randn({3, 64}, DType::kFloat32, gen);
  const Tensor before = q;
  Tensor positions({3}, DType::kInt64);
  positions.set(0, 5), positions.set(1, 100), positions.set(2, -1);
  octavo::rotary_embedding(positions.cuda(), q.cuda(), nullptr, 64, cos_sin_cache(16, 64).cuda(), true);
  bool first_rotated = false;
  for (int i = 0; i < 64; ++i) first_rotated |= q.get(i) != before.get(i);
  EXPECT_TRUE(first_rotated);
  for (int i = 64; i < 3 * 64; ++i) ASSERT_EQ(q.get(i), before.get(i)) << i;
}

TEST(SimElementwise, ReshapeAndCacheWritesTheSameSlots) {
  std::mt19937 gen(11);
  const int64_t num_blocks = 6, kv_heads = 4, block_size = 16, tokens = 20;
  for (DType dtype : sim_test::kFloatDTypes)
    for (int64_t head_size : {64, 128, 256, 12}) {
      SCOPED_TRACE(name(dtype) + " head_size " + std::to_string(head_size));
      const Tensor key = sim_test::randn({tokens, kv_heads, head_size}, dtype, gen);
      const Tensor value = sim_test::randn({tokens, kv_heads, head_size}, dtype, gen);
      std::vector<int64_t> order(num_blocks * block_size);
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      std::shuffle(order.begin(), order.end(), gen);
      Tensor slots({tokens}, DType::kInt64);
      for (int64_t t = 0; t < tokens; ++t) slots.set(t, static_cast<double>(order[t]));
      slots.set(3, -1);  // skipped
      const std::vector<int64_t> shape = {num_blocks, kv_heads, block_size, head_size};
      Tensor cpu_k(shape, dtype), cpu_v(shape, dtype), gpu_k(shape, dtype), gpu_v(shape, dtype);
      octavo::reshape_and_cache(key.cpu(), value.cpu(), cpu_k.cpu(), cpu_v.cpu(), slots.cpu());
      octavo::reshape_and_cache(key.cuda(), value.cuda(), gpu_k.cuda(), gpu_v.cuda(), slots.cuda());
      EXPECT_TRUE(gpu_k.same_bytes(cpu_k));
      EXPECT_TRUE(gpu_v.same_bytes(cpu_v));
      double written = 0;
      for (float v : cpu_k.floats()) written += std::fabs(v);
      EXPECT_GT(written, 0);
    }
}

// An fp8 cache (kv_cache_dtype="fp8") holds value / scale in E4M3: the CUDA kernel writes the
// bytes the CPU kernel writes, saturated values (|x| / scale past 448) and subnormals included, in
// packs of 16 (head size 64) and one value at a time (40, not whole packs).
TEST(SimElementwise, ReshapeAndCacheWritesTheSameFp8Bytes) {
  std::mt19937 gen(13);
  const int64_t num_blocks = 3, kv_heads = 2, block_size = 16, tokens = 9;
  for (int64_t head_size : {64, 40})
  for (DType dtype : sim_test::kFloatDTypes) {
    SCOPED_TRACE(name(dtype) + " head size " + std::to_string(head_size));
    const Tensor key = sim_test::randn({tokens, kv_heads, head_size}, dtype, gen, 30.0);
    const Tensor value = sim_test::randn({tokens, kv_heads, head_size}, dtype, gen, 0.01);
    Tensor slots({tokens}, DType::kInt32);
    for (int64_t t = 0; t < tokens; ++t) slots.set(t, static_cast<double>(5 * t));
    const std::vector<int64_t> shape = {num_blocks, kv_heads, block_size, head_size};
    Tensor cpu_k(shape, DType::kFloat8E4M3), cpu_v(shape, DType::kFloat8E4M3);
    Tensor gpu_k(shape, DType::kFloat8E4M3), gpu_v(shape, DType::kFloat8E4M3);
    octavo::reshape_and_cache(key.cpu(), value.cpu(), cpu_k.cpu(), cpu_v.cpu(), slots.cpu(), 0.05, 2.0);
    octavo::reshape_and_cache(key.cuda(), value.cuda(), gpu_k.cuda(), gpu_v.cuda(), slots.cuda(), 0.05, 2.0);
    EXPECT_TRUE(gpu_k.same_bytes(cpu_k));
    EXPECT_TRUE(gpu_v.same_bytes(cpu_v));
    const auto* k_bytes = static_cast<const uint8_t*>(cpu_k.data());
    const auto* v_bytes = static_cast<const uint8_t*>(cpu_v.data());
    int saturated = 0, subnormal = 0;
    for (int64_t i = 0; i < cpu_k.numel(); ++i) {
      saturated += (k_bytes[i] & 0x7f) == 0x7e;  // |key| / 0.05 >= 448 (keys: sigma 30)
      subnormal += v_bytes[i] != 0 && (v_bytes[i] & 0x78) == 0;  // |value| / 2 < 2^-6
    }
    EXPECT_GT(saturated, 0);
    EXPECT_GT(subnormal, 0);
  }
}

TEST(SimElementwise, ReshapeAndCacheSkipsSlotsOutsideTheCache) {
  std::mt19937 gen(12);
  const Tensor key = sim_test::randn({2, 1, 8}, DType::kFloat32, gen);
  Tensor k_cache({1, 1, 4, 8}, DType::kFloat32), v_cache({1, 1, 4, 8}, DType::kFloat32);
  Tensor slots({2}, DType::kInt32);
  slots.set(0, 1), slots.set(1, 4);  // slot 4 is past the one block of 4
  octavo::reshape_and_cache(key.cuda(), key.cuda(), k_cache.cuda(), v_cache.cuda(), slots.cuda());
  for (int i = 0; i < 32; ++i) ASSERT_EQ(k_cache.get(i), i >= 8 && i < 16 ? key.get(i - 8) : 0.0f) << i;
}

}  // namespace
