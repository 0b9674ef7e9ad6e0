// Built instead of cuda/device_info.cu when CUDA is disabled.
#include "octavo/cuda_info.h"

namespace octavo {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }

}  // namespace octavo
