// apply_token_bitmask's CUDA kernel (csrc/kernels/cuda/token_bitmask.cu) run by the simulator,
// through the public op with CUDA views, against the CPU kernel on the same logits and masks:
// every word kind (clear, set, mixed), a partial last word, index lists, and indices outside
// the batch, which the CUDA kernel skips.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "octavo/ops.h"
#include "sim_test_util.h"

namespace {

using sim_test::DType;
using sim_test::Tensor;

// Words of every kind: every 5th clear, every 5th (from the 2nd) all set, the rest random.
Tensor random_mask(int64_t rows, int64_t vocab, std::mt19937& gen) {
  const int64_t words = (vocab + 31) / 32;
  Tensor mask({rows, words}, DType::kInt32);
  int32_t* m = mask.as<int32_t>();
  for (int64_t i = 0; i < rows * words; ++i) {
    m[i] = i % 5 == 0 ? 0 : i % 5 == 1 ? -1 : static_cast<int32_t>(gen());
  }
  return mask;
}

Tensor indices_of(const std::vector<int32_t>& rows) {
  Tensor t({static_cast<int64_t>(rows.size())}, DType::kInt32);
  for (size_t i = 0; i < rows.size(); ++i) t.as<int32_t>()[i] = rows[i];
  return t;
}

TEST(SimTokenBitmask, MatchesTheCpuKernel) {
  std::mt19937 gen(5);
  for (int64_t vocab : {1, 31, 32, 33, 1000, 49152}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const Tensor x = sim_test::randn({4, vocab}, DType::kFloat32, gen), mask = random_mask(4, vocab, gen);
    Tensor cpu = x, gpu = x;
    octavo::apply_token_bitmask(cpu.cpu(), mask.cpu(), nullptr);
    octavo::apply_token_bitmask(gpu.cuda(), mask.cuda(), nullptr);
    EXPECT_TRUE(gpu.same_bytes(cpu));
    EXPECT_FALSE(cpu.same_bytes(x));
  }
}

TEST(SimTokenBitmask, IndexListsMaskOnlyTheirRows) {
  std::mt19937 gen(9);
  const int64_t vocab = 333;
  const Tensor x = sim_test::randn({5, vocab}, DType::kFloat32, gen), mask = random_mask(2, vocab, gen);
  const Tensor indices = indices_of({3, 1});
  Tensor cpu = x, gpu = x;
  const octavo::TensorView cpu_indices = indices.cpu(), gpu_indices = indices.cuda();
  octavo::apply_token_bitmask(cpu.cpu(), mask.cpu(), &cpu_indices);
  octavo::apply_token_bitmask(gpu.cuda(), mask.cuda(), &gpu_indices);
  EXPECT_TRUE(gpu.same_bytes(cpu));
  for (int64_t r : {0, 2, 4})
    for (int64_t t = 0; t < vocab; ++t) EXPECT_EQ(cpu.get(r * vocab + t), x.get(r * vocab + t));
}

TEST(SimTokenBitmask, RowsOutsideTheBatchAreSkippedOnCuda) {
  std::mt19937 gen(2);
  const int64_t vocab = 64;
  const Tensor x = sim_test::randn({2, vocab}, DType::kFloat32, gen), mask = random_mask(3, vocab, gen);
  const Tensor indices = indices_of({-1, 1, 2});
  Tensor gpu = x;
  const octavo::TensorView gpu_indices = indices.cuda();
  octavo::apply_token_bitmask(gpu.cuda(), mask.cuda(), &gpu_indices);
  for (int64_t t = 0; t < vocab; ++t) EXPECT_EQ(gpu.get(t), x.get(t)) << "row 0 is in no index";
  const bool allowed = (static_cast<uint32_t>(static_cast<const int32_t*>(mask.data())[2]) >> 5) & 1u;  // row 1 = mask row 1, token 5
  EXPECT_EQ(gpu.get(vocab + 5), allowed ? x.get(vocab + 5) : -INFINITY);
  sim_test::expect_refusal([&] {
    const octavo::TensorView cpu_indices = indices.cpu();
    Tensor cpu = x;
    octavo::apply_token_bitmask(cpu.cpu(), mask.cpu(), &cpu_indices);
  }, "is not a row of 'logits'");
}

}  // namespace
