// apply_token_bitmask: one thread per logit, a 2-D grid (x: 256-token blocks of the row, y:
// bitmask rows, striding past the grid's limit); the threads of a warp share one mask word. A row
// index outside the batch is skipped (the host cannot check CUDA indices).
#include "common.cuh"
#include "cuda_kernels.h"

namespace octavo::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

__global__ void token_bitmask_kernel(TokenBitmaskParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.vocab_size) return;
  for (int64_t i = blockIdx.y; i < p.num_rows; i += gridDim.y) {
    const int64_t r = p.indices ? p.indices[i] : i;
    if (r < 0 || r >= p.batch_rows) continue;
    const uint32_t bits = static_cast<uint32_t>(p.bitmask[i * p.words + t / 32]);
    if (!((bits >> (t % 32)) & 1u)) p.logits[r * p.logits_stride + t] = -INFINITY;
  }
}

}  // namespace

void apply_token_bitmask(const TokenBitmaskParams& p) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.vocab_size, kThreads)),
                  static_cast<unsigned>(p.num_rows < kMaxGridY ? p.num_rows : kMaxGridY));
  launch_kernel(token_bitmask_kernel, grid, kThreads, 0, p);
  check_launch("apply_token_bitmask");
}

}  // namespace octavo::cuda
