// Per-device scratch buffers for kernels that need global memory beyond their outputs, and their
// reservation at an engine's largest step (octavo/cuda_info.h, reserve_cuda_workspaces).
#include <mutex>
#include <vector>

#include "common.cuh"
#include "cuda_kernels.h"
#include "octavo/cuda_info.h"

namespace octavo::cuda {
namespace {

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool captured = false;  // handed to a kernel inside a CUDA graph capture: the graph keeps its address
};

struct Workspaces {
  std::mutex mu;
  Buffer buffers[kMaxDevices][static_cast<int>(WorkspaceSlot::kCount)];
  // Outgrown buffers that a captured graph may still read or write: kept allocated. An engine
  // reserves every slot at its largest step before it captures, so none land here.
  std::vector<std::pair<int, Buffer>> retired;
  int64_t allocations = 0;
};

Workspaces& workspaces() {
  static Workspaces w;
  return w;
}

bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(current_stream(), &status);
  return status != cudaStreamCaptureStatusNone;
}

// The outgrown buffer `old` of the current device: freed once the device is done with it, or
// kept when a graph holds its address.
void retire(Workspaces& w, int device, const Buffer& old) {
  if (old.ptr == nullptr) return;
  if (old.captured) {
    w.retired.emplace_back(device, old);
    return;
  }
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaDeviceSynchronize() == cudaSuccess && cudaFree(old.ptr) == cudaSuccess,
                    "cannot free an outgrown workspace of CUDA device " << device);
}

}  // namespace

void* device_workspace(WorkspaceSlot slot, size_t bytes, const char* op) {
  Workspaces& w = workspaces();
  const int device = current_device();
  const bool in_capture = capturing();
  std::lock_guard<std::mutex> lock(w.mu);
  Buffer& b = w.buffers[device][static_cast<int>(slot)];
  if (b.bytes >= bytes) {
    b.captured = b.captured || in_capture;
    return b.ptr;
  }
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, !in_capture,
                    op << " needs a larger workspace (" << bytes << " bytes) inside a CUDA graph capture; run the "
                       "captured shape once before capturing, or reserve_cuda_workspaces for the largest step");
  // The old buffer goes first, so that the two never take memory at once.
  retire(w, device, b);
  b = Buffer{};
  void* fresh = nullptr;
  if (cudaMalloc(&fresh, bytes) != cudaSuccess) {
    cudaGetLastError();  // clear it, or the next launch check would report it as its own
    OCTAVO_CHECK_KIND(ErrorKind::kRuntime, false,
                      op << ": cannot allocate a " << bytes << "-byte workspace on CUDA device " << device);
  }
  ++w.allocations;
  b = Buffer{fresh, bytes, false};
  // Zeroed in stream order, before the kernel that asked (sampling's token counts need zeros,
  // and kernels leave them zero).
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaMemsetAsync(fresh, 0, bytes, current_stream()) == cudaSuccess,
                    op << ": cannot clear a new workspace");
  return fresh;
}

}  // namespace octavo::cuda

namespace octavo {

size_t reserve_cuda_workspaces(const CudaStepLimits& limits) {
  OCTAVO_CHECK(limits.max_tokens > 0 && limits.max_seqs > 0 && limits.max_seqs <= limits.max_tokens,
               "reserve_cuda_workspaces: need 0 < max_seqs <= max_tokens, got max_seqs " << limits.max_seqs
                   << " and max_tokens " << limits.max_tokens);
  OCTAVO_CHECK(limits.num_heads > 0 && limits.num_kv_heads > 0 && limits.head_size > 0 &&
                   limits.max_blocks_per_seq > 0 && limits.block_size > 0 && limits.vocab_size > 0,
               "reserve_cuda_workspaces: heads, head_size, max_blocks_per_seq, block_size and vocab_size must be "
               "positive");
  cuda::reserve_paged_attention_workspaces(limits);
  cuda::reserve_sample_workspaces(limits.max_seqs, limits.vocab_size);
  return cuda_workspace_stats().bytes;
}

CudaWorkspaceStats cuda_workspace_stats() {
  cuda::Workspaces& w = cuda::workspaces();
  const int device = cuda::current_device();
  std::lock_guard<std::mutex> lock(w.mu);
  CudaWorkspaceStats stats{0, w.allocations};
  for (const cuda::Buffer& b : w.buffers[device]) stats.bytes += b.bytes;
  for (const auto& [d, b] : w.retired) stats.bytes += d == device ? b.bytes : 0;
  return stats;
}

}  // namespace octavo
