// Whether this build carries CUDA kernels, how many devices the runtime can see, the stream the
// calling thread launches Octavo's CUDA kernels on, and the kernels' scratch memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace octavo {

bool cuda_compiled();      // true when built with OCTAVO_WITH_CUDA
int cuda_device_count();   // 0 without CUDA, without a driver, or on any CUDA error

// The cudaStream_t this host thread's CUDA ops run on (null: the legacy default stream, the
// initial value). Python sets it to torch's current stream; a CUDA graph capture needs it set to
// the capturing stream. Without CUDA, set_cuda_stream accepts only null.
void set_cuda_stream(void* stream);
void* cuda_stream();

// The largest step an engine runs: every paged_attention call has at most max_tokens query
// tokens over at most max_seqs sequences, whose block tables are at most max_blocks_per_seq wide,
// and every sample call at most max_seqs rows of vocab_size logits.
struct CudaStepLimits {
  int64_t max_tokens, max_seqs;
  int64_t num_heads, num_kv_heads, head_size;
  int64_t max_blocks_per_seq, block_size;
  int64_t vocab_size;
};

// Allocates on the current CUDA device, at its largest size, each scratch buffer that a step
// within `limits` can ask for, so that no such step allocates device memory outside the caller's
// allocator afterwards (and none can fail for it). An engine calls this before it measures the
// memory left for its KV cache. Returns the bytes held (cuda_workspace_stats().bytes).
size_t reserve_cuda_workspaces(const CudaStepLimits& limits);

// The current device's workspace bytes, and the allocations made for workspaces on any device
// since the process started (a count that stays put once a reservation covers every step).
struct CudaWorkspaceStats {
  size_t bytes;
  int64_t allocations;
};
CudaWorkspaceStats cuda_workspace_stats();

}  // namespace octavo
