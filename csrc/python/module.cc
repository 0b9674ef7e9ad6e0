// octavo._C: the one place where C++ meets Python. Core errors become Python exceptions here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bind_core.h"
#include "bind_ops.h"
#include "op_graph.h"
#include "octavo/cpu_features.h"
#include "octavo/cuda_info.h"
#include "octavo/status.h"
#include "tensor_from_python.h"

namespace py = pybind11;

namespace {

void translate_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const octavo::Error& e) {
    switch (e.kind()) {
      case octavo::ErrorKind::kValue: PyErr_SetString(PyExc_ValueError, e.what()); return;
      case octavo::ErrorKind::kType: PyErr_SetString(PyExc_TypeError, e.what()); return;
      case octavo::ErrorKind::kIndex: PyErr_SetString(PyExc_IndexError, e.what()); return;
      case octavo::ErrorKind::kRuntime: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
    }
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

py::dict cpu_features_dict() {
  const octavo::CpuFeatures& f = octavo::cpu_features();
  py::dict d;
  d["avx2"] = f.avx2;
  d["fma"] = f.fma;
  d["f16c"] = f.f16c;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512_bf16"] = f.avx512_bf16;
  d["avx512_vnni"] = f.avx512_vnni;
  d["amx_bf16"] = f.amx_bf16;
  d["amx_int8"] = f.amx_int8;
  return d;
}

// What Octavo sees of a tensor; tests compare it with the producer's own view to prove zero copy.
py::dict describe_tensor(py::handle obj, const std::string& name) {
  octavo::python::PyTensor t = octavo::python::tensor_view_from_python(obj, name.c_str());
  const octavo::TensorView& v = t.view;
  py::tuple shape(v.ndim), strides(v.ndim);
  for (int i = 0; i < v.ndim; ++i) {
    shape[i] = v.shape[i];
    strides[i] = v.strides[i];
  }
  py::dict d;
  d["data_ptr"] = reinterpret_cast<std::uintptr_t>(v.data);
  d["dtype"] = octavo::dtype_name(v.dtype);
  d["device"] = octavo::device_name(v.device.type);
  d["device_index"] = v.device.index;
  d["shape"] = shape;
  d["strides"] = strides;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Octavo native core and kernels";
  py::register_exception_translator(&translate_error);
  m.attr("__version__") = OCTAVO_VERSION;

  m.def("cpu_features", &cpu_features_dict, "Instruction-set extensions detected on this CPU, as a dict of bools.");
  m.def("cuda_compiled", &octavo::cuda_compiled, "True if this build carries CUDA kernels.");
  m.def("cuda_device_count", &octavo::cuda_device_count,
        "Number of CUDA devices visible to Octavo; 0 without CUDA support, a driver or a GPU.");
  // Streams cross as integers (torch.cuda.Stream.cuda_stream), 0 being the legacy default stream.
  m.def(
      "set_cuda_stream", [](uintptr_t stream) { octavo::set_cuda_stream(reinterpret_cast<void*>(stream)); },
      py::arg("stream"),
      "Makes `stream` (a cudaStream_t as an int, e.g. torch.cuda.current_stream().cuda_stream) the stream "
      "this thread's CUDA ops launch on.");
  m.def(
      "cuda_stream", [] { return reinterpret_cast<uintptr_t>(octavo::cuda_stream()); },
      "The stream this thread's CUDA ops launch on, as an int (0: the legacy default stream).");

  m.def(
      "reserve_cuda_workspaces",
      [](int64_t max_tokens, int64_t max_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
         int64_t max_blocks_per_seq, int64_t block_size, int64_t vocab_size) {
        return octavo::reserve_cuda_workspaces({max_tokens, max_seqs, num_heads, num_kv_heads, head_size,
                                                max_blocks_per_seq, block_size, vocab_size});
      },
      py::arg("max_tokens"), py::arg("max_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_size"),
      py::arg("max_blocks_per_seq"), py::arg("block_size"), py::arg("vocab_size"),
      "Allocates on the current CUDA device every kernel workspace a step within these limits can need, at its "
      "largest size (no such step allocates outside torch afterwards); returns the bytes held.");
  m.def(
      "cuda_workspace_stats",
      [] {
        const octavo::CudaWorkspaceStats s = octavo::cuda_workspace_stats();
        py::dict d;
        d["bytes"] = s.bytes;
        d["allocations"] = s.allocations;
        return d;
      },
      "{'bytes': workspace bytes held on the current CUDA device, 'allocations': workspace allocations so far}.");

  octavo::python::bind_core(m);
  octavo::python::bind_ops(m);
  octavo::python::bind_op_graph(m);

  py::module_ testing = m.def_submodule("testing", "Internals exposed for Octavo's own tests.");
  testing.def("describe_tensor", &describe_tensor, py::arg("t"), py::arg("name") = "tensor",
              "Views `t` through DLPack and returns {data_ptr, dtype, device, device_index, shape, strides}.");
}
