// A recorded sequence of kernel calls replayed without Python: the CPU's counterpart of a CUDA
// graph. A decode step of a small model makes a few hundred kernel calls of a few microseconds
// each; through Python each costs as much again in argument parsing, module calls and
// allocations. While a graph records (on the thread that called begin_capture), each op binding
// runs its kernel as usual and also keeps the call: its tensor views and, through their DLPack
// capsules, the tensors themselves, so that the memory they name stays put for every replay.
// A replay calls the kernels again in order on whatever those tensors hold then.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <utility>
#include <vector>

namespace octavo::python {

class OpGraph {
 public:
  OpGraph() = default;
  OpGraph(const OpGraph&) = delete;
  OpGraph& operator=(const OpGraph&) = delete;
  ~OpGraph();  // stops a recording it is the target of, so that no op records into freed memory
  void add(std::function<void()> call) { calls_.push_back(std::move(call)); }
  void replay() const {
    for (const auto& call : calls_) call();
  }
  size_t size() const { return calls_.size(); }
  bool recorded = false;  // set when its recording ends: a graph records once

 private:
  // Each call owns PyTensors (Python objects): the graph is destroyed with the GIL held, as
  // pybind11 does for the objects it wraps.
  std::vector<std::function<void()>> calls_;
};

// The graph this thread is recording into, or null.
OpGraph* recording_graph();

// Runs an op binding's kernel call with the GIL released; while this thread records a graph,
// the call (which holds its PyTensors by value) is kept in it too.
template <typename Call>
void run_op(Call call) {
  {
    pybind11::gil_scoped_release nogil;
    call();
  }
  if (OpGraph* graph = recording_graph()) graph->add(std::function<void()>(std::move(call)));
}

// sample and rejection_sample raise while a graph records: their results go back to Python
// every step, which a replay would not do.
void refuse_while_recording(const char* op);

void bind_op_graph(pybind11::module_& m);

}  // namespace octavo::python
