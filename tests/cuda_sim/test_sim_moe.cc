// topk_softmax, moe_align and fused_moe: the CUDA kernels run by the simulator. The router and the
// grouping must give the CPU kernels' ids exactly; fused_moe's outputs are checked against a
// float64 reference on the dequantized weights (the CUDA kernel keeps its intermediates in
// float32, so a 16-bit result is the exact one rounded once) and against the CPU in float32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "sim_test_util.h"

namespace {

using octavo::WeightFormat;
using sim_test::DType;
using sim_test::Tensor;
using sim_test::TensorView;
using sim_test::Weight;

// A stack of E experts of n rows for k inputs each: dense (in `dtype`) or quantized, the tensors
// 2-D as Octavo stacks them, viewed [E, n, ...] for the op.
struct Experts {
  WeightFormat format;
  int64_t E, n, k;
  Tensor dense;
  std::optional<Weight> quantized;

  Experts(WeightFormat f, int64_t E_, int64_t n_, int64_t k_, DType dtype, std::mt19937& gen)
      : format(f), E(E_), n(n_), k(k_) {
    if (f == WeightFormat::kDense) dense = sim_test::randn({E * n, k}, dtype, gen, 0.2);
    else quantized.emplace(f, E * n, k, gen);
  }

  // The weights as float32 [E * n, k], as the kernels decode them.
  Tensor floats() const {
    Tensor out({E * n, k}, DType::kFloat32);
    if (quantized) {
      const Weight::Views v = quantized->on(false);
      octavo::dequantize(out.cpu(), v.data, format, v.quant());
    } else {
      for (int64_t i = 0; i < out.numel(); ++i) out.set(i, dense.get(i));
    }
    return out;
  }

  // The views of one device; args() points into them, so they must outlive its use.
  struct Views {
    TensorView weight, scales, zeros;
    WeightFormat format;
    int64_t group_size;
    octavo::ExpertWeights args() const {
      return {&weight, format, {scales.data ? &scales : nullptr, zeros.data ? &zeros : nullptr, group_size}};
    }
  };
  Views on(bool cuda) const {
    if (!quantized) return {stacked(cuda ? dense.cuda() : dense.cpu()), {}, {}, format, 0};
    const Weight::Views v = quantized->on(cuda);
    return {stacked(v.data), stacked(v.scales), stacked(v.zeros), format, v.group_size};
  }

  // A contiguous [E * n, ...] view as [E, n, ...].
  TensorView stacked(TensorView v) const {
    if (v.data == nullptr) return v;
    for (int d = v.ndim; d > 0; --d) v.shape[d] = v.shape[d - 1];
    v.shape[0] = E;
    v.shape[1] /= E;
    ++v.ndim;
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) v.strides[d] = stride, stride *= v.shape[d];
    return v;
  }
};

// Routing of T tokens over E experts, k each: distinct experts per token with random weights,
// slot order random; ids of -1 where `missing` says (an expert on another rank), token 1 (if
// there is one) routed nowhere.
struct Routing {
  Tensor weights, ids;
  Routing(int64_t T, int64_t E, int64_t k, std::mt19937& gen, double missing = 0.15) : weights({T, k}, DType::kFloat32),
                                                                                        ids({T, k}, DType::kInt32) {
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    std::vector<int32_t> experts(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) experts[static_cast<size_t>(e)] = static_cast<int32_t>(e);
      std::shuffle(experts.begin(), experts.end(), gen);
      for (int64_t s = 0; s < k; ++s) {
        const bool none = t == 1 || unit(gen) < missing;
        ids.as<int32_t>()[t * k + s] = none ? -1 : experts[static_cast<size_t>(s)];
        weights.set(t * k + s, unit(gen));
      }
    }
  }
};

void run_fused_moe(Tensor& out, const Tensor& x, const Experts& w13, const Experts& w2, const Routing& r, bool cuda) {
  const Experts::Views a = w13.on(cuda), b = w2.on(cuda);
  octavo::fused_moe(cuda ? out.cuda() : out.cpu(), cuda ? x.cuda() : x.cpu(), a.args(), b.args(),
                    cuda ? r.weights.cuda() : r.weights.cpu(), cuda ? r.ids.cuda() : r.ids.cpu());
}

// `v` rounded to dtype (nearest even).
double rounded(double v, DType dtype) {
  Tensor t({1}, dtype);
  t.set(0, v);
  return t.get(0);
}

// out[t] = sum over t's experts e of weight * down_e(silu(gate_e(x)) * up_e(x)), in float64;
// with `tiles`, the weights and the activation rounded to it, as the tensor-core path has them.
std::vector<double> reference(const Tensor& x, const Experts& w13, const Experts& w2, const Routing& r,
                              DType tiles = DType::kFloat64) {
  const int64_t T = x.shape()[0], H = x.shape()[1], I = w2.k, k = r.ids.shape()[1];
  Tensor a = w13.floats(), b = w2.floats();
  for (Tensor* w : {&a, &b})
    for (int64_t i = 0; tiles != DType::kFloat64 && i < w->numel(); ++i) w->set(i, rounded(w->get(i), tiles));
  std::vector<double> out(static_cast<size_t>(T * H), 0.0), act(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const auto e = static_cast<int32_t>(r.ids.get(t * k + s));
      if (e < 0) continue;
      for (int64_t j = 0; j < I; ++j) {
        double gate = 0, up = 0;
        for (int64_t h = 0; h < H; ++h) {
          gate += static_cast<double>(x.get(t * H + h)) * a.get((e * 2 * I + j) * H + h);
          up += static_cast<double>(x.get(t * H + h)) * a.get((e * 2 * I + I + j) * H + h);
        }
        act[static_cast<size_t>(j)] = gate / (1.0 + std::exp(-gate)) * up;
        if (tiles != DType::kFloat64) act[static_cast<size_t>(j)] = rounded(act[static_cast<size_t>(j)], tiles);
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t j = 0; j < I; ++j) y += act[static_cast<size_t>(j)] * b.get((e * H + h) * I + j);
        out[static_cast<size_t>(t * H + h)] += r.weights.get(t * k + s) * y;
      }
    }
  return out;
}

// Within one rounding of the dtype of each value, plus `relative` of the largest (by default
// float32's rounding).
void expect_near_reference(const Tensor& got, const std::vector<double>& want, double relative = std::ldexp(1.0, -16)) {
  double largest = 0;
  for (double v : want) largest = std::max(largest, std::fabs(v));
  const double u = sim_test::ulp(got.dtype());
  int failures = 0;
  for (size_t i = 0; i < want.size() && failures < 10; ++i) {
    const double tolerance = u * std::fabs(want[i]) + relative * largest;
    if (!(std::fabs(got.get(static_cast<int64_t>(i)) - want[i]) <= tolerance)) {
      ADD_FAILURE() << "element " << i << ": cuda " << got.get(static_cast<int64_t>(i)) << ", reference " << want[i];
      ++failures;
    }
  }
}

std::string name(WeightFormat a, WeightFormat b, DType dtype) {
  return std::string(octavo::weight_format_name(a)) + "/" + octavo::weight_format_name(b) + " " +
         octavo::dtype_name(dtype);
}

TEST(SimMoe, FusedMoeMatchesTheReference) {
  std::mt19937 gen(41);
  struct Case {
    WeightFormat w13, w2;
    DType dtype;
  };
  std::vector<Case> cases;
  for (DType dtype : sim_test::kFloatDTypes) cases.push_back({WeightFormat::kDense, WeightFormat::kDense, dtype});
  for (WeightFormat f : sim_test::kBlocksOf32)
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) cases.push_back({f, f, dtype});
  cases.push_back({WeightFormat::kInt4, WeightFormat::kQ8_0, DType::kFloat16});
  cases.push_back({WeightFormat::kQ4_K, WeightFormat::kQ6_K, DType::kFloat32});  // as a Q4_K_M file mixes them
  const int64_t E = 6, k = 2;
  for (const Case& c : cases) {
    std::vector<std::array<int64_t, 3>> sizes = {{1, 64, 64}, {5, 96, 160}};  // T, H, I
    // 19 tokens give experts several GEMV blocks each; in 16 bits they would take the tensor cores.
    if (c.dtype == DType::kFloat32) sizes.push_back({19, 64, 32});
    if (c.w13 == WeightFormat::kQ4_K) sizes = {{3, 256, 256}};  // whole super-blocks
    // A hidden size past one combine block's columns (kCombineColumns).
    if (c.w13 == WeightFormat::kDense) sizes.push_back({3, 1056, 32});
    for (auto [T, H, I] : sizes) {
      SCOPED_TRACE(name(c.w13, c.w2, c.dtype) + " T,H,I " + std::to_string(T) + "," + std::to_string(H) + "," +
                   std::to_string(I));
      const Experts w13(c.w13, E, 2 * I, H, c.dtype, gen), w2(c.w2, E, H, I, c.dtype, gen);
      const Tensor x = sim_test::randn({T, H}, c.dtype, gen);
      const Routing r(T, E, k, gen);
      Tensor out({T, H}, c.dtype);
      run_fused_moe(out, x, w13, w2, r, true);
      expect_near_reference(out, reference(x, w13, w2, r));
    }
  }
}

// Sum of squared differences from `want` rounded to got's dtype.
double distance(const Tensor& got, const std::vector<double>& want) {
  double sum = 0;
  for (size_t i = 0; i < want.size(); ++i)
    sum += std::pow(got.get(static_cast<int64_t>(i)) - rounded(want[i], got.dtype()), 2);
  return sum;
}

// Batches of 64 pairs or more run on the tensor-core kernels, which multiply
// the weights and the activation as 16-bit values: the result is the reference with those
// roundings (and closer to it than to the unrounded one, so the test knows which kernels ran).
TEST(SimMoe, FusedMoeOnTensorCoresMatchesTheReference) {
  std::mt19937 gen(48);
  const int64_t E = 4, k = 2, T = 40;
  const std::vector<WeightFormat> formats = {WeightFormat::kDense, WeightFormat::kInt4, WeightFormat::kQ8_0,
                                             WeightFormat::kQ4_1, WeightFormat::kInt8, WeightFormat::kQ4_0};
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (WeightFormat f : formats)
      for (auto [H, I] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {96, 160}}) {
        SCOPED_TRACE(name(f, f, dtype) + " H,I " + std::to_string(H) + "," + std::to_string(I));
        const Experts w13(f, E, 2 * I, H, dtype, gen), w2(f, E, H, I, dtype, gen);
        const Tensor x = sim_test::randn({T, H}, dtype, gen, 0.1);  // float16 range for GGUF-sized weights
        const Routing r(T, E, k, gen, 0.05);
        Tensor out({T, H}, dtype);
        run_fused_moe(out, x, w13, w2, r, true);
        const std::vector<double> tiles = reference(x, w13, w2, r, dtype), exact = reference(x, w13, w2, r);
        expect_near_reference(out, tiles, sim_test::ulp(dtype));
        EXPECT_LT(distance(out, tiles), 0.25 * distance(out, exact));
      }
}

// On tensor cores too, a token's rows do not depend on the others in its blocks: the batch in
// another order gives each token the same bits.
TEST(SimMoe, TensorCoreRowsDoNotDependOnTheirBlock) {
  std::mt19937 gen(49);
  const int64_t E = 3, k = 2, T = 37, H = 64, I = 96;
  const DType dtype = DType::kBFloat16;
  const Experts w13(WeightFormat::kQ4_0, E, 2 * I, H, dtype, gen), w2(WeightFormat::kDense, E, H, I, dtype, gen);
  const Tensor x = sim_test::randn({T, H}, dtype, gen);
  const Routing r(T, E, k, gen, 0.0);
  std::vector<int64_t> order(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) order[static_cast<size_t>(t)] = t;
  std::shuffle(order.begin(), order.end(), gen);
  Tensor px({T, H}, dtype);
  Routing pr = r;
  const size_t row = static_cast<size_t>(H) * octavo::dtype_size(dtype);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t from = order[static_cast<size_t>(t)];
    std::memcpy(static_cast<char*>(px.data()) + t * row, static_cast<const char*>(x.data()) + from * row, row);
    for (int64_t s = 0; s < k; ++s) {
      pr.ids.as<int32_t>()[t * k + s] = static_cast<int32_t>(r.ids.get(from * k + s));
      pr.weights.set(t * k + s, r.weights.get(from * k + s));
    }
  }
  Tensor out({T, H}, dtype), permuted({T, H}, dtype);
  run_fused_moe(out, x, w13, w2, r, true);
  run_fused_moe(permuted, px, w13, w2, pr, true);
  for (int64_t t = 0; t < T; ++t)
    EXPECT_EQ(std::memcmp(static_cast<const char*>(permuted.data()) + t * row,
                          static_cast<const char*>(out.data()) + order[static_cast<size_t>(t)] * row, row),
              0)
        << "token " << order[static_cast<size_t>(t)];
}

TEST(SimMoe, FusedMoeMatchesTheCpuInFloat32) {
  std::mt19937 gen(42);
  for (WeightFormat f : {WeightFormat::kDense, WeightFormat::kInt8, WeightFormat::kQ4_1}) {
    SCOPED_TRACE(octavo::weight_format_name(f));
    const int64_t T = 7, H = 128, I = 64, E = 8, k = 3;
    const Experts w13(f, E, 2 * I, H, DType::kFloat32, gen), w2(f, E, H, I, DType::kFloat32, gen);
    const Tensor x = sim_test::randn({T, H}, DType::kFloat32, gen);
    const Routing r(T, E, k, gen);
    Tensor cpu({T, H}, DType::kFloat32), gpu({T, H}, DType::kFloat32);
    run_fused_moe(cpu, x, w13, w2, r, false);
    run_fused_moe(gpu, x, w13, w2, r, true);
    sim_test::expect_matches_cpu(gpu, cpu);
  }
}

// A token's output is the same bits alone as in a batch, where its experts' blocks hold other
// tokens' pairs.
TEST(SimMoe, TokensDoNotDependOnTheBatch) {
  std::mt19937 gen(43);
  // The GEMV path alone and batched, so blocks of 1 to 4 real pairs (with_real_pairs): 26 pairs
  // (int4 experts take the tensor cores from 4 pairs per expert) or 14 (dense ones, from 2).
  for (auto [dtype, f13, T] : {std::tuple{DType::kBFloat16, WeightFormat::kInt4, int64_t{13}},
                               {DType::kFloat32, WeightFormat::kInt4, int64_t{13}},
                               {DType::kBFloat16, WeightFormat::kDense, int64_t{7}}}) {
    const int64_t H = 64, I = 64, E = 8, k = 2;
    const Experts w13(f13, E, 2 * I, H, dtype, gen), w2(WeightFormat::kDense, E, H, I, dtype, gen);
    const Tensor x = sim_test::randn({T, H}, dtype, gen);
    const Routing r(T, E, k, gen, 0.0);
    Tensor all({T, H}, dtype);
    run_fused_moe(all, x, w13, w2, r, true);
    const size_t row = static_cast<size_t>(H) * octavo::dtype_size(dtype);
    for (int64_t t : {int64_t{0}, T / 2, T - 1}) {
      Tensor one_x({1, H}, dtype), one({1, H}, dtype);
      Routing one_r(1, E, k, gen);
      std::memcpy(one_x.data(), static_cast<const char*>(x.data()) + t * row, row);
      std::memcpy(one_r.ids.data(), static_cast<const int32_t*>(r.ids.data()) + t * k, k * sizeof(int32_t));
      std::memcpy(one_r.weights.data(), static_cast<const float*>(r.weights.data()) + t * k, k * sizeof(float));
      run_fused_moe(one, one_x, w13, w2, one_r, true);
      EXPECT_EQ(std::memcmp(one.data(), static_cast<const char*>(all.data()) + t * row, row), 0) << "token " << t;
    }
  }
}

TEST(SimMoe, FusedMoeRefusesWhatCudaCannotRead) {
  std::mt19937 gen(44);
  const int64_t T = 2, H = 48, I = 32, E = 2, k = 1;
  const Experts w13(WeightFormat::kDense, E, 2 * I, H, DType::kFloat32, gen);
  const Experts w2(WeightFormat::kDense, E, H, I, DType::kFloat32, gen);
  const Tensor x = sim_test::randn({T, H}, DType::kFloat32, gen);
  const Routing r(T, E, k, gen);
  Tensor out({T, H}, DType::kFloat32);
  sim_test::expect_refusal([&] { run_fused_moe(out, x, w13, w2, r, true); }, "multiples of 32");
  const Experts a13(WeightFormat::kInt4A8, E, 2 * I, 64, DType::kFloat32, gen), a2(WeightFormat::kInt4A8, E, 64, I,
                                                                                     DType::kFloat32, gen);
  const Tensor x64 = sim_test::randn({T, 64}, DType::kFloat32, gen);
  Tensor out64({T, 64}, DType::kFloat32);
  sim_test::expect_refusal([&] { run_fused_moe(out64, x64, a13, a2, r, true); }, "int4_a8 (int8 inputs) run on the CPU only");
  // The weighted sum keeps each slot in shared memory: past the 48 KiB every launch gets it opts in
  // (3100 slots, the first 3 of each token on an expert, the rest -1, give the reference's sums),
  // past the device's opt-in it refuses.
  const auto wide_routing = [&](int64_t slots) {
    Routing wide(T, E, k, gen);
    wide.weights = Tensor({T, slots}, DType::kFloat32);
    wide.ids = Tensor({T, slots}, DType::kInt32);
    for (int64_t i = 0; i < T * slots; ++i) {
      wide.ids.as<int32_t>()[i] = i % slots < 3 ? static_cast<int32_t>(i % E) : -1;
      wide.weights.set(i, 0.5);
    }
    return wide;
  };
  Tensor out32({T, 64}, DType::kFloat32);
  const Experts d13(WeightFormat::kDense, E, 2 * I, 64, DType::kFloat32, gen), d2(WeightFormat::kDense, E, 64, I,
                                                                                    DType::kFloat32, gen);
  const Routing wide = wide_routing(3100);
  run_fused_moe(out32, x64, d13, d2, wide, true);
  expect_near_reference(out32, reference(x64, d13, d2, wide));
  sim_test::expect_refusal([&] { run_fused_moe(out32, x64, d13, d2, wide_routing(15000), true); },
                           "need more shared memory than the device has");
}

// ---- router and grouping ----------------------------------------------------------------------

void run_topk(Tensor& weights, Tensor& ids, const Tensor& logits, const octavo::TopkArgs& args, bool cuda) {
  octavo::topk_softmax(cuda ? weights.cuda() : weights.cpu(), cuda ? ids.cuda() : ids.cpu(),
                       cuda ? logits.cuda() : logits.cpu(), args);
}

void expect_topk_matches_cpu(const Tensor& logits, int64_t k, const octavo::TopkArgs& args) {
  const int64_t T = logits.shape()[0];
  Tensor cpu_w({T, k}, DType::kFloat32), gpu_w({T, k}, DType::kFloat32);
  Tensor cpu_ids({T, k}, DType::kInt32), gpu_ids({T, k}, DType::kInt32);
  run_topk(cpu_w, cpu_ids, logits, args, false);
  run_topk(gpu_w, gpu_ids, logits, args, true);
  EXPECT_TRUE(gpu_ids.same_bytes(cpu_ids));
  for (int64_t i = 0; i < T * k; ++i) {
    const float c = cpu_w.get(i), g = gpu_w.get(i);
    if (std::isnan(c)) EXPECT_TRUE(std::isnan(g)) << "weight " << i;
    else EXPECT_NEAR(g, c, 1e-6 * std::fabs(c) + 1e-7) << "weight " << i;
  }
}

TEST(SimMoe, TopkMatchesTheCpu) {
  std::mt19937 gen(45);
  for (DType dtype : sim_test::kFloatDTypes)
    for (int64_t E : {8, 60, 144})
      for (auto scoring : {octavo::MoeScoring::kSoftmax, octavo::MoeScoring::kSigmoid})
        for (bool renormalize : {false, true})
          for (int64_t groups : {0, 4}) {
            const int64_t k = groups ? 3 : std::min<int64_t>(E, 8);
            octavo::TopkArgs args{renormalize, scoring, groups, groups ? 2 : 0, E == 60 ? 5.0 : 0.0};
            SCOPED_TRACE(std::string(octavo::dtype_name(dtype)) + " E " + std::to_string(E) + " groups " +
                         std::to_string(groups) + (renormalize ? " renormalized" : "") +
                         (scoring == octavo::MoeScoring::kSigmoid ? " sigmoid" : " softmax"));
            expect_topk_matches_cpu(sim_test::randn({5, E}, dtype, gen, 3.0), k, args);
          }
}

// Equal scores go to the lower id; a NaN score loses to every number; a row of NaNs still gets
// valid ids (the lowest eligible ones), in groups too.
TEST(SimMoe, TopkTiesAndNaNsPickAsTheCpu) {
  const int64_t E = 16;
  Tensor logits({4, E}, DType::kFloat32);
  for (int64_t e = 0; e < E; ++e) {
    logits.set(e, 1.0);                                  // all tied
    logits.set(E + e, e % 3 == 0 ? NAN : e * 0.1);       // NaNs among numbers
    logits.set(2 * E + e, NAN);                          // all NaN
    logits.set(3 * E + e, e == 0 ? NAN : (e % 4) * 1.0);  // a NaN first, ties after
  }
  for (auto scoring : {octavo::MoeScoring::kSoftmax, octavo::MoeScoring::kSigmoid})
    for (int64_t groups : {0, 4}) {
      SCOPED_TRACE(std::to_string(groups) + " groups");
      expect_topk_matches_cpu(logits, 4, octavo::TopkArgs{false, scoring, groups, groups ? 2 : 0, 0.0});
    }
  Tensor w({4, 4}, DType::kFloat32), ids({4, 4}, DType::kInt32);
  run_topk(w, ids, logits, octavo::TopkArgs{false, octavo::MoeScoring::kSigmoid, 0, 0, 0.0}, true);
  const std::vector<float> got = ids.floats();
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 4), (std::vector<float>{0, 1, 2, 3})) << "ties";
  EXPECT_EQ(std::vector<float>(got.begin() + 8, got.begin() + 12), (std::vector<float>{0, 1, 2, 3})) << "all NaN";
  EXPECT_EQ(got[12], 3.0f) << "the highest number, not the NaN before it";
}

struct Aligned {
  Tensor sorted, experts, used;
  Aligned(int64_t pairs, int64_t E, int64_t block)
      : sorted({pairs + E * (block - 1)}, DType::kInt32),
        experts({(pairs + E * (block - 1)) / block}, DType::kInt32),
        used({1}, DType::kInt32) {}
};

void run_align(Aligned& a, const Tensor& ids, int64_t E, int64_t block, bool cuda) {
  auto v = [cuda](const Tensor& t) { return cuda ? t.cuda() : t.cpu(); };
  octavo::moe_align(v(ids), E, block, v(a.sorted), v(a.experts), v(a.used));
}

TEST(SimMoe, MoeAlignMatchesTheCpu) {
  std::mt19937 gen(46);
  // 400 experts: past the 48 KiB of shared memory a launch gets without asking.
  for (int64_t E : {1, 5, 40, 400})
    for (int64_t block : {1, 4, 16})
      for (auto [T, k] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {1, 1}, {7, 2}, {150, 8}, {1000, 8}}) {
        SCOPED_TRACE("E " + std::to_string(E) + " block " + std::to_string(block) + " T " + std::to_string(T));
        Tensor ids({T, k}, DType::kInt32);
        for (int64_t i = 0; i < T * k; ++i) ids.as<int32_t>()[i] = static_cast<int32_t>(gen() % (E + 1)) - 1;
        Aligned cpu(T * k, E, block), gpu(T * k, E, block);
        run_align(cpu, ids, E, block, false);
        run_align(gpu, ids, E, block, true);
        EXPECT_TRUE(gpu.sorted.same_bytes(cpu.sorted));
        EXPECT_TRUE(gpu.experts.same_bytes(cpu.experts));
        EXPECT_TRUE(gpu.used.same_bytes(cpu.used));
      }
}

// The CUDA kernels do not read ids on the host, so they skip ids outside [0, E) as they skip -1
// (the CPU op refuses them before it starts).
TEST(SimMoe, IdsOutOfRangeAreSkippedOnCuda) {
  std::mt19937 gen(47);
  const int64_t T = 9, k = 2, E = 4, H = 64, I = 32;
  Routing r(T, E, k, gen, 0.0), cleaned = r;
  for (int64_t i : {0, 5, 11}) {
    r.ids.as<int32_t>()[i] = i == 5 ? -7 : static_cast<int32_t>(E + i);
    cleaned.ids.as<int32_t>()[i] = -1;
  }
  Aligned cpu(T * k, E, 4), gpu(T * k, E, 4);
  run_align(cpu, cleaned.ids, E, 4, false);
  run_align(gpu, r.ids, E, 4, true);
  EXPECT_TRUE(gpu.sorted.same_bytes(cpu.sorted));
  EXPECT_TRUE(gpu.experts.same_bytes(cpu.experts));
  const Experts w13(WeightFormat::kDense, E, 2 * I, H, DType::kFloat32, gen);
  const Experts w2(WeightFormat::kDense, E, H, I, DType::kFloat32, gen);
  const Tensor x = sim_test::randn({T, H}, DType::kFloat32, gen);
  Tensor out({T, H}, DType::kFloat32), want({T, H}, DType::kFloat32);
  run_fused_moe(out, x, w13, w2, r, true);
  run_fused_moe(want, x, w13, w2, cleaned, true);
  EXPECT_TRUE(out.same_bytes(want));
}

}  // namespace
