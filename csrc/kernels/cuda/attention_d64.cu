// paged_attention for head size 64: the split-KV kernel (attention_kernel.cuh) and the
// tensor-core prefill kernel (prefill_attention_kernel.cuh).
#include "attention_kernel.cuh"
#include "prefill_attention_kernel.cuh"

namespace octavo::cuda {
OCTAVO_INSTANTIATE_PAGED_ATTENTION(64)
OCTAVO_INSTANTIATE_PREFILL_ATTENTION(64)
}  // namespace octavo::cuda
