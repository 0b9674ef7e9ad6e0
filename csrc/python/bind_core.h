// Bindings of the native core (block pool, KV cache manager, scheduler) into octavo._C.
#pragma once

#include <pybind11/pybind11.h>

namespace octavo::python {
void bind_core(pybind11::module_& m);
}  // namespace octavo::python
