// The CPU launchers, declared once per compiled ISA level (vec.h explains why each level has
// its own namespace), and cpu_dispatch(), which calls the level active_cpu_isa() names.
#pragma once

#include "octavo/cpu_isa.h"
#include "octavo/ops.h"
#include "params.h"

#define OCTAVO_DECLARE_CPU_KERNELS(isa)                                  \
  namespace octavo::cpu::isa {                                           \
  void rms_norm(const RmsNormParams& p);                                 \
  void rotary_embedding(const RotaryParams& p);                          \
  void silu_and_mul(const GatedActivationParams& p);                     \
  void gelu_and_mul(const GatedActivationParams& p, GeluApproximation approximate); \
  void reshape_and_cache(const CacheWriteParams& p);                     \
  void paged_attention(const PagedAttentionParams& p);                   \
  void sample(const SampleParams& p);                                    \
  void apply_token_bitmask(const TokenBitmaskParams& p);                 \
  void linear(const LinearParams& p);                                    \
  void dequantize(const LinearParams& p);                                \
  bool linear_keeps_bf16(const LinearParams& p);                         \
  void topk_softmax(const TopkParams& p);                                \
  void moe_align(const MoeAlignParams& p);                               \
  void fused_moe(const FusedMoeParams& p);                               \
  }

OCTAVO_DECLARE_CPU_KERNELS(scalar)
#if OCTAVO_CPU_X86_ISAS
OCTAVO_DECLARE_CPU_KERNELS(avx2)
OCTAVO_DECLARE_CPU_KERNELS(avx512)
OCTAVO_DECLARE_CPU_KERNELS(avx512_bf16)
#endif
#if OCTAVO_CPU_AMX
OCTAVO_DECLARE_CPU_KERNELS(amx)
#endif

#if OCTAVO_CPU_AMX
#define OCTAVO_AMX_CASE(fn, ...) \
  case ::octavo::CpuIsa::kAmx: ::octavo::cpu::amx::fn(__VA_ARGS__); break;
#else
#define OCTAVO_AMX_CASE(fn, ...)
#endif

// cpu_dispatch(rms_norm, params) -> octavo::cpu::<active isa>::rms_norm(params)
#if OCTAVO_CPU_X86_ISAS
#define cpu_dispatch(fn, ...)                                                   \
  do {                                                                          \
    switch (::octavo::active_cpu_isa()) {                                       \
      OCTAVO_AMX_CASE(fn, __VA_ARGS__)                                          \
      case ::octavo::CpuIsa::kAvx512Bf16: ::octavo::cpu::avx512_bf16::fn(__VA_ARGS__); break; \
      case ::octavo::CpuIsa::kAvx512: ::octavo::cpu::avx512::fn(__VA_ARGS__); break; \
      case ::octavo::CpuIsa::kAvx2: ::octavo::cpu::avx2::fn(__VA_ARGS__); break; \
      default: ::octavo::cpu::scalar::fn(__VA_ARGS__); break;                   \
    }                                                                           \
  } while (0)
#else
#define cpu_dispatch(fn, ...) ::octavo::cpu::scalar::fn(__VA_ARGS__)
#endif
