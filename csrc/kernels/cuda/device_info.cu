#include <cuda_runtime.h>

#include "octavo/cuda_info.h"

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

}  // namespace octavo
