// Marks a small function for both the host and CUDA device code when nvcc compiles it, so that
// the CPU and CUDA kernels share one definition of what must agree between them.
#pragma once

#ifdef __CUDACC__
#define OCTAVO_HOST_DEVICE __host__ __device__
#else
#define OCTAVO_HOST_DEVICE
#endif
