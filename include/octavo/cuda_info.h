// Whether this build carries CUDA kernels and how many devices the runtime can see.
#pragma once

namespace octavo {

bool cuda_compiled();      // true when built with OCTAVO_WITH_CUDA
int cuda_device_count();   // 0 without CUDA, without a driver, or on any CUDA error

}  // namespace octavo
