// Per-device scratch buffers for kernels that need global memory beyond their outputs.
#include <mutex>

#include "common.cuh"

namespace octavo::cuda {
namespace {
constexpr int kMaxDevices = 64;
}  // namespace

void* device_workspace(WorkspaceSlot slot, size_t bytes, const char* op) {
  static std::mutex mu;
  static void* buffers[kMaxDevices][kNumWorkspaceSlots] = {};
  static size_t sizes[kMaxDevices][kNumWorkspaceSlots] = {};
  std::lock_guard<std::mutex> lock(mu);
  int device = 0;
  cudaGetDevice(&device);
  const int s = static_cast<int>(slot);
  if (sizes[device][s] >= bytes) return buffers[device][s];
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(current_stream(), &capturing);
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, capturing == cudaStreamCaptureStatusNone,
                    op << " needs a larger workspace (" << bytes << " bytes) inside a CUDA graph capture; run the "
                       "captured shape once before capturing");
  // Growing waits for the kernels that may still use the old buffer.
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaDeviceSynchronize() == cudaSuccess,
                    op << ": a CUDA error is pending: " << cudaGetErrorString(cudaGetLastError()));
  cudaFree(buffers[device][s]);
  buffers[device][s] = nullptr;
  sizes[device][s] = 0;
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaMalloc(&buffers[device][s], bytes) == cudaSuccess,
                    op << ": cannot allocate a " << bytes << "-byte workspace");
  // Zeroed once: kernels that need zeros (sampling's token counts) leave them zero.
  cudaMemset(buffers[device][s], 0, bytes);
  sizes[device][s] = bytes;
  return buffers[device][s];
}

}  // namespace octavo::cuda
