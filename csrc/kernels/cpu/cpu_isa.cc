#include "octavo/cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "octavo/cpu_features.h"
#include "octavo/status.h"

namespace octavo {
namespace {

CpuIsa initial_isa() {
  if (const char* env = std::getenv("OCTAVO_CPU_ISA")) {
    for (CpuIsa isa : kAllCpuIsas) {
      if (std::strcmp(env, cpu_isa_name(isa)) == 0 && cpu_isa_supported(isa)) return isa;
    }
  }
  return best_cpu_isa();
}

std::atomic<CpuIsa>& active() {
  static std::atomic<CpuIsa> isa{initial_isa()};
  return isa;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "unknown";
}

bool cpu_isa_compiled(CpuIsa isa) {
#if OCTAVO_CPU_X86_ISAS
  return isa != CpuIsa::kAmx || OCTAVO_CPU_AMX;
#else
  return isa == CpuIsa::kScalar;
#endif
}

bool cpu_isa_supported(CpuIsa isa) {
  if (!cpu_isa_compiled(isa)) return false;
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512: return avx2 && f.avx512f && f.avx512bw && f.avx512vl;
    // Every CPU with AVX512_BF16 has AVX512_VNNI too (Cooper Lake, Sapphire Rapids, Zen 4 on).
    case CpuIsa::kAvx512Bf16:
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16 && f.avx512_vnni;
    case CpuIsa::kAmx:
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16 && f.avx512_vnni && f.amx_bf16 &&
             f.amx_int8;
  }
  return false;
}

CpuIsa best_cpu_isa() {
  CpuIsa best = CpuIsa::kScalar;
  for (CpuIsa isa : kAllCpuIsas) {
    if (cpu_isa_supported(isa)) best = isa;
  }
  return best;
}

CpuIsa active_cpu_isa() { return active().load(std::memory_order_relaxed); }

void set_cpu_isa(CpuIsa isa) {
  OCTAVO_CHECK(cpu_isa_supported(isa), "CPU ISA '" << cpu_isa_name(isa) << "' is not supported on this machine"
                                           << (cpu_isa_compiled(isa) ? "" : " (not compiled into this build)"));
  active().store(isa, std::memory_order_relaxed);
}

}  // namespace octavo
