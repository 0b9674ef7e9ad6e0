// Zero-copy view of a Python tensor (torch, numpy, anything with __dlpack__) as an
// octavo::TensorView, without linking torch.
#pragma once

#include <pybind11/pybind11.h>

#include "octavo/tensor_view.h"

namespace octavo::python {

// The view plus the DLPack capsule that keeps the producer's memory (and its shape/stride
// arrays) alive. Use `view` only while this object lives.
struct PyTensor {
  pybind11::object capsule;
  TensorView view;
};

// Raises TypeError (not a tensor, unsupported dtype) or ValueError (unsupported device, too many
// dimensions), naming `arg` in the message.
PyTensor tensor_view_from_python(pybind11::handle obj, const char* arg);

}  // namespace octavo::python
