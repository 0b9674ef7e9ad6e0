#include "octavo/cpu_features.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define OCTAVO_X86 1
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace octavo {
namespace {

#ifdef OCTAVO_X86
bool bit(uint32_t reg, int n) { return (reg >> n) & 1u; }

// Linux saves AMX tile data only for processes that ask for it (since 5.16): without this a tile
// instruction faults. Asked once per process, before any thread runs tiles.
bool os_grants_amx() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// XCR0: which register states the OS saves on context switch. Inline asm so that this file
// needs no -mxsave (the build must not assume the build machine's CPU).
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  uint32_t a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = bit(c, 27), avx = bit(c, 28), fma = bit(c, 12), f16c = bit(c, 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr = xcr0();
  const bool os_avx = (xcr & 0x6) == 0x6;           // XMM + YMM state
  const bool os_avx512 = (xcr & 0xE6) == 0xE6;      // + opmask, ZMM0-15 upper, ZMM16-31
  const bool os_amx = (xcr & 0x60000) == 0x60000;   // XTILECFG + XTILEDATA
  if (!os_avx) return f;
  f.fma = fma;
  f.f16c = f16c;

  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const uint32_t max_subleaf = a;
  f.avx2 = bit(b, 5);
  if (os_avx512) {
    f.avx512f = bit(b, 16);
    f.avx512bw = f.avx512f && bit(b, 30);
    f.avx512vl = f.avx512f && bit(b, 31);
    f.avx512_vnni = f.avx512f && bit(c, 11);
  }
  const bool amx_tile = os_amx && bit(d, 24) && os_grants_amx();
  f.amx_bf16 = amx_tile && bit(d, 22);
  f.amx_int8 = amx_tile && bit(d, 25);
  if (max_subleaf >= 1 && f.avx512f) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = bit(a, 5);
  }
  return f;
}
#else
CpuFeatures detect() { return {}; }  // non-x86: only the scalar / portable paths apply
#endif

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace octavo
