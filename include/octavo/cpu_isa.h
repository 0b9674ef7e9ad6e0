// Which compiled variant of the CPU kernels runs. Every kernel source is compiled once per ISA
// level (csrc/kernels/CMakeLists.txt); the best level this CPU supports is chosen at run time,
// so one binary runs everywhere and never assumes the build machine's CPU.
#pragma once

namespace octavo {

enum class CpuIsa {
  kScalar,  // portable C++; the reference every other level is tested against
  kAvx2,    // AVX2 + FMA + F16C, 8 floats per vector
  kAvx512,  // AVX-512 F/BW/VL (+ the AVX2 set), 16 floats per vector
  kAvx512Bf16,  // AVX-512 + AVX512_BF16 and AVX512_VNNI: bfloat16 conversions, int8 dot products
  kAmx,  // + AMX-TILE and AMX-BF16 (the OS granting tile state): bfloat16 tile products in linear
};
// Lowest to highest.
constexpr CpuIsa kAllCpuIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16,
                                   CpuIsa::kAmx};

const char* cpu_isa_name(CpuIsa isa);  // "scalar", "avx2", "avx512", "avx512_bf16", "amx"
bool cpu_isa_compiled(CpuIsa isa);     // built into this binary (x86 levels only on x86-64)
bool cpu_isa_supported(CpuIsa isa);    // compiled and this CPU + OS can run it
CpuIsa best_cpu_isa();                 // the highest supported level
// The level kernels use now: best_cpu_isa(), or OCTAVO_CPU_ISA=scalar|avx2|avx512 when set to a
// supported level (OCTAVO_CPU_ISA=avx512_bf16 or amx too). set_cpu_isa() changes it (tests run every level); unsupported -> ValueError.
CpuIsa active_cpu_isa();
void set_cpu_isa(CpuIsa isa);

}  // namespace octavo
