// paged_attention for head size 64 (see attention_kernel.cuh).
#include "attention_kernel.cuh"

namespace octavo::cuda {
OCTAVO_INSTANTIATE_PAGED_ATTENTION(64)
}  // namespace octavo::cuda
