// paged_attention for head size 256 (see attention_kernel.cuh).
#include "attention_kernel.cuh"

namespace octavo::cuda {
OCTAVO_INSTANTIATE_PAGED_ATTENTION(256)
}  // namespace octavo::cuda
