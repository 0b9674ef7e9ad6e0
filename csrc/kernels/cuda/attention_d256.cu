// paged_attention for head size 256: the split-KV decode kernel (attention_kernel.cuh), the
// tensor-core decode kernel for large GQA groups (grouped_decode_kernel.cuh) and the tensor-core
// prefill kernel (prefill_attention_kernel.cuh).
#include "attention_kernel.cuh"
#include "grouped_decode_kernel.cuh"
#include "prefill_attention_kernel.cuh"

namespace octavo::cuda {
OCTAVO_INSTANTIATE_PAGED_ATTENTION(256)
OCTAVO_INSTANTIATE_GROUPED_DECODE(256)
OCTAVO_INSTANTIATE_PREFILL_ATTENTION(256)
}  // namespace octavo::cuda
