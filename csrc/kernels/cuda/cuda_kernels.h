// The CUDA launchers: one per op, taking the same plain params as the CPU launchers (params.h)
// and running on the calling thread's current stream (see octavo/cuda_info.h). Declared without
// CUDA headers so the op adapters, plain C++, can call them. A build without CUDA gets
// definitions that throw (cpu/cuda_stub.cc).
//
// Unlike the CPU adapters, nothing on the host reads a CUDA tensor's data (that would be a
// device-to-host copy per call, and impossible inside a CUDA graph), so index range checks
// happen in the kernels: an out-of-range position or slot leaves its token untouched.
#pragma once

#include "octavo/ops.h"
#include "params.h"

namespace octavo::cuda {

int current_device();  // the CUDA device this host thread launches on

void rms_norm(const RmsNormParams& p);
void rotary_embedding(const RotaryParams& p);
void silu_and_mul(const GatedActivationParams& p);
void gelu_and_mul(const GatedActivationParams& p, GeluApproximation approximate);
void reshape_and_cache(const CacheWriteParams& p);
// Head sizes 64, 128 and 256, at most 16 query heads per KV head.
void paged_attention(const PagedAttentionParams& p);
// Query rows per block of the tensor-core prefill kernel: (token, query head) pairs of one KV
// head, so a tile holds kPrefillRows / group tokens of one sequence.
constexpr int kPrefillRows = 64;
void sample(const SampleParams& p);

}  // namespace octavo::cuda
