#include "tensor_from_python.h"

#include <string>

#include "dlpack_abi.h"
#include "octavo/status.h"

namespace py = pybind11;

namespace octavo::python {
namespace {

bool to_dtype(const dlpack::DLDataType& t, DType* out) {
  if (t.lanes != 1) return false;
  switch (t.code) {
    case dlpack::kDLFloat:
      if (t.bits == 16) *out = DType::kFloat16;
      else if (t.bits == 32) *out = DType::kFloat32;
      else if (t.bits == 64) *out = DType::kFloat64;
      else return false;
      return true;
    case dlpack::kDLBfloat:
      *out = DType::kBFloat16;
      return t.bits == 16;
    case dlpack::kDLInt:
      if (t.bits == 8) *out = DType::kInt8;
      else if (t.bits == 32) *out = DType::kInt32;
      else if (t.bits == 64) *out = DType::kInt64;
      else return false;
      return true;
    case dlpack::kDLUInt:
      *out = DType::kUInt8;
      return t.bits == 8;
    case dlpack::kDLBool:
      *out = DType::kBool;
      return t.bits == 8;
    case dlpack::kDLFloat8_e4m3fn:
      *out = DType::kFloat8E4M3;
      return t.bits == 8;
    default:
      return false;
  }
}

std::string dtype_code_name(const dlpack::DLDataType& t) {
  static const char* names[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string s = t.code < 7 ? names[t.code] : "code" + std::to_string(t.code) + " bits ";
  s += std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

void check_device_type(int device_type, const char* arg) {
  OCTAVO_CHECK(device_type == dlpack::kDLCPU || device_type == dlpack::kDLCUDA,
               "argument '" << arg << "' is on an unsupported device (DLPack device type " << device_type
                            << "); Octavo accepts CPU and CUDA tensors");
}

// torch.Tensor.__dlpack__ and __dlpack_device__ are Python code that costs ~3 µs per tensor,
// more than a decode-size kernel; torch._C._to_dlpack is the C function behind them (~0.2 µs).
// Returns it when `obj` is a torch tensor (torch already imported), else null.
PyObject* torch_to_dlpack(py::handle obj) {
  static PyObject* tensor_type = nullptr;  // owned references, kept for the process's lifetime
  static PyObject* to_dlpack = nullptr;
  if (!tensor_type) {
    PyObject* torch = PyImport_GetModule(py::str("torch").ptr());
    if (!torch) return nullptr;  // not imported: obj cannot be a torch tensor
    py::object module = py::reinterpret_steal<py::object>(torch);
    py::object c = py::getattr(module, "_C", py::none());
    py::object fn = c.is_none() ? py::object(py::none()) : py::getattr(c, "_to_dlpack", py::none());
    if (fn.is_none()) return nullptr;
    to_dlpack = fn.release().ptr();
    tensor_type = py::object(module.attr("Tensor")).release().ptr();
  }
  return PyObject_IsInstance(obj.ptr(), tensor_type) == 1 ? to_dlpack : nullptr;
}

// The producer's legacy "dltensor" capsule for `obj`. Producers refuse some tensors (read-only
// numpy arrays, torch tensors that require grad); the error names the argument.
py::object export_capsule(py::handle obj, const char* arg) {
  std::string export_error;
  try {
    if (PyObject* fast = torch_to_dlpack(obj)) {
      OCTAVO_CHECK(!obj.attr("requires_grad").cast<bool>(),
                   "argument '" << arg << "' cannot be viewed zero-copy through DLPack: it requires grad; "
                   "pass tensor.detach() (Octavo's ops are not differentiable)");
      return py::reinterpret_borrow<py::object>(fast)(obj);
    }
    OCTAVO_CHECK_TYPE(py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__"),
                      "argument '" << arg << "' must be a torch tensor or numpy array, got "
                                   << Py_TYPE(obj.ptr())->tp_name);
    // Ask for the device first so unsupported devices are refused before anything is exported.
    auto dev = obj.attr("__dlpack_device__")().cast<py::tuple>();
    check_device_type(dev[0].cast<int>(), arg);
    // Without max_version, producers hand out the legacy capsule declared in dlpack_abi.h.
    return obj.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    export_error = e.what();
  }
  OCTAVO_CHECK(false, "argument '" << arg << "' cannot be viewed zero-copy through DLPack: " << export_error);
  return py::object();
}

}  // namespace

PyTensor tensor_view_from_python(py::handle obj, const char* arg) {
  py::object capsule = export_capsule(obj, arg);
  OCTAVO_CHECK(PyCapsule_IsValid(capsule.ptr(), "dltensor"),
               "argument '" << arg << "': __dlpack__ did not return an unused 'dltensor' capsule");
  auto* managed = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const dlpack::DLTensor& t = managed->dl_tensor;
  check_device_type(t.device.device_type, arg);

  PyTensor out;
  TensorView& v = out.view;
  OCTAVO_CHECK_TYPE(to_dtype(t.dtype, &v.dtype), "argument '" << arg << "' has unsupported dtype "
                                                              << dtype_code_name(t.dtype)
                                                              << "; Octavo accepts float16/32/64, bfloat16, "
                                                                 "float8_e4m3fn, int8/32/64, uint8 and bool");
  OCTAVO_CHECK(t.ndim >= 0 && t.ndim <= TensorView::kMaxDims,
               "argument '" << arg << "' has " << t.ndim << " dimensions; at most " << TensorView::kMaxDims
                            << " are supported");
  v.device.type = t.device.device_type == dlpack::kDLCUDA ? DeviceType::kCUDA : DeviceType::kCPU;
  v.device.index = v.device.type == DeviceType::kCUDA ? t.device.device_id : 0;
  v.ndim = t.ndim;
  int64_t expected_stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides ? t.strides[i] : expected_stride;  // NULL strides mean row-major
    expected_stride *= t.shape[i];
  }
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  // The capsule keeps its name, so its destructor calls the producer's deleter when we drop it.
  out.capsule = std::move(capsule);
  return out;
}

}  // namespace octavo::python
