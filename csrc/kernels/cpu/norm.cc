// PLACEHOLDER (being written): throws until the kernel lands.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
void rms_norm(const RmsNormParams&) { OCTAVO_CHECK(false, "rms_norm: not implemented"); }
}  // namespace octavo::cpu::OCTAVO_ISA
