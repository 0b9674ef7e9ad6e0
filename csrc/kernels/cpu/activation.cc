// PLACEHOLDER (being written): throws until the kernel lands.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
void silu_and_mul(const GatedActivationParams&) { OCTAVO_CHECK(false, "not implemented"); }
void gelu_and_mul(const GatedActivationParams&, GeluApproximation) { OCTAVO_CHECK(false, "not implemented"); }
}  // namespace octavo::cpu::OCTAVO_ISA
