// parallel_for over a lambda, for per-ISA kernel sources: the trampoline is instantiated per
// lambda type inside the ISA namespace, so nothing compiled with wide-vector flags is shared.
#pragma once

#include <cstdint>

#include "octavo/threading.h"

#ifndef OCTAVO_ISA
#error "parallel.h is for per-ISA kernel sources; the build defines OCTAVO_ISA"
#endif

namespace octavo::cpu::OCTAVO_ISA {

// fn(begin, end) over chunks of [0, n) of at most `grain` items.
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, const Fn& fn) {
  ::octavo::parallel_for(
      n, grain, [](void* ctx, int64_t begin, int64_t end) { (*static_cast<const Fn*>(ctx))(begin, end); },
      const_cast<void*>(static_cast<const void*>(&fn)));
}

// Items per parallel_for chunk, for `items` of `item_elems` elements each: all of them on the
// calling thread when the whole job is below `serial_elems` (waking the pool would cost about as
// much as it saves), else chunks of at least `min_chunk_elems` elements.
inline int64_t grain_for(int64_t items, int64_t item_elems, int64_t serial_elems, int64_t min_chunk_elems) {
  if (items * item_elems < serial_elems) return items > 0 ? items : 1;
  return item_elems >= min_chunk_elems ? 1 : min_chunk_elems / item_elems;
}

}  // namespace octavo::cpu::OCTAVO_ISA
