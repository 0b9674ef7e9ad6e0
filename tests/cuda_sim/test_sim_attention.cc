// paged_attention's CUDA kernels (split-KV decode, tensor-core grouped decode, tensor-core
// prefill, the merge and the on-device tile layout) run by the simulator, against a float64
// reference: test_cuda_ops.py's case list, which a GPU runs on the real device.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_kernels.h"  // multiprocessor_count
#include "octavo/cuda_info.h"
#include "octavo/status.h"
#include "sim_test_util.h"

namespace {

using sim_test::DType;
using sim_test::Tensor;

// (context tokens already cached, new query tokens) per sequence.
using Seqs = std::vector<std::pair<int, int>>;
const Seqs kMixed = {{37, 1}, {0, 23}, {64, 1}, {15, 17}, {0, 1}, {100, 5}};
const Seqs kDecodes = {{37, 1}, {0, 1}, {64, 1}, {300, 1}, {1, 1}, {129, 1}};

double tolerance(DType dtype) { return dtype == DType::kFloat32 ? 1e-5 : 1e-2; }

// A paged KV cache holding a random context per sequence and the queries of one step, as
// test_attention.py's Batch: blocks handed out in a shuffled order, spare blocks NaN. With `fp8`
// the cache holds K / k_scale and V / v_scale in E4M3 (kv_cache_dtype="fp8"), and keys / values
// what it holds, times the scales (powers of two, so the query's dtype holds them exactly).
struct Batch {
  Seqs seqs;
  int heads, kv_heads, head_size, block_size;
  DType dtype;
  double k_scale = 1.0, v_scale = 1.0;
  Tensor key_cache, value_cache, keys, values, query, query_start_loc, seq_lens, block_tables;

  Batch(Seqs s, int h, int kvh, int d, int bs, DType dt, std::mt19937& gen, bool fp8 = false)
      : seqs(std::move(s)), heads(h), kv_heads(kvh), head_size(d), block_size(bs), dtype(dt) {
    const int num_seqs = static_cast<int>(seqs.size());
    std::vector<int> blocks(seqs.size());
    int total = 0, total_blocks = 0, width = 0, tokens = 0;
    seq_lens = Tensor({num_seqs}, DType::kInt32);
    query_start_loc = Tensor({num_seqs + 1}, DType::kInt32);
    for (int b = 0; b < num_seqs; ++b) {
      const int len = seqs[b].first + seqs[b].second;
      seq_lens.as<int32_t>()[b] = len;
      blocks[b] = (len + block_size - 1) / block_size;
      total += len;
      total_blocks += blocks[b];
      width = std::max(width, blocks[b] + 1);
      tokens += seqs[b].second;
      query_start_loc.as<int32_t>()[b + 1] = tokens;
    }
    const int num_blocks = total_blocks + 3;  // spare blocks stay NaN: a stray read would show
    std::vector<int> order(num_blocks - 1);
    std::iota(order.begin(), order.end(), 1);
    std::shuffle(order.begin(), order.end(), gen);
    block_tables = Tensor({num_seqs, width}, DType::kInt32);
    Tensor slots({total}, DType::kInt64);
    for (int b = 0, used = 0, t = 0; b < num_seqs; ++b) {
      for (int i = 0; i < blocks[b]; ++i) block_tables.as<int32_t>()[b * width + i] = order[used + i];
      used += blocks[b];
      for (int pos = 0; pos < seq_lens.as<int32_t>()[b]; ++pos, ++t)
        slots.as<int64_t>()[t] = int64_t{block_tables.as<int32_t>()[b * width + pos / block_size]} * block_size +
                                 pos % block_size;
    }
    const DType cache_dtype = fp8 ? DType::kFloat8E4M3 : dtype;
    if (fp8) k_scale = 0.25, v_scale = 2.0;
    key_cache = Tensor({num_blocks, kv_heads, block_size, head_size}, cache_dtype);
    value_cache = Tensor(key_cache.shape(), cache_dtype);
    for (int64_t i = 0; i < key_cache.numel(); ++i) key_cache.set(i, NAN), value_cache.set(i, NAN);
    keys = sim_test::randn({total, kv_heads, head_size}, dtype, gen);
    values = sim_test::randn({total, kv_heads, head_size}, dtype, gen);
    octavo::reshape_and_cache(keys.cpu(), values.cpu(), key_cache.cpu(), value_cache.cpu(), slots.cpu(), k_scale,
                              v_scale);
    if (fp8) {
      for (int64_t i = 0; i < keys.numel(); ++i) {
        keys.set(i, octavo::fp8_e4m3_to_float(octavo::fp8_e4m3_from_float(keys.get(i) / k_scale)) * k_scale);
        values.set(i, octavo::fp8_e4m3_to_float(octavo::fp8_e4m3_from_float(values.get(i) / v_scale)) * v_scale);
      }
    }
    query = sim_test::randn({tokens, heads, head_size}, dtype, gen);
  }

  // Whether key k of sequence b lies in a block of the cache: the CUDA kernels mask keys of a
  // block id outside it (the host cannot check the table without reading it back).
  bool in_cache(int b, int k) const {
    const int64_t block = block_tables.get(b * block_tables.shape()[1] + k / block_size);
    return block >= 0 && block < key_cache.shape()[0];
  }

  // Softmax(q·k * scale, capped, masked) · v per query row, in float64 from the rounded inputs.
  std::vector<double> reference(double scale, int window, double softcap) const {
    std::vector<double> out(static_cast<size_t>(query.numel()));
    const int group = heads / kv_heads;
    for (int b = 0, start = 0; b < static_cast<int>(seqs.size()); ++b) {
      const int len = seq_lens.get(b), n = seqs[b].second, q0 = query_start_loc.get(b);
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < heads; ++h) {
          const int qpos = len - n + i, kvh = h / group;
          std::vector<double> s(len, -INFINITY);
          double top = -INFINITY;
          for (int k = 0; k <= qpos; ++k) {
            if ((window > 0 && k <= qpos - window) || !in_cache(b, k)) continue;
            double dot = 0;
            for (int d = 0; d < head_size; ++d)
              dot += double{query.get(((q0 + i) * heads + h) * head_size + d)} *
                     keys.get(((start + k) * kv_heads + kvh) * head_size + d);
            s[k] = dot * scale;
            if (softcap > 0) s[k] = softcap * std::tanh(s[k] / softcap);
            top = std::max(top, s[k]);
          }
          double sum = 0;
          for (double& x : s) sum += (x = std::exp(x - top));
          for (int d = 0; d < head_size; ++d) {
            double acc = 0;
            for (int k = 0; k < len; ++k) acc += s[k] * values.get(((start + k) * kv_heads + kvh) * head_size + d);
            out[((q0 + i) * heads + h) * head_size + d] = acc / sum;
          }
        }
      start += len;
    }
    return out;
  }

  // How many sequences at the batch's start are decodes (one query token each).
  int leading_decodes() const {
    int n = 0;
    while (n < static_cast<int>(seqs.size()) && seqs[n].second == 1) ++n;
    return n;
  }

  // Query rows `pad` elements further apart than their heads: with an odd pad no row is
  // 16-byte aligned, so no tensor-core kernel can read them in packs. num_decodes: passed on.
  Tensor run(double scale, int window, double softcap, const Tensor* plan, int pad = 0, int num_decodes = 0) const {
    Tensor out(query.shape(), dtype);
    const sim_test::TensorView plan_view = plan ? plan->cuda() : sim_test::TensorView{};
    const int64_t tokens = query.shape()[0], row = int64_t{heads} * head_size;
    Tensor padded({tokens, row + pad}, dtype);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < row; ++i) padded.set(t * (row + pad) + i, query.get(t * row + i));
    sim_test::TensorView q = query.cuda();
    q.data = padded.data();
    q.strides[0] = row + pad;
    octavo::paged_attention(out.cuda(), q, key_cache.cuda(), value_cache.cuda(), query_start_loc.cuda(),
                            seq_lens.cuda(), block_tables.cuda(), scale, window, softcap, plan ? &plan_view : nullptr,
                            num_decodes, k_scale, v_scale);
    return out;
  }
};

void expect_close(const Tensor& out, const std::vector<double>& ref, DType dtype) {
  double err = 0, norm = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(out.get(i))) << "element " << i;
    err += (out.get(i) - ref[i]) * (out.get(i) - ref[i]);
    norm += ref[i] * ref[i];
  }
  EXPECT_LT(std::sqrt(err / norm), tolerance(dtype));
}

// Elements [from, numel) of a and b are the same values (or both NaN).
bool same_from(const Tensor& a, const Tensor& b, int64_t from) {
  for (int64_t i = from; i < a.numel(); ++i)
    if (a.get(i) != b.get(i) && !(std::isnan(a.get(i)) && std::isnan(b.get(i)))) return false;
  return true;
}

// The batch on the simulated device, with the host's plan and with the tile layout made on the
// device, against float64: within test_attention.py's tolerance, and the two runs equal. A batch
// that starts with decodes runs twice more with them counted (num_decodes), which sends them to
// the decode kernels apart from the rest: as close to float64, and the rest's rows unchanged.
void check(const Batch& batch, int window = 0, double softcap = 0, int pad = 0) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(batch.head_size));
  Tensor plan({static_cast<int64_t>(batch.seqs.size()) + 1}, DType::kInt32);
  octavo::plan_paged_attention(plan.cpu(), batch.query_start_loc.cpu(), batch.heads, batch.kv_heads);
  const Tensor out = batch.run(scale, window, softcap, nullptr, pad);
  const Tensor planned = batch.run(scale, window, softcap, &plan, pad);
  const std::vector<double> ref = batch.reference(scale, window, softcap);
  expect_close(out, ref, batch.dtype);
  EXPECT_TRUE(planned.same_bytes(out)) << "the host's plan and the device's layout give different results";
  const int decodes = batch.leading_decodes();
  if (decodes == 0 || decodes == static_cast<int>(batch.seqs.size())) return;
  SCOPED_TRACE(std::to_string(decodes) + " leading decodes run apart");
  const Tensor apart = batch.run(scale, window, softcap, &plan, pad, decodes);
  const Tensor apart_unplanned = batch.run(scale, window, softcap, nullptr, pad, decodes);
  expect_close(apart, ref, batch.dtype);
  EXPECT_TRUE(apart_unplanned.same_bytes(apart)) << "with decodes apart, plan and device layout differ";
  EXPECT_TRUE(same_from(apart, out, int64_t{decodes} * batch.heads * batch.head_size))
      << "running the decodes apart changed the other sequences' rows";
}

std::string name(DType dtype) { return octavo::dtype_name(dtype); }

// Launches on a simulated device of other properties while in scope. One device per set of
// properties (the kernels' host code reads a device's properties once, so device 0's cannot be
// changed), made on first use.
class OnDevice {
 public:
  explicit OnDevice(cuda_sim::DeviceProperties properties) {
    static std::map<std::pair<int, int>, int> devices;
    const auto key = std::make_pair(properties.multiprocessors, properties.shared_optin);
    if (devices.count(key) == 0) devices[key] = cuda_sim::add_device(properties);
    EXPECT_EQ(cudaSetDevice(devices[key]), cudaSuccess);
  }
  ~OnDevice() { cudaSetDevice(0); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
};

TEST(SimAttention, MixedBatch) {
  for (DType dtype : sim_test::kFloatDTypes)
    for (int head_size : {64, 128, 256})
      for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{4, 4}, {8, 2}, {32, 8}, {16, 1}}) {
        SCOPED_TRACE(name(dtype) + " head_size " + std::to_string(head_size) + " heads " + std::to_string(heads) +
                     "/" + std::to_string(kv_heads));
        std::mt19937 gen(head_size * 100 + heads);
        check(Batch(kMixed, heads, kv_heads, head_size, 16, dtype, gen));
      }
}

// Chunks of a prompt after decodes of long contexts, the step that chunked prefill makes: the
// decodes split their keys over the SMs in the decode kernels, the chunks take the prefill
// kernel; then decodes after a chunk (only leading ones run apart). test_attention.py's
// counted-decodes test adds a window, on a GPU.
TEST(SimAttention, MixedStepsRunTheirLeadingDecodesApart) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{32, 8}, {16, 1}}) {
      SCOPED_TRACE(name(dtype) + " heads " + std::to_string(heads) + "/" + std::to_string(kv_heads));
      std::mt19937 gen(heads + kv_heads);
      const Batch batch({{1200, 1}, {700, 1}, {5, 1}, {40, 70}, {0, 9}}, heads, kv_heads, 64, 16, dtype, gen);
      ASSERT_EQ(batch.leading_decodes(), 3);
      check(batch);
      check(Batch({{20, 1}, {90, 33}, {1200, 1}, {0, 1}}, heads, kv_heads, 128, 16, dtype, gen));
    }
}

// The count is checked where the batch can be read (the CPU), and its range everywhere.
TEST(SimAttention, NumDecodesMustCountSingleTokenSequences) {
  std::mt19937 gen(5);
  const Batch batch(kMixed, 8, 2, 64, 16, DType::kBFloat16, gen);
  Tensor out(batch.query.shape(), batch.dtype);
  const auto call = [&](bool cuda, int64_t num_decodes) {
    const auto view = [cuda](const Tensor& t) { return cuda ? t.cuda() : t.cpu(); };
    octavo::paged_attention(view(out), view(batch.query), view(batch.key_cache), view(batch.value_cache),
                            view(batch.query_start_loc), view(batch.seq_lens), view(batch.block_tables), 0.125, 0, 0,
                            nullptr, num_decodes);
  };
  call(false, 1);
  call(true, 1);
  EXPECT_THROW(call(false, 2), octavo::Error);  // sequence 1 has 23 query tokens
  for (int64_t bad : {-1, 7})
    for (bool cuda : {false, true}) EXPECT_THROW(call(cuda, bad), octavo::Error) << bad;
}

// Decodes alone: groups of 4 and more in bfloat16 / float16 take the tensor-core decode kernel
// (padded to 16 rows), smaller groups and float32 the split-KV kernel; block sizes 32 and 24 (a
// division instead of a shift), a window and a cap.
TEST(SimAttention, Decodes) {
  for (DType dtype : sim_test::kFloatDTypes)
    for (int head_size : {64, 128, 256})
      for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{6, 3}, {8, 2}, {12, 2}, {8, 1}, {16, 1}}) {
        SCOPED_TRACE(name(dtype) + " head_size " + std::to_string(head_size) + " group " +
                     std::to_string(heads / kv_heads));
        std::mt19937 gen(head_size * 10 + heads * 3 + kv_heads);
        check(Batch(kDecodes, heads, kv_heads, head_size, 32, dtype, gen));
        Batch batch(kDecodes, heads, kv_heads, head_size, 24, dtype, gen);
        check(batch, 50);
        for (int64_t i = 0; i < batch.query.numel(); ++i) batch.query.set(i, batch.query.get(i) * 8);
        check(batch, 0, 5.0);  // large scores, so that the cap matters
      }
}

// Contexts of 2-5k tokens, GQA 4:1: decodes split their keys across blocks (11 splits on an
// H100's 132 SMs) and merge, or on 8 SMs take one split each. With a multi-token chunk the whole
// batch takes the tensor-core prefill kernel (bfloat16 here; MixedBatch covers float16).
TEST(SimAttention, LongContexts) {
  for (int sms : {132, 8}) {
    OnDevice device({sms});
    ASSERT_EQ(octavo::cuda::multiprocessor_count(), sms);
    for (DType dtype : sim_test::kFloatDTypes) {
      SCOPED_TRACE(name(dtype) + " decodes on " + std::to_string(sms) + " SMs");
      std::mt19937 gen(3);
      const Batch batch({{5000, 1}, {2047, 1}, {10, 1}}, 32, 8, 128, 16, dtype, gen);
      check(batch);
      check(batch, 700);
    }
  }
  std::mt19937 gen(4);
  const Batch batch({{5000, 1}, {2047, 1}, {3000, 2}, {10, 1}}, 32, 8, 128, 16, DType::kBFloat16, gen);
  check(batch);
  check(batch, 700);
}

// The split workspace outlives a call. A decode whose context ends before its trailing splits
// must mark them empty, or the merge would read what an earlier call with a longer context left
// there: the second batch has the first one's splits (same tokens, heads and table width).
TEST(SimAttention, EmptySplitsIgnoreWhatAnEarlierCallLeft) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {  // the split-KV and the grouped decode kernel
    SCOPED_TRACE(name(dtype));
    std::mt19937 gen(8);
    check(Batch({{3000, 1}, {3000, 1}}, 32, 8, 64, 16, dtype, gen));
    check(Batch({{3000, 1}, {10, 1}}, 32, 8, 64, 16, dtype, gen));
  }
}

// Query rows that are not 16-byte aligned: mixed batches and GQA 4:1 decodes in bfloat16 /
// float16 fall back to the split-KV kernel, which takes multi-token queries too.
TEST(SimAttention, UnalignedQueryRowsTakeTheSplitKvKernel) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (const Seqs* seqs : {&kMixed, &kDecodes}) {
      SCOPED_TRACE(name(dtype) + (seqs == &kMixed ? " mixed" : " decodes"));
      std::mt19937 gen(21);
      check(Batch(*seqs, 8, 2, 128, 16, dtype, gen), 0, 0, 1);
      check(Batch(*seqs, 8, 2, 128, 16, dtype, gen), 40, 0, 3);
    }
}

TEST(SimAttention, SlidingWindowAndSoftcap) {
  for (DType dtype : sim_test::kFloatDTypes) {
    SCOPED_TRACE(name(dtype));
    std::mt19937 gen(5);
    const Batch batch({{90, 1}, {40, 30}, {0, 50}, {7, 1}, {200, 130}}, 8, 2, 64, 16, dtype, gen);
    check(batch, 24);
    check(batch, 1);
    Batch capped(kMixed, 4, 2, 64, 16, dtype, gen);
    for (int64_t i = 0; i < capped.query.numel(); ++i) capped.query.set(i, capped.query.get(i) * 8);
    check(capped, 0, 5.0);  // large scores, so that the cap matters
  }
}

// An fp8 cache (kv_cache_dtype="fp8") read by the decode kernels for every query token, with its
// scales: decodes and prompt chunks of each query dtype, GQA groups of 1 (split-KV) and 4, 8 (the
// grouped decode kernel for 16-bit queries, float32 ones split-KV), every head size, a window and
// a cap (every head size in bfloat16, 128 in the others); then long contexts split over the SMs.
TEST(SimAttention, Fp8Cache) {
  for (DType dtype : sim_test::kFloatDTypes)
    for (int head_size : dtype == DType::kBFloat16 ? std::vector<int>{64, 128, 256} : std::vector<int>{128})
      for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{4, 4}, {8, 2}, {16, 2}}) {
        SCOPED_TRACE(name(dtype) + " head_size " + std::to_string(head_size) + " heads " + std::to_string(heads) +
                     "/" + std::to_string(kv_heads));
        std::mt19937 gen(head_size + heads);
        check(Batch(kMixed, heads, kv_heads, head_size, 16, dtype, gen, /*fp8=*/true));
        Batch decodes(kDecodes, heads, kv_heads, head_size, 24, dtype, gen, /*fp8=*/true);
        check(decodes, 50);
        for (int64_t i = 0; i < decodes.query.numel(); ++i) decodes.query.set(i, decodes.query.get(i) * 8);
        check(decodes, 0, 5.0);
      }
}

TEST(SimAttention, Fp8CacheLongContexts) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(name(dtype));
    std::mt19937 gen(9);
    check(Batch({{3000, 1}, {2047, 1}, {700, 3}}, 32, 8, 128, 16, dtype, gen, /*fp8=*/true), 700);
  }
}

// Blocks smaller than a tile: a tile's keys span many table entries (64 of block size 1 in the
// grouped decode kernel's 64-key tiles, past one warp's 32 lanes), and windows start tiles
// inside a block. Every kernel: prefill (the mixed batch), split-KV (group 2, and float32) and
// grouped decode (group 8) under a window.
TEST(SimAttention, SmallBlocksSpanManyTableEntriesPerTile) {
  for (DType dtype : sim_test::kFloatDTypes)
    for (int block_size : {1, 2, 3, 8})
      for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{4, 2}, {16, 2}}) {
        SCOPED_TRACE(name(dtype) + " block_size " + std::to_string(block_size) + " group " +
                     std::to_string(heads / kv_heads));
        std::mt19937 gen(block_size * 10 + heads);
        check(Batch(kMixed, heads, kv_heads, 64, block_size, dtype, gen));
        const Batch decodes({{300, 1}, {77, 1}, {0, 1}, {129, 1}}, heads, kv_heads, 128, block_size, dtype, gen);
        check(decodes);
        check(decodes, 45);
      }
}

// Head size 256 on a device with an RTX 30xx / 40xx's 99 KiB of opt-in shared memory per block:
// the prefill kernel takes 16-key tiles there, since its 32-key shape needs 132 KiB (which the
// simulator, like the GPU, refuses past the device's limit). Below 99 KiB it refuses clearly.
TEST(SimAttention, HeadSize256PrefillFitsA99KiBDevice) {
  {
    OnDevice rtx({82, 99 * 1024});
    for (DType dtype : {DType::kBFloat16, DType::kFloat16})
      for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{4, 4}, {8, 2}, {16, 1}}) {
        SCOPED_TRACE(name(dtype) + " heads " + std::to_string(heads) + "/" + std::to_string(kv_heads));
        std::mt19937 gen(heads + kv_heads);
        const Batch batch({{37, 1}, {0, 23}, {15, 17}, {300, 40}}, heads, kv_heads, 256, 16, dtype, gen);
        check(batch);
        check(batch, 20);
      }
    // Over an fp8 cache the prefill kernel's staging does not fit: the decode kernels take the batch.
    std::mt19937 gen(12);
    check(Batch({{37, 1}, {0, 23}, {300, 40}}, 8, 2, 256, 16, DType::kBFloat16, gen, /*fp8=*/true));
  }
  OnDevice small({82, 64 * 1024});
  std::mt19937 gen(10);
  const Batch batch(kMixed, 8, 2, 256, 16, DType::kBFloat16, gen);
  try {
    batch.run(0.1, 0, 0, nullptr);
    FAIL() << "prefill ran past the device's shared memory";
  } catch (const octavo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the kernel's 101376 bytes of shared memory are not available"),
              std::string::npos)
        << e.what();
  }
}

// Block ids outside the cache (-1, or past its last block) in the middle of sequences: the keys
// they hold are masked by every kernel (float32: split-KV; 16-bit: prefill in the mixed batch,
// grouped decode for the decodes), as the reference leaves them out.
TEST(SimAttention, BlockIdsOutsideTheCacheMaskTheirKeys) {
  for (DType dtype : sim_test::kFloatDTypes)
    for (const Seqs* seqs : {&kMixed, &kDecodes}) {
      SCOPED_TRACE(name(dtype) + (seqs == &kMixed ? " mixed" : " decodes"));
      std::mt19937 gen(33);
      Batch batch(*seqs, 8, 2, 64, 16, dtype, gen);
      const int64_t width = batch.block_tables.shape()[1];
      batch.block_tables.set(3 * width + 1, -1);                                    // keys 16-31 of sequence 3
      batch.block_tables.set(5 * width + 2, static_cast<double>(batch.key_cache.shape()[0]));  // keys 32-47 of 5
      check(batch);
    }
}

// Samples every row of logits [rows, vocab] on the simulated device, with frequency and presence
// penalties (their counts take a workspace of their own).
void sample_with_penalties(const Tensor& logits, std::mt19937& gen) {
  const int64_t rows = logits.shape()[0];
  Tensor temperature({rows}, DType::kFloat32), penalty({rows}, DType::kFloat32), seeds({rows}, DType::kInt64),
      counters({rows}, DType::kInt64), offsets({rows + 1}, DType::kInt32), ids({rows}, DType::kInt32),
      sampled({rows}, DType::kInt32);
  for (int64_t r = 0; r < rows; ++r) {
    temperature.set(r, 1.0), penalty.set(r, 0.5), seeds.set(r, static_cast<double>(gen() % 1000));
    offsets.set(r + 1, static_cast<double>(r + 1)), ids.set(r, static_cast<double>(r));
  }
  const sim_test::TensorView penalty_v = penalty.cuda(), offsets_v = offsets.cuda(), ids_v = ids.cuda();
  octavo::SampleArgs a;
  a.logits = logits.cuda();
  a.temperature = temperature.cuda();
  a.frequency_penalty = a.presence_penalty = &penalty_v;
  a.output_offsets = &offsets_v;
  a.output_token_ids = &ids_v;
  a.seeds = seeds.cuda();
  a.counters = counters.cuda();
  a.sampled = sampled.cuda();
  octavo::sample(a);
}

// reserve_cuda_workspaces, then every kind of step within its limits: decodes of every batch
// size at the widest table (a context of 1007 + 1 tokens is 63 blocks; the test's tables add a
// spare column), mixed steps with their decodes run apart, a float32 prompt of 19 tokens through
// the split-KV kernel (19 tokens x 2 KV heads, under twice the 20 SMs: 2 splits of 8 heads each,
// the largest split workspace within the limits, which no batch of max_seqs decodes reaches), and
// sampling at the most rows: no workspace allocation after the reservation. One step past the
// limits does allocate, so the count is watched. On a device of its own, whose workspaces start
// empty.
TEST(SimWorkspaces, ReservationCoversEveryStepWithinItsLimits) {
  OnDevice device({20});
  const octavo::CudaStepLimits limits{/*max_tokens=*/40, /*max_seqs=*/6, /*num_heads=*/8, /*num_kv_heads=*/2,
                                      /*head_size=*/64, /*max_blocks_per_seq=*/64, /*block_size=*/16,
                                      /*vocab_size=*/500};
  const size_t reserved = octavo::reserve_cuda_workspaces(limits);
  const octavo::CudaWorkspaceStats before = octavo::cuda_workspace_stats();
  EXPECT_EQ(before.bytes, reserved);
  EXPECT_GT(reserved, size_t{6 * 500 * 8});  // the sampler's two [rows, vocab] buffers at least

  std::mt19937 gen(11);
  const int full = 1007;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(name(dtype));
    for (int n = 1; n <= 6; ++n) check(Batch(Seqs(n, {full, 1}), 8, 2, 64, 16, dtype, gen));
    check(Batch({{full, 1}, {full, 1}, {full, 1}, {full, 1}, {full, 1}, {100, 35}}, 8, 2, 64, 16, dtype, gen));
    check(Batch({{full + 1 - 19, 19}}, 8, 2, 64, 16, dtype, gen));
  }
  sample_with_penalties(sim_test::randn({6, 500}, DType::kFloat32, gen), gen);
  const octavo::CudaWorkspaceStats after = octavo::cuda_workspace_stats();
  EXPECT_EQ(after.allocations, before.allocations) << "a step within the limits allocated a workspace";
  EXPECT_EQ(after.bytes, before.bytes);

  sample_with_penalties(sim_test::randn({7, 500}, DType::kFloat32, gen), gen);  // one row past max_seqs
  const octavo::CudaWorkspaceStats past = octavo::cuda_workspace_stats();
  EXPECT_EQ(past.allocations, before.allocations + 2);  // the sampler's weights and counts grew...
  EXPECT_EQ(past.bytes, before.bytes + 2 * 500 * 4);    // ... and the outgrown ones were freed
}

TEST(SimWorkspaces, ReservationRefusesEmptyLimits) {
  EXPECT_THROW(octavo::reserve_cuda_workspaces({0, 0, 8, 2, 64, 4, 16, 500}), octavo::Error);
  EXPECT_THROW(octavo::reserve_cuda_workspaces({4, 8, 8, 2, 64, 4, 16, 500}), octavo::Error);  // seqs > tokens
  EXPECT_THROW(octavo::reserve_cuda_workspaces({4, 4, 8, 2, 64, 4, 16, 0}), octavo::Error);
}

TEST(SimAttention, RefusesWhatItHasNoKernelFor) {
  std::mt19937 gen(9);
  const Batch batch({{3, 2}}, 4, 2, 80, 16, DType::kBFloat16, gen);
  try {
    batch.run(0.1, 0, 0, nullptr);
    FAIL() << "head_size 80 ran";
  } catch (const octavo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_size 80 has no CUDA kernel"), std::string::npos) << e.what();
  }
}

}  // namespace
