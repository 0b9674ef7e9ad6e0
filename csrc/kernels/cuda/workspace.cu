// Per-device scratch buffers for kernels that need global memory beyond their outputs.
#include <mutex>
#include <vector>

#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {

void* device_workspace(WorkspaceSlot slot, size_t bytes, const char* op) {
  static std::mutex mu;
  constexpr int kSlots = static_cast<int>(WorkspaceSlot::kCount);
  static void* buffers[kMaxDevices][kSlots] = {};
  static size_t sizes[kMaxDevices][kSlots] = {};
  // Outgrown buffers are never freed: a captured CUDA graph may still read or write them. They
  // are kept here, so that they stay reachable rather than leaked.
  static std::vector<void*> retired;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mu);
  const int s = static_cast<int>(slot);
  if (sizes[device][s] >= bytes) return buffers[device][s];
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(current_stream(), &capturing);
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, capturing == cudaStreamCaptureStatusNone,
                    op << " needs a larger workspace (" << bytes << " bytes) inside a CUDA graph capture; run the "
                       "captured shape once before capturing");
  void* fresh = nullptr;
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaMalloc(&fresh, bytes) == cudaSuccess,
                    op << ": cannot allocate a " << bytes << "-byte workspace");
  // Zeroed in stream order, before the kernel that asked (sampling's token counts need zeros,
  // and kernels leave them zero).
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaMemsetAsync(fresh, 0, bytes, current_stream()) == cudaSuccess,
                    op << ": cannot clear a new workspace");
  if (buffers[device][s] != nullptr) retired.push_back(buffers[device][s]);
  buffers[device][s] = fresh;
  sizes[device][s] = bytes;
  return fresh;
}

}  // namespace octavo::cuda
