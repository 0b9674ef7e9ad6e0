#include "op_graph.h"

#include "octavo/status.h"

namespace py = pybind11;

namespace octavo::python {
namespace {
thread_local OpGraph* t_recording = nullptr;
}  // namespace

OpGraph* recording_graph() { return t_recording; }

OpGraph::~OpGraph() {
  if (t_recording == this) t_recording = nullptr;
}

void refuse_while_recording(const char* op) {
  OCTAVO_CHECK(t_recording == nullptr, op << " cannot be recorded in an OpGraph");
}

void bind_op_graph(py::module_& m) {
  py::class_<OpGraph>(m, "OpGraph",
                      "Kernel calls recorded between begin_capture and end_capture on one thread, replayed in "
                      "order without Python. The recorded calls keep their tensors alive and read and write "
                      "them again at each replay: refill inputs in place, read outputs from the same tensors.")
      .def(py::init<>())
      .def("begin_capture",
           [](OpGraph& g) {
             OCTAVO_CHECK(t_recording == nullptr, "this thread is already recording an OpGraph");
             OCTAVO_CHECK(!g.recorded, "an OpGraph records once");
             t_recording = &g;
           },
           "Starts recording this thread's kernel calls into the graph (they still run).")
      .def("end_capture",
           [](OpGraph& g) {
             OCTAVO_CHECK(t_recording == &g, "this graph is not recording on this thread");
             t_recording = nullptr;
             g.recorded = true;
           },
           "Stops recording.")
      .def("replay", &OpGraph::replay, py::call_guard<py::gil_scoped_release>(),
           "Runs the recorded calls again, in order.")
      .def("__len__", &OpGraph::size);
}

}  // namespace octavo::python
