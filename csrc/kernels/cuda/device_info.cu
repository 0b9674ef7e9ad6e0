// What the build and the devices offer: CUDA's presence and device count (octavo/cuda_info.h),
// and the properties that choose kernels' shapes, read once per device.
#include <cuda_runtime.h>

#include <atomic>

#include "cuda_kernels.h"
#include "octavo/cuda_info.h"
#include "octavo/status.h"

namespace octavo {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error (e.g. no driver) so later calls start clean
    return 0;
  }
  return count;
}

namespace cuda {
namespace {
// The current device's `attr`; `cache` is the caller's table, filled on first use (a GPU's
// properties do not change, and threads may ask for two devices at once).
int device_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[kMaxDevices], const char* what) {
  const int device = current_device();
  if (cache[device].load() == 0) {
    int value = 0;
    OCTAVO_CHECK_KIND(ErrorKind::kRuntime, cudaDeviceGetAttribute(&value, attr, device) == cudaSuccess,
                      "cannot read CUDA device " << device << "'s " << what);
    cache[device].store(value);
  }
  return cache[device].load();
}
}  // namespace

int multiprocessor_count() {
  static std::atomic<int> counts[kMaxDevices] = {};
  return device_attribute(cudaDevAttrMultiProcessorCount, counts, "multiprocessor count");
}

int shared_memory_optin() {
  static std::atomic<int> limits[kMaxDevices] = {};
  return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, limits, "opt-in shared memory per block");
}

}  // namespace cuda
}  // namespace octavo
