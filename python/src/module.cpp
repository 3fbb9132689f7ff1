/// cfmo._cfmo: the bindings under the cfmo package (python/cfmo/__init__.py
/// adds PyTorch's side: tensors to buffers, optimizer state to moments).
/// Every libcfmo error becomes a Python exception of its kind with its
/// message; a call that may wait on other ranks releases the GIL.

#include "comm/codec.h"
#include "comm/world.h"
#include "data/dataset.h"
#include "reconciler.h"
#include "world.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

namespace py = pybind11;

namespace cfmo::python {
namespace {

/// A libcfmo Error on its way to Python.
struct ErrorException : std::exception {
  explicit ErrorException(Error e) : error(std::move(e)) {}
  const char* what() const noexcept override { return error.message.c_str(); }
  Error error;
};

/// The Python exception classes, by ErrorKind (index = exit status).
PyObject* g_exceptions[6] = {};

[[noreturn]] void raise(ErrorKind kind, std::string message) { throw ErrorException(Error{kind, std::move(message)}); }

void check(const Status& status) {
  if (!status) throw ErrorException(status.error());
}
template <typename T>
T check(Result<T> result) {
  if (!result) throw ErrorException(std::move(result).error());
  return std::move(result).value();
}

/// A writable, C-contiguous float32 buffer of `expected` floats (0: any), or a ConfigError naming it.
TensorView view_of(const py::handle& object, const std::string& what, size_t expected = 0) {
  py::buffer_info info;
  try {
    info = py::reinterpret_borrow<py::buffer>(object).request(true);
  } catch (const std::exception&) {
    PyErr_Clear();
    raise(ErrorKind::kUsage, what + ": not a writable buffer of float32 (give a CPU tensor or a numpy array)");
  }
  if (info.format != py::format_descriptor<float>::format() || info.itemsize != 4) {
    const std::string dtype = py::str(py::dtype(info));
    raise(ErrorKind::kUsage, fmt::format("{}: {}, expected float32", what, dtype));
  }
  py::ssize_t stride = 4;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[static_cast<size_t>(d)] > 1 && info.strides[static_cast<size_t>(d)] != stride) {
      raise(ErrorKind::kUsage, what + ": not contiguous (pass .contiguous() or np.ascontiguousarray)");
    }
    stride *= info.shape[static_cast<size_t>(d)];
  }
  TensorView v;
  v.shape.assign(info.shape.begin(), info.shape.end());
  v.data = static_cast<float*>(info.ptr);
  v.size = static_cast<size_t>(info.size);
  if (expected != 0 && v.size != expected) {
    raise(ErrorKind::kUsage, fmt::format("{}: {} floats, its parameter has {}", what, v.size, expected));
  }
  return v;
}

/// Per-tensor buffers (first moments, gradients) matching the tensors; None: none.
Buffers buffers_of(const Reconciler& r, const py::list& list, const char* what, bool allow_none) {
  const auto& layout = r.layout();
  if (list.size() != layout.size()) {
    raise(ErrorKind::kUsage, fmt::format("{}: {} buffers for {} tensors", what, list.size(), layout.size()));
  }
  Buffers out(layout.size(), nullptr);
  for (size_t t = 0; t < layout.size(); ++t) {
    if (list[t].is_none()) {
      if (!allow_none) raise(ErrorKind::kUsage, fmt::format("{}[{}] ('{}'): missing", what, t, layout[t].name));
      continue;
    }
    out[t] = view_of(list[t], fmt::format("{}[{}] ('{}')", what, t, layout[t].name), layout[t].size).data;
  }
  return out;
}

py::dict position_dict(const train::TrainPosition& p) {
  py::dict d;
  d["step"] = p.step;
  d["samples"] = p.samples;
  d["epoch"] = p.epoch;
  d["batch_in_epoch"] = p.batch_in_epoch;
  d["train_s"] = p.train_s;
  return d;
}

train::TrainPosition position_from(const py::handle& h) {
  const auto d = py::reinterpret_borrow<py::dict>(h);
  train::TrainPosition p;
  p.step = d["step"].cast<int64_t>();
  p.samples = d["samples"].cast<int64_t>();
  p.epoch = d.contains("epoch") ? d["epoch"].cast<int64_t>() : 0;
  p.batch_in_epoch = d.contains("batch_in_epoch") ? d["batch_in_epoch"].cast<int64_t>() : p.step;
  p.train_s = d.contains("train_s") ? d["train_s"].cast<double>() : 0;
  return p;
}

py::array_t<float> to_array(const std::vector<float>& v) { return py::array_t<float>(v.size(), v.data()); }

std::vector<float> from_array(const py::handle& h) {
  auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(h);
  if (!a) raise(ErrorKind::kUsage, "load_state_dict(): an array of floats expected");
  return std::vector<float>(a.data(), a.data() + a.size());
}

py::dict state_to_dict(const ReconcilerState& s) {
  py::dict d;
  d["format"] = "cfmo.Reconciler/1";
  d["mode"] = s.mode;
  d["world"] = s.world;
  d["position"] = position_dict(s.position);
  d["global"] = s.global;
  d["params"] = to_array(s.params);
  d["outer_momentum"] = to_array(s.outer_momentum);
  py::list owner;
  for (const auto& b : s.owner_state) owner.append(to_array(b));
  d["owner_state"] = owner;
  d["owner_steps"] = s.owner_steps;
  py::list ranks;
  for (const auto& p : s.ranks) ranks.append(position_dict(p));
  d["ranks"] = ranks;
  d["versions"] = s.versions;
  return d;
}

ReconcilerState state_from_dict(const py::dict& d) {
  if (!d.contains("format") || d["format"].cast<std::string>() != "cfmo.Reconciler/1") {
    raise(ErrorKind::kUsage, "load_state_dict(): not a state_dict() of cfmo.Reconciler");
  }
  ReconcilerState s;
  s.mode = d["mode"].cast<std::string>();
  s.world = d["world"].cast<int>();
  s.position = position_from(d["position"]);
  s.global = d["global"].cast<bool>();
  s.params = from_array(d["params"]);
  s.outer_momentum = from_array(d["outer_momentum"]);
  for (const auto& b : d["owner_state"]) s.owner_state.push_back(from_array(b));
  s.owner_steps = d["owner_steps"].cast<std::vector<int64_t>>();
  for (const auto& p : d["ranks"]) s.ranks.push_back(position_from(p));
  s.versions = d["versions"].cast<std::vector<int64_t>>();
  return s;
}

py::dict stats_of(const Reconciler& r) {
  const train::ModeStats m = r.mode_stats();
  const comm::CommStats c = r.comm_stats();
  py::dict d;
  d["rank"] = r.rank();
  d["world"] = r.size();
  d["mode"] = r.mode_name();
  d["step"] = r.position().step;
  d["samples"] = r.position().samples;
  d["wait_s"] = m.wait_s;
  d["finish_wait_s"] = m.finish_wait_s;
  d["rounds"] = m.rounds;
  d["deferred"] = m.deferred;
  d["replies_held"] = m.replies_held;
  d["reply_rounds_cut"] = m.reply_rounds_cut;
  d["contributions_sent"] = m.contributions_sent;
  d["contributions_applied"] = m.contributions_applied;
  d["contributions_received"] = m.contributions_received;
  d["contributions_dropped"] = m.contributions_dropped;
  d["staleness_histogram"] = m.staleness_histogram;
  d["bytes_sent"] = c.bytes_sent;
  d["bytes_received"] = c.bytes_received;
  d["messages_sent"] = c.messages_sent;
  d["messages_received"] = c.messages_received;
  d["lost_ranks"] = r.lost_ranks();
  d["deltas_written"] = r.deltas_written();
  d["deltas_skipped"] = r.deltas_skipped();
  return d;
}

/// A data set as numpy arrays: (features uint8 [count, features], labels int32 [count]).
py::tuple dataset_arrays(cfmo::data::Dataset d) {
  auto* held = new cfmo::data::Dataset(std::move(d));
  py::capsule owner(held, [](void* p) { delete static_cast<cfmo::data::Dataset*>(p); });
  const std::vector<py::ssize_t> shape = {held->count, held->features};
  return py::make_tuple(py::array_t<uint8_t>(shape, held->pixels.data(), owner),
                        py::array_t<int32_t>({held->count}, held->labels.data(), owner));
}

std::atomic<bool> g_launch_stop{false};

/// The local launcher of cfmo-train --workers, for `python3 -m cfmo.launch`:
/// argv runs again (this interpreter, /proc/self/exe) as each rank.
int launch(int workers, const std::vector<std::string>& args, double grace_s) {
  if (workers < 1 || workers > 1024) raise(ErrorKind::kUsage, fmt::format("-n {}: must be in 1..1024", workers));
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  g_launch_stop = false;
  struct sigaction stop {};
  stop.sa_handler = [](int) { g_launch_stop = true; };
  struct sigaction old_int {};
  struct sigaction old_term {};
  ::sigaction(SIGINT, &stop, &old_int);
  ::sigaction(SIGTERM, &stop, &old_term);
  Result<int> status = 0;
  {
    py::gil_scoped_release release;
    status = comm::launch_local(workers, argv.data(), &g_launch_stop, STDOUT_FILENO, STDERR_FILENO, grace_s);
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return check(std::move(status));
}

std::unique_ptr<Reconciler> make_reconciler(std::shared_ptr<World> world, const std::vector<std::string>& names,
                                            const py::list& buffers, const std::string& mode, int sync_interval,
                                            double staleness_beta, int max_staleness, const std::string& outer,
                                            double outer_lr, double outer_momentum, const std::string& delta_dtype,
                                            const py::dict& optimizer, const std::string& out, int64_t sample_budget,
                                            const std::string& reply_hold) {
  if (world->closed) raise(ErrorKind::kUsage, "this World was closed");
  std::vector<TensorView> tensors;
  for (size_t t = 0; t < buffers.size(); ++t) {
    const std::string name = t < names.size() ? names[t] : std::to_string(t);
    TensorView v = view_of(buffers[t], fmt::format("params[{}] ('{}')", t, name));
    v.name = name;
    tensors.push_back(std::move(v));
  }
  ReconcilerSettings s;
  auto kind = train::parse_mode(mode);
  if (!kind) throw ErrorException(as_keyword_error(kind.error()));
  s.mode.kind = *kind;
  s.mode.sync_interval = sync_interval;
  s.mode.staleness_discount = staleness_beta;
  s.mode.max_staleness = max_staleness;
  auto outer_kind = train::parse_outer_kind(outer);
  if (!outer_kind) throw ErrorException(as_keyword_error(outer_kind.error()));
  s.mode.outer_optimizer = *outer_kind;
  s.mode.outer_lr = outer_lr;
  s.mode.outer_momentum = outer_momentum;
  auto dtype = comm::parse_wire_dtype(delta_dtype);
  if (!dtype) throw ErrorException(as_keyword_error(dtype.error()));
  s.mode.delta_dtype = *dtype;
  s.mode.peer_timeout_s = world->options.peer_timeout_s;
  if (sample_budget < 0) raise(ErrorKind::kUsage, "sample_budget: must be >= 0");
  s.mode.sample_budget = sample_budget;
  if (reply_hold != "round" && reply_hold != "off") {
    raise(ErrorKind::kUsage, fmt::format("reply_hold: '{}' is not round or off", reply_hold));
  }
  s.mode.hold_replies = reply_hold == "round";
  auto get = [&](const char* key, auto fallback) {
    return optimizer.contains(key) ? optimizer[key].cast<decltype(fallback)>() : fallback;
  };
  auto optimizer_kind = optim::parse_optimizer_kind(get("name", std::string("adamw")));
  if (!optimizer_kind) throw ErrorException(as_keyword_error(optimizer_kind.error()));
  s.optimizer.kind = *optimizer_kind;
  s.optimizer.momentum = get("momentum", 0.0);
  s.optimizer.nesterov = get("nesterov", false);
  s.optimizer.beta1 = get("beta1", 0.9);
  s.optimizer.beta2 = get("beta2", 0.999);
  s.optimizer.eps = get("eps", 1e-8);
  s.optimizer.weight_decay = get("weight_decay", 0.0);
  s.out = out;
  py::gil_scoped_release release;
  return check(Reconciler::create(std::move(world), std::move(tensors), std::move(s)));
}

}  // namespace
}  // namespace cfmo::python

PYBIND11_MODULE(_cfmo, m) {
  using namespace cfmo::python;
  using cfmo::ErrorKind;
  m.doc() = "libcfmo's reconciliation modes for tensors that live in Python";

  PyObject* base = PyErr_NewExceptionWithDoc("cfmo.Error", "A cfmo failure; exit_status is cfmo's for its kind.",
                                             PyExc_RuntimeError, nullptr);
  struct Kind {
    ErrorKind kind;
    const char* name;
    PyObject* also;
    const char* doc;
  };
  const Kind kinds[] = {
      {ErrorKind::kCheckFailed, "cfmo.CheckFailed", nullptr, "A check failed: training diverged."},
      {ErrorKind::kUsage, "cfmo.ConfigError", PyExc_ValueError, "A bad argument or setting."},
      {ErrorKind::kInput, "cfmo.InputError", nullptr, "An unreadable or corrupt input."},
      {ErrorKind::kPeer, "cfmo.PeerLost", nullptr, "A peer was lost or the network failed."},
      {ErrorKind::kInternal, "cfmo.InternalError", nullptr, "An unexpected system failure."},
  };
  m.attr("Error") = py::handle(base);
  for (const Kind& k : kinds) {
    PyObject* bases = k.also != nullptr ? PyTuple_Pack(2, base, k.also) : PyTuple_Pack(1, base);
    PyObject* type = PyErr_NewExceptionWithDoc(k.name, k.doc, bases, nullptr);
    Py_DECREF(bases);
    PyObject_SetAttrString(type, "exit_status", PyLong_FromLong(static_cast<int>(k.kind)));
    g_exceptions[static_cast<int>(k.kind)] = type;
    m.attr(std::string(k.name).substr(5).c_str()) = py::handle(type);
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ErrorException& e) {
      PyErr_SetString(g_exceptions[e.error.exit_status()], e.what());
    }
  });

  py::class_<World, std::shared_ptr<World>>(m, "World", "This process's place among the workers.")
      .def(py::init([](const std::string& rendezvous, double peer_timeout) {
             auto w = std::make_shared<World>();
             w->options.rendezvous = rendezvous;
             w->options.peer_timeout_s = peer_timeout;
             if (!(peer_timeout > 0)) raise(ErrorKind::kUsage, "peer_timeout: must be positive");
             {
               py::gil_scoped_release release;
               w->comm = check(connect_world(w->options));
             }
             if (w->comm) {
               w->rank_ = w->comm->rank();
               w->size_ = w->comm->size();
             }
             return w;
           }),
           py::arg("rendezvous") = "", py::arg("peer_timeout") = 10.0)
      .def_property_readonly("rank", &World::rank)
      .def_property_readonly("size", &World::size)
      .def_property_readonly("peer_timeout", [](const World& w) { return w.options.peer_timeout_s; })
      .def("lost_ranks", [](const World& w) { return w.comm ? w.comm->lost_ranks() : std::vector<int>{}; })
      .def(
          "all_reduce",
          [](World& w, const py::buffer& data) {
            const TensorView v = view_of(data, "all_reduce");
            if (w.closed) raise(ErrorKind::kUsage, "all_reduce: this World was closed");
            if (!w.comm) return;
            py::gil_scoped_release release;
            check(w.comm->all_reduce_sum({v.data, v.size}));
          },
          "Collective: the element-wise sum over the ranks of a float32 buffer, in place.")
      .def(
          "close",
          [](World& w) {
            if (w.in_use) raise(ErrorKind::kUsage, "World.close(): its Reconciler is not finished");
            w.closed = true;
            py::gil_scoped_release release;
            w.comm.reset();  // the goodbye to the other ranks
          },
          "Leaves the world (the other ranks see this rank go); idempotent.");

  py::class_<Reconciler>(m, "_Reconciler")
      .def(py::init(&make_reconciler), py::arg("world"), py::arg("names"), py::arg("buffers"), py::arg("mode"),
           py::arg("sync_interval"), py::arg("staleness_beta"), py::arg("max_staleness"), py::arg("outer"),
           py::arg("outer_lr"), py::arg("outer_momentum"), py::arg("delta_dtype"), py::arg("optimizer"), py::arg("out"),
           py::arg("sample_budget"), py::arg("reply_hold"))
      .def(
          "tick",
          [](Reconciler& r, int64_t samples) {
            if (r.finished()) raise(ErrorKind::kUsage, "step(): this Reconciler is finished");
            return r.tick(samples);
          },
          py::arg("samples"))
      .def("reconcile",
           [](Reconciler& r, const py::list& moments) {
             const Buffers b = buffers_of(r, moments, "moments", true);
             py::gil_scoped_release release;
             check(r.reconcile(b));
           })
      .def("reduce_gradients",
           [](Reconciler& r, const py::list& grads, int count, float lr) {
             const Buffers b = buffers_of(r, grads, "grads", false);
             py::gil_scoped_release release;
             check(r.reduce_gradients(b, count, lr));
           })
      .def("finish",
           [](Reconciler& r, const py::list& moments) {
             const Buffers b = buffers_of(r, moments, "moments", true);
             py::gil_scoped_release release;
             check(r.finish(b));
           })
      .def_property_readonly("finished", &Reconciler::finished)
      .def_property_readonly("stop_requested", &Reconciler::stop_requested)
      .def_property_readonly("mode", &Reconciler::mode_name)
      .def_property_readonly("owns_update", &Reconciler::owns_update)
      .def_property_readonly("uses_gradients", &Reconciler::uses_gradients)
      .def_property_readonly("rank", &Reconciler::rank)
      .def_property_readonly("size", &Reconciler::size)
      .def_property_readonly("step_count", [](const Reconciler& r) { return r.position().step; })
      .def_property_readonly("shard_bounds", &Reconciler::shard_bounds)
      .def_property_readonly("layout",
                             [](const Reconciler& r) {
                               py::list out;
                               for (const auto& p : r.layout()) out.append(py::make_tuple(p.name, p.offset, p.size));
                               return out;
                             })
      .def("lost_ranks", &Reconciler::lost_ranks)
      .def("stats", &stats_of)
      .def("state_dict",
           [](Reconciler& r) {
             cfmo::Result<ReconcilerState> s = ReconcilerState{};
             {
               py::gil_scoped_release release;
               s = r.state_dict();
             }
             return state_to_dict(check(std::move(s)));
           })
      .def("load_state_dict", [](Reconciler& r, const py::dict& d) {
        const ReconcilerState s = state_from_dict(d);
        py::gil_scoped_release release;
        check(r.load_state_dict(s));
      });

  m.def(
      "load_data",
      [](const std::string& spec, uint64_t seed) {
        auto split = check(cfmo::data::load_data(spec, seed));
        return py::make_tuple(dataset_arrays(std::move(split.train)), dataset_arrays(std::move(split.test)));
      },
      py::arg("spec") = cfmo::data::kDefaultFashionMnistDir, py::arg("seed") = 1,
      "cfmo-train's --data: Fashion-MNIST's IDX files in a directory (Debian's dataset-fashion-mnist by default) "
      "or 'synthetic[:TRAIN[:TEST]]'; ((train_x, train_y), (test_x, test_y)), pixels as uint8.");
  m.def("launch_local", &launch, py::arg("workers"), py::arg("argv"), py::arg("grace_s") = 10.0,
        "Runs argv (this interpreter's arguments) as `workers` local ranks; returns the run's exit status.");
}
