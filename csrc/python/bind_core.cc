// Python bindings of the block pool and the scheduler. The scheduler's per-step arrays are
// returned as numpy views of its own buffers (no copies): they keep the scheduler alive and
// hold this step's values until the next schedule(), update_from_output() or abort_requests()
// changes them; copy what must outlive that.
#include "bind_core.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "octavo/block_pool.h"
#include "octavo/ngram_proposer.h"
#include "octavo/scheduler.h"
#include "octavo/status.h"
#include "tensor_from_python.h"

namespace py = pybind11;

namespace octavo::python {

namespace {

// A read-only 1-D numpy view of a buffer owned by `owner`.
template <typename T>
py::array view_1d(const std::vector<T>& v, py::handle owner) {
  py::array a(py::dtype::of<T>(), {static_cast<py::ssize_t>(v.size())}, {static_cast<py::ssize_t>(sizeof(T))},
              v.data(), owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

SchedulingPolicy parse_policy(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::kFcfs;
  if (name == "priority") return SchedulingPolicy::kPriority;
  OCTAVO_CHECK(false, "policy must be 'fcfs' or 'priority', got '" << name << "'");
  return SchedulingPolicy::kFcfs;
}

const char* status_name(RequestStatus status) {
  switch (status) {
    case RequestStatus::kWaiting: return "waiting";
    case RequestStatus::kRunning: return "running";
    case RequestStatus::kPreempted: return "preempted";
    case RequestStatus::kFinished: return "finished";
  }
  return "unknown";
}

// Sampled token ids as int32: a view of the caller's memory when it is int32 already, else a
// converted copy in `scratch` (int64 is what torch.argmax returns).
const int32_t* sampled_tokens(py::handle obj, const char* arg, int64_t expected_len, std::vector<int32_t>& scratch) {
  PyTensor t = tensor_view_from_python(obj, arg);
  check_device(t.view, arg, DeviceType::kCPU);
  check_ndim(t.view, arg, 1);
  check_size(t.view, arg, 0, expected_len);
  check_contiguous(t.view, arg);
  if (t.view.dtype == DType::kInt32) return t.view.data_as<int32_t>();
  OCTAVO_CHECK_TYPE(t.view.dtype == DType::kInt64,
                    "argument '" << arg << "' must have dtype int32 or int64, got " << dtype_name(t.view.dtype));
  const int64_t* src = t.view.data_as<int64_t>();
  scratch.assign(src, src + expected_len);
  return scratch.data();
}

py::dict prefix_cache_stats(const BlockPool& pool) {
  py::dict d;
  d["requests"] = pool.stats().requests;
  d["queries"] = pool.stats().queries;
  d["hits"] = pool.stats().hits;
  return d;
}

void bind_block_pool(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool", "Paged KV blocks with reference counts, LRU free queue and prefix cache.")
      .def(py::init<int, int, bool>(), py::arg("num_blocks"), py::arg("block_size") = 16,
           py::arg("enable_caching") = true)
      .def_property_readonly_static("null_block", [](py::object) { return BlockPool::kNullBlock; })
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def_property_readonly("num_used_blocks", &BlockPool::num_used_blocks)
      .def_property_readonly("num_cached_blocks", &BlockPool::num_cached_blocks)
      .def_property_readonly("usage", &BlockPool::usage)
      .def("allocate", [](BlockPool& p, int n) { std::vector<int32_t> out; p.allocate(n, out); return out; })
      .def("touch", [](BlockPool& p, const std::vector<int32_t>& ids) { p.touch(ids.data(), static_cast<int>(ids.size())); })
      .def("release", [](BlockPool& p, const std::vector<int32_t>& ids) { p.release(ids.data(), static_cast<int>(ids.size())); })
      .def("ref_count", &BlockPool::ref_count)
      .def("is_cached", &BlockPool::is_cached)
      .def("free_queue", &BlockPool::free_queue)
      .def("reset_prefix_cache", &BlockPool::reset_prefix_cache);
  m.def("hash_block_tokens", [](uint64_t parent, const std::vector<int32_t>& tokens, uint64_t extra_key) {
    return hash_block_tokens(parent, tokens.data(), static_cast<int>(tokens.size()), extra_key);
  }, py::arg("parent_hash"), py::arg("tokens"), py::arg("extra_key") = 0);
  m.def("propose_ngram", [](const std::vector<int32_t>& tokens, int min_n, int max_n, int num_tokens,
                            int max_model_len) {
    NgramConfig config{min_n, max_n, num_tokens, max_model_len};
    config.validate();
    return propose_ngram(tokens.data(), static_cast<int>(tokens.size()), config);
  }, py::arg("tokens"), py::arg("min_n"), py::arg("max_n"), py::arg("num_tokens"), py::arg("max_model_len") = 0,
        "Prompt lookup (ngram speculative decoding): the draft that follows the earliest earlier occurrence of the "
        "longest n-gram (min_n <= n <= max_n) ending tokens; see include/octavo/ngram_proposer.h.");
}

void bind_config(py::module_& m) {
  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init([](int num_blocks, int block_size, int max_model_len, int max_num_seqs, int max_num_batched_tokens,
                       bool enable_chunked_prefill, bool enable_prefix_caching, int max_num_partial_prefills,
                       int long_prefill_token_threshold, int num_lookahead_tokens, const std::string& policy,
                       std::vector<int32_t> kv_group_windows) {
             SchedulerConfig c;
             c.num_blocks = num_blocks;
             c.block_size = block_size;
             c.max_model_len = max_model_len;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.enable_chunked_prefill = enable_chunked_prefill;
             c.enable_prefix_caching = enable_prefix_caching;
             c.max_num_partial_prefills = max_num_partial_prefills;
             c.long_prefill_token_threshold = long_prefill_token_threshold;
             c.num_lookahead_tokens = num_lookahead_tokens;
             c.policy = parse_policy(policy);
             c.kv_group_windows = std::move(kv_group_windows);
             c.validate();
             return c;
           }),
           py::kw_only(), py::arg("num_blocks"), py::arg("block_size") = 16, py::arg("max_model_len") = 2048,
           py::arg("max_num_seqs") = 256, py::arg("max_num_batched_tokens") = 2048,
           py::arg("enable_chunked_prefill") = true, py::arg("enable_prefix_caching") = true,
           py::arg("max_num_partial_prefills") = 1, py::arg("long_prefill_token_threshold") = 0,
           py::arg("num_lookahead_tokens") = 0, py::arg("policy") = "fcfs",
           py::arg("kv_group_windows") = std::vector<int32_t>{})
      .def_readonly("num_blocks", &SchedulerConfig::num_blocks)
      .def_readonly("block_size", &SchedulerConfig::block_size)
      .def_readonly("max_model_len", &SchedulerConfig::max_model_len)
      .def_readonly("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readonly("enable_chunked_prefill", &SchedulerConfig::enable_chunked_prefill)
      .def_readonly("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readonly("max_num_partial_prefills", &SchedulerConfig::max_num_partial_prefills)
      .def_readonly("long_prefill_token_threshold", &SchedulerConfig::long_prefill_token_threshold)
      .def_readonly("num_lookahead_tokens", &SchedulerConfig::num_lookahead_tokens)
      .def_readonly("kv_group_windows", &SchedulerConfig::kv_group_windows)
      .def_property_readonly("policy", [](const SchedulerConfig& c) {
        return c.policy == SchedulingPolicy::kPriority ? "priority" : "fcfs";
      });
}

// A read-only C-contiguous int32 array over `data`, kept alive by `owner`.
py::array read_only_view(py::object owner, const int32_t* data, std::vector<int> shape) {
  std::vector<py::ssize_t> dims(shape.begin(), shape.end()), strides(shape.size());
  py::ssize_t stride = sizeof(int32_t);
  for (size_t i = shape.size(); i-- > 0;) strides[i] = stride, stride *= std::max<py::ssize_t>(1, dims[i]);
  py::array a(py::dtype::of<int32_t>(), dims, strides, data, owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

template <typename T, typename Owner>
void def_array(py::class_<Owner>& cls, const char* name, std::vector<T> Owner::*field, const char* doc) {
  cls.def_property_readonly(name, [field](py::object self) { return view_1d(self.cast<const Owner&>().*field, self); }, doc);
}

void bind_outputs(py::module_& m) {
  py::class_<SchedulerOutput> out(m, "SchedulerOutput", "One step's batch as flat arrays (views, valid until the next step).");
  def_array(out, "req_handles", &SchedulerOutput::req_handles, "[R] int64, batch order");
  def_array(out, "num_scheduled_tokens", &SchedulerOutput::num_scheduled_tokens, "[R] int32");
  def_array(out, "num_computed_tokens", &SchedulerOutput::num_computed_tokens, "[R] int32, KV tokens before this step");
  def_array(out, "is_new", &SchedulerOutput::is_new, "[R] uint8, 1 = new or resumed after preemption");
  def_array(out, "input_ids", &SchedulerOutput::input_ids, "[T] int32");
  def_array(out, "positions", &SchedulerOutput::positions, "[T] int32");
  def_array(out, "slot_mapping", &SchedulerOutput::slot_mapping, "[T] int32, block_id * block_size + offset");
  def_array(out, "query_start_loc", &SchedulerOutput::query_start_loc, "[R + 1] int32");
  def_array(out, "seq_lens", &SchedulerOutput::seq_lens, "[R] int32");
  def_array(out, "num_draft_tokens", &SchedulerOutput::num_draft_tokens,
            "[R] int32, draft tokens verified after each request's newest token");
  def_array(out, "logits_indices", &SchedulerOutput::logits_indices,
            "[R + D] int32, sampled rows: num_draft_tokens[i] + 1 per request, in batch order");
  def_array(out, "finished_handles", &SchedulerOutput::finished_handles, "finished or aborted since the previous step");
  def_array(out, "preempted_handles", &SchedulerOutput::preempted_handles, "preempted in this step");
  def_array(out, "block_copies", &SchedulerOutput::block_copies,
            "[2C] int32, (src, dst) block pairs whose KV the step copies before its forward pass");
  out.def_property_readonly("block_table", [](py::object self) {
       const SchedulerOutput& o = self.cast<const SchedulerOutput&>();
       return read_only_view(self, o.block_table.data(), {o.num_reqs(), o.block_table_width});
     }, "[R, width] int32, padded with the null block 0")
      .def_property_readonly("group_block_tables", [](py::object self) {
        const SchedulerOutput& o = self.cast<const SchedulerOutput&>();
        return read_only_view(self, o.group_block_tables.data(),
                              {o.num_kv_groups - 1, o.num_reqs(), o.block_table_width});
      }, "[G - 1, R, width] int32: KV groups 1, 2, ...'s block tables (hybrid models)")
      .def_property_readonly("group_slot_mappings", [](py::object self) {
        const SchedulerOutput& o = self.cast<const SchedulerOutput&>();
        return read_only_view(self, o.group_slot_mappings.data(),
                              {o.num_kv_groups - 1, o.total_num_scheduled_tokens()});
      }, "[G - 1, T] int32: KV groups 1, 2, ...'s slot mappings (hybrid models)")
      .def_readonly("num_kv_groups", &SchedulerOutput::num_kv_groups)
      .def_property_readonly("num_reqs", &SchedulerOutput::num_reqs)
      .def_property_readonly("total_num_draft_tokens", &SchedulerOutput::total_num_draft_tokens)
      .def_property_readonly("total_num_scheduled_tokens", &SchedulerOutput::total_num_scheduled_tokens);

  py::class_<UpdateOutput> up(m, "UpdateOutput", "New tokens and finish reasons of one step (views, valid until the next step).");
  def_array(up, "req_handles", &UpdateOutput::req_handles, "[R] int64, batch order");
  def_array(up, "new_token_offsets", &UpdateOutput::new_token_offsets, "[R + 1] int32");
  def_array(up, "new_token_ids", &UpdateOutput::new_token_ids, "new tokens of all requests, concatenated");
  def_array(up, "finish_reasons", &UpdateOutput::finish_reasons, "[R] int8: 0 running, 1 stop, 2 length, 3 abort");
  def_array(up, "stop_reasons", &UpdateOutput::stop_reasons, "[R] int32: stop token id or -1");
}

// KVCacheManager::max_blocks_per_request without a pool: the front end's admission check.
int max_kv_blocks_per_request(int num_tokens, int block_size, std::vector<int32_t> group_windows, int max_step_tokens) {
  OCTAVO_CHECK(num_tokens >= 1 && block_size >= 1 && max_step_tokens >= 1,
               "max_kv_blocks_per_request needs positive sizes");
  KVCacheManager kv(2, block_size, num_tokens, /*enable_caching=*/false, std::move(group_windows));
  return kv.max_blocks_per_request(num_tokens, max_step_tokens);
}

py::object request_state(const Scheduler& s, int64_t handle) {
  const Request* r = s.find(handle);
  if (!r) return py::none();
  py::dict d;
  d["request_id"] = r->request_id();
  d["status"] = status_name(r->status);
  d["num_computed_tokens"] = r->num_computed_tokens;
  d["num_prompt_tokens"] = r->num_prompt_tokens();
  d["output_token_ids"] = std::vector<int32_t>(r->token_ids().begin() + r->num_prompt_tokens(), r->token_ids().end());
  d["block_ids"] = r->block_ids;
  d["group_block_ids"] = r->group_block_ids;
  d["num_preemptions"] = r->num_preemptions;
  d["spec_token_ids"] = r->spec_token_ids;
  return d;
}

// Each handle's tokens [offsets[i], offsets[i + 1]) go to set_draft_tokens.
void set_draft_tokens(Scheduler& s, const std::vector<int64_t>& handles, const std::vector<int32_t>& offsets,
                      const std::vector<int32_t>& tokens) {
  OCTAVO_CHECK(offsets.size() == handles.size() + 1 && offsets.front() == 0 &&
                   offsets.back() == static_cast<int32_t>(tokens.size()),
               "offsets must be [len(handles) + 1], from 0 to len(tokens)");
  for (size_t i = 0; i < handles.size(); ++i) {
    OCTAVO_CHECK(offsets[i] <= offsets[i + 1], "offsets must be non-decreasing");
  }
  for (int32_t t : tokens) OCTAVO_CHECK(t >= 0, "draft token ids must be >= 0, got " << t);
  for (size_t i = 0; i < handles.size(); ++i) {
    s.set_draft_tokens(handles[i], tokens.data() + offsets[i], offsets[i + 1] - offsets[i]);
  }
}

// Prompt-lookup drafts of the given unfinished requests, from their tokens: (offsets, tokens).
std::pair<std::vector<int32_t>, std::vector<int32_t>> propose_ngram_drafts(const Scheduler& s,
                                                                           const std::vector<int64_t>& handles,
                                                                           const NgramConfig& config) {
  std::vector<int32_t> offsets{0}, tokens;
  for (int64_t h : handles) {
    if (const Request* r = s.find(h)) {
      const std::vector<int32_t> draft = propose_ngram(r->token_ids().data(), r->num_tokens(), config);
      tokens.insert(tokens.end(), draft.begin(), draft.end());
    }
    offsets.push_back(static_cast<int32_t>(tokens.size()));
  }
  return {std::move(offsets), std::move(tokens)};
}

std::vector<int64_t> handles_of(const std::vector<Request*>& requests) {
  std::vector<int64_t> out;
  out.reserve(requests.size());
  for (const Request* r : requests) out.push_back(r->handle());
  return out;
}

void bind_scheduler(py::module_& m) {
  m.def("max_kv_blocks_per_request", &max_kv_blocks_per_request, py::arg("num_tokens"), py::arg("block_size"),
        py::arg("group_windows"), py::arg("max_step_tokens"),
        "KV blocks a request of num_tokens slots holds at most in all KV groups (0: full attention) when a step "
        "computes at most max_step_tokens tokens");
  py::class_<Scheduler>(m, "Scheduler", "Continuous-batching scheduler with vLLM v1 semantics.")
      .def(py::init<const SchedulerConfig&>(), py::arg("config"))
      .def("add_request",
           [](Scheduler& s, std::string request_id, std::vector<int32_t> prompt_token_ids, int max_tokens,
              int min_tokens, int eos_token_id, std::vector<int32_t> stop_token_ids, bool ignore_eos, int priority,
              double arrival_time, uint64_t cache_extra_key, bool skip_reading_prefix_cache) {
             RequestParams p;
             p.request_id = std::move(request_id);
             p.prompt_token_ids = std::move(prompt_token_ids);
             p.max_tokens = max_tokens;
             p.min_tokens = min_tokens;
             p.eos_token_id = eos_token_id;
             p.stop_token_ids = std::move(stop_token_ids);
             p.ignore_eos = ignore_eos;
             p.priority = priority;
             p.arrival_time = arrival_time;
             p.cache_extra_key = cache_extra_key;
             p.skip_reading_prefix_cache = skip_reading_prefix_cache;
             return s.add_request(std::move(p));
           },
           py::arg("request_id"), py::arg("prompt_token_ids"), py::kw_only(), py::arg("max_tokens") = 16,
           py::arg("min_tokens") = 0, py::arg("eos_token_id") = -1, py::arg("stop_token_ids") = std::vector<int32_t>{},
           py::arg("ignore_eos") = false, py::arg("priority") = 0, py::arg("arrival_time") = 0.0,
           py::arg("cache_extra_key") = 0, py::arg("skip_reading_prefix_cache") = false, "Queues a request; returns its handle. Raises ValueError if it can never run.")
      .def("abort_requests", [](Scheduler& s, const std::vector<std::string>& ids) { s.abort_requests(ids); },
           py::arg("request_ids"))
      .def("schedule", &Scheduler::schedule, py::arg("max_num_reqs") = 0, py::return_value_policy::reference_internal,
           "Opens a step (see the C++ header); max_num_reqs > 0 caps its requests.")
      .def("update_from_output",
           [](Scheduler& s, py::handle sampled, py::handle offsets) -> const UpdateOutput& {
             OCTAVO_CHECK_KIND(ErrorKind::kRuntime, s.in_step(), "update_from_output() called without a schedule() before it");
             const int64_t num_reqs = s.num_scheduled_reqs();
             std::vector<int32_t> sampled_copy, offsets_copy;
             if (offsets.is_none()) return s.update_from_output(sampled_tokens(sampled, "sampled_token_ids", num_reqs, sampled_copy));
             const int32_t* off = sampled_tokens(offsets, "offsets", num_reqs + 1, offsets_copy);
             OCTAVO_CHECK(off[0] == 0, "argument 'offsets' must start at 0");
             for (int64_t i = 0; i < num_reqs; ++i) OCTAVO_CHECK(off[i] <= off[i + 1], "argument 'offsets' must be non-decreasing");
             const int32_t* tok = sampled_tokens(sampled, "sampled_token_ids", off[num_reqs], sampled_copy);
             return s.update_from_output(tok, off);
           },
           py::arg("sampled_token_ids"), py::arg("offsets") = py::none(), py::return_value_policy::reference_internal)
      .def("fail_step", &Scheduler::fail_step,
           "Closes the oldest open step, whose forward pass failed, instead of update_from_output(): "
           "aborts the requests it scheduled and drops their unwritten blocks from the prefix cache. "
           "Returns their handles.")
      .def("set_draft_tokens", &set_draft_tokens, py::arg("handles"), py::arg("offsets"), py::arg("tokens"),
           "Speculative decoding: handle i verifies tokens[offsets[i]:offsets[i + 1]] in its next step (see the "
           "C++ header for when drafts are kept).")
      .def("propose_ngram",
           [](const Scheduler& s, const std::vector<int64_t>& handles, int min_n, int max_n, int num_tokens) {
             NgramConfig config{min_n, max_n, num_tokens, s.config().max_model_len};
             config.validate();
             return propose_ngram_drafts(s, handles, config);
           },
           py::arg("handles"), py::arg("min_n"), py::arg("max_n"), py::arg("num_tokens"),
           "Prompt-lookup drafts of each request from its own tokens: (offsets [len(handles) + 1], tokens); an "
           "unknown or finished handle gets none.")
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("in_step", &Scheduler::in_step)
      .def_property_readonly("num_steps_in_flight", &Scheduler::num_steps_in_flight,
                             "Steps scheduled and not yet closed by an update (pipeline parallel keeps several).")
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def("running_handles", [](const Scheduler& s) { return handles_of(s.running()); })
      .def("waiting_handles", [](const Scheduler& s) {
        return handles_of(std::vector<Request*>(s.waiting().begin(), s.waiting().end()));
      })
      .def("request_state", &request_state, py::arg("handle"),
           "Dict describing an unfinished request, or None once it finished.")
      .def("handle_of", [](const Scheduler& s, const std::string& id) -> py::object {
        const Request* r = s.find(id);
        return r ? py::int_(r->handle()) : py::object(py::none());
      })
      .def_property_readonly("block_pool", [](Scheduler& s) -> const BlockPool& { return s.kv_cache_manager().pool(); },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("prefix_cache_stats", [](const Scheduler& s) { return prefix_cache_stats(s.kv_cache_manager().pool()); })
      .def("block_ref_counts", [](const Scheduler& s) {
        const BlockPool& p = s.kv_cache_manager().pool();
        std::vector<int32_t> refs(p.num_blocks());
        for (int32_t i = 0; i < p.num_blocks(); ++i) refs[i] = p.ref_count(i);
        return refs;
      })
      .def("reset_prefix_cache", [](Scheduler& s) { return s.kv_cache_manager().pool().reset_prefix_cache(); });
}

}  // namespace

void bind_core(py::module_& m) {
  bind_block_pool(m);
  bind_config(m);
  bind_outputs(m);
  bind_scheduler(m);
}

}  // namespace octavo::python
