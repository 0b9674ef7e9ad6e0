// Instruction-set extensions of the CPU we are running on, detected once at run time
// (cpuid + xgetbv), so one binary picks the best kernel on every machine. Each flag is true only
// if the CPU has the feature AND the OS saves the registers it needs.
#pragma once

namespace octavo {

struct CpuFeatures {
  bool avx2 = false;         // 256-bit integer SIMD
  bool fma = false;          // fused multiply-add (FMA3)
  bool f16c = false;         // float16 <-> float32 conversions
  bool avx512f = false;      // 512-bit foundation
  bool avx512bw = false;     // 512-bit byte/word ops
  bool avx512vl = false;     // AVX-512 ops on 128/256-bit registers
  bool avx512_bf16 = false;  // bf16 dot products (vdpbf16ps)
  bool avx512_vnni = false;  // int8 dot products (vpdpbusd)
  bool amx_bf16 = false;     // AMX tiles with bf16 (on Linux: and the process was granted tile state)
  bool amx_int8 = false;     // AMX tiles with int8 (the same grant)
};

// Detected on first call; cheap afterwards.
const CpuFeatures& cpu_features();

}  // namespace octavo
