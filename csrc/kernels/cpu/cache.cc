// PLACEHOLDER (being written): throws until the kernel lands.
#include "isa_kernels.h"
#include "octavo/status.h"
#include "vec.h"

namespace octavo::cpu::OCTAVO_ISA {
void reshape_and_cache(const CacheWriteParams&) { OCTAVO_CHECK(false, "not implemented"); }
}  // namespace octavo::cpu::OCTAVO_ISA
