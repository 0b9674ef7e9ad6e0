// Built instead of the CUDA sources when CUDA is disabled: no devices, and every CUDA launcher
// explains that this build has none (a CUDA tensor can still reach an op through torch).
#include "cuda/cuda_kernels.h"
#include "octavo/cuda_info.h"
#include "octavo/status.h"

namespace octavo {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }

void set_cuda_stream(void* stream) {
  OCTAVO_CHECK(stream == nullptr, "this build of Octavo has no CUDA kernels (it was configured without nvcc)");
}
void* cuda_stream() { return nullptr; }

size_t reserve_cuda_workspaces(const CudaStepLimits&) {
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, false,
                    "reserve_cuda_workspaces: this build of Octavo has no CUDA kernels (it was configured without "
                    "nvcc)");
  return 0;
}
CudaWorkspaceStats cuda_workspace_stats() { return {0, 0}; }

namespace cuda {
namespace {
[[noreturn]] void no_cuda(const char* op) {
  OCTAVO_CHECK_KIND(ErrorKind::kRuntime, false,
                    op << ": got CUDA tensors, but this build of Octavo has no CUDA kernels (it was configured "
                          "without nvcc); rebuild with the CUDA toolkit installed, or move the tensors to the CPU");
  __builtin_unreachable();
}
}  // namespace

int current_device() { no_cuda("a CUDA op"); }
void rms_norm(const RmsNormParams&) { no_cuda("rms_norm"); }
void rotary_embedding(const RotaryParams&) { no_cuda("rotary_embedding"); }
void silu_and_mul(const GatedActivationParams&) { no_cuda("silu_and_mul"); }
void gelu_and_mul(const GatedActivationParams&, GeluApproximation) { no_cuda("gelu_and_mul"); }
void reshape_and_cache(const CacheWriteParams&) { no_cuda("reshape_and_cache"); }
void paged_attention(const PagedAttentionParams&) { no_cuda("paged_attention"); }
void apply_token_bitmask(const TokenBitmaskParams&) { no_cuda("apply_token_bitmask"); }
void sample(const SampleParams&) { no_cuda("sample"); }
void linear(const LinearParams&) { no_cuda("linear"); }
void dequantize(const LinearParams&) { no_cuda("dequantize"); }
void topk_softmax(const TopkParams&) { no_cuda("topk_softmax"); }
void moe_align(const MoeAlignParams&) { no_cuda("moe_align"); }
void fused_moe(const FusedMoeParams&) { no_cuda("fused_moe"); }

}  // namespace cuda
}  // namespace octavo
