// Whether this build carries CUDA kernels, how many devices the runtime can see, and the stream
// the calling thread launches Octavo's CUDA kernels on.
#pragma once

namespace octavo {

bool cuda_compiled();      // true when built with OCTAVO_WITH_CUDA
int cuda_device_count();   // 0 without CUDA, without a driver, or on any CUDA error

// The cudaStream_t this host thread's CUDA ops run on (null: the legacy default stream, the
// initial value). Python sets it to torch's current stream; a CUDA graph capture needs it set to
// the capturing stream. Without CUDA, set_cuda_stream accepts only null.
void set_cuda_stream(void* stream);
void* cuda_stream();

}  // namespace octavo
