// The CUDA launchers: one per op, taking the same plain params as the CPU launchers (params.h)
// and running on the calling thread's current stream (see octavo/cuda_info.h). Declared without
// CUDA headers so the op adapters, plain C++, can call them. A build without CUDA gets
// definitions that throw (cpu/cuda_stub.cc).
//
// Unlike the CPU adapters, nothing on the host reads a CUDA tensor's data (that would be a
// device-to-host copy per call, and impossible inside a CUDA graph), so index range checks
// happen in the kernels: an out-of-range position or slot leaves its token untouched.
#pragma once

#include "host_device.h"
#include "octavo/cuda_info.h"  // CudaStepLimits
#include "octavo/ops.h"
#include "params.h"

namespace octavo::cuda {

constexpr int kMaxDevices = 64;  // per-device tables (workspaces, SM counts) have this many rows
int current_device();            // the CUDA device this host thread launches on, below kMaxDevices
// The current device's SM count and the dynamic shared memory a kernel may opt in to, read from
// the driver once per device.
int multiprocessor_count();
int shared_memory_optin();

void rms_norm(const RmsNormParams& p);
void rotary_embedding(const RotaryParams& p);
void silu_and_mul(const GatedActivationParams& p);
void gelu_and_mul(const GatedActivationParams& p, GeluApproximation approximate);
void reshape_and_cache(const CacheWriteParams& p);
// Head sizes 64, 128 and 256, at most kMaxGroup query heads per KV head.
void paged_attention(const PagedAttentionParams& p);
constexpr int kMaxGroup = 16;
// Query rows per block of the tensor-core prefill kernel: (token, query head) pairs of one KV
// head, so a tile holds kPrefillRows / group tokens of one sequence.
constexpr int kPrefillRows = 128;
// Tiles of a sequence with n query tokens in the prefill kernel: what the host plan
// (plan_paged_attention) and the device's own layout both count.
OCTAVO_HOST_DEVICE inline int32_t prefill_tiles(int32_t n, int32_t group) {
  const int32_t tokens_per_tile = kPrefillRows / group;
  return n > 0 ? (n + tokens_per_tile - 1) / tokens_per_tile : 0;
}
void apply_token_bitmask(const TokenBitmaskParams& p);
void sample(const SampleParams& p);
// Each op's share of reserve_cuda_workspaces: its workspaces at their largest size within limits.
void reserve_paged_attention_workspaces(const CudaStepLimits& limits);
void reserve_sample_workspaces(int64_t max_rows, int64_t vocab_size);
// Every WeightFormat; the weight and input rows aligned as their loads need (a contiguous tensor
// from torch is), and dense weights in rows of a multiple of 32 inputs. dequantize: out in any
// float dtype (p.dtype).
void linear(const LinearParams& p);
// linear with p.tensor_cores (linear_mma.cu): 16-bit inputs only.
void linear_mma(const LinearParams& p);
void dequantize(const LinearParams& p);
// Mixture of experts (moe.cu). Ids outside [0, num_experts) count as -1 (skipped); fused_moe
// takes every format linear does but the CPU's bf16 tiles, with hidden and intermediate sizes in
// multiples of 32.
void topk_softmax(const TopkParams& p);
void moe_align(const MoeAlignParams& p);
void fused_moe(const FusedMoeParams& p);

}  // namespace octavo::cuda
