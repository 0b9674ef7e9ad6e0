// Bindings of the kernels (include/octavo/ops.h) into octavo._C.ops, plus the thread-count and
// CPU-ISA controls on octavo._C.
#pragma once

#include <pybind11/pybind11.h>

namespace octavo::python {
void bind_ops(pybind11::module_& m);
}  // namespace octavo::python
