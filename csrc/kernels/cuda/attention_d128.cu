// paged_attention for head size 128 (see attention_kernel.cuh).
#include "attention_kernel.cuh"

namespace octavo::cuda {
OCTAVO_INSTANTIATE_PAGED_ATTENTION(128)
}  // namespace octavo::cuda
