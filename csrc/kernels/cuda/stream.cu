// The stream each host thread launches Octavo's kernels on, and launch error checks.
#include "common.cuh"
#include "cuda_kernels.h"
#include "octavo/cuda_info.h"

namespace octavo {
namespace {
// Per host thread, as torch's current stream is: the engine thread and a capture can differ.
thread_local cudaStream_t t_stream = nullptr;  // null: the legacy default stream
}  // namespace

void set_cuda_stream(void* stream) { t_stream = static_cast<cudaStream_t>(stream); }
void* cuda_stream() { return t_stream; }

namespace cuda {

cudaStream_t current_stream() { return t_stream; }

int current_device() {
  int device = 0;
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaGetDevice(&device) == cudaSuccess, "no usable CUDA device");
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, device < kMaxDevices,
                    "CUDA device " << device << ": Octavo handles devices 0.." << kMaxDevices - 1);
  return device;
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, err == cudaSuccess,
                    what << ": CUDA error " << cudaGetErrorName(err) << ": " << cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace octavo
