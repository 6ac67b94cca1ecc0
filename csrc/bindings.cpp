// The single pybind11 module of torch_sagemaker: torch_sagemaker._C.
//
// Python decides, C++ executes: every function exported here has a Python wrapper with a
// docstring in torch_sagemaker/ (see torch_sagemaker/smddp/backend.py).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <utility>

#include "smddp/algorithms/kernels.h"
#include "smddp/backend/backend.h"
#include "smddp/common/settings.h"

namespace py = pybind11;

namespace {

// The group's settings: its SMDDPOptions (pg_options) over the environment (Note
// [Settings]). Called without the GIL (see the binding); takes it to read the options.
c10::intrusive_ptr<smddp::ProcessGroupSMDDP> create_backend(
    const c10d::DistributedBackendOptions& opts, const py::object& pg_options) {
  std::map<std::string, std::string> overrides;
  {
    py::gil_scoped_acquire gil;
    if (!pg_options.is_none()) {
      if (!py::hasattr(pg_options, "_smddp_overrides")) {
        throw py::type_error(
            "smddp: pg_options must be a torch_sagemaker.smddp.SMDDPOptions, got " +
            std::string(py::str(py::type::of(pg_options).attr("__name__"))));
      }
      overrides = pg_options.attr("_smddp_overrides")().cast<std::map<std::string, std::string>>();
    }
  }
  smddp::Settings settings = smddp::resolve_settings(overrides);
  return c10::make_intrusive<smddp::ProcessGroupSMDDP>(opts.store, opts.group_rank, opts.group_size,
                                                       opts.timeout, opts.group_id,
                                                       opts.global_ranks_in_group, settings);
}

py::list setting_table() {
  py::list rows;
  for (const auto& s : smddp::setting_table()) {
    py::dict d;
    d["field"] = s.field;
    d["env"] = s.env;
    d["kind"] = s.kind;
    d["default"] = s.fallback;
    d["meaning"] = s.meaning;
    rows.append(d);
  }
  return rows;
}

// What resolve_settings makes of `options` over `environ` (tests of the rules).
std::map<std::string, std::string> resolve_for_test(
    const std::map<std::string, std::string>& options,
    const std::map<std::string, std::string>& environ) {
  return smddp::describe(smddp::resolve_settings(options, [&](const char* name) -> const char* {
    auto it = environ.find(name);
    return it == environ.end() ? nullptr : it->second.c_str();
  }));
}

py::dict layout_of(const smddp::ProcessGroupSMDDP& pg) {
  const auto& l = pg.comm().layout();
  py::dict d;
  d["hosts"] = l.hosts;
  d["local_size"] = l.local_size;
  d["host"] = l.host;
  d["local_rank"] = l.local_rank;
  d["members"] = l.members;
  d["forced"] = l.forced;
  d["uniform"] = l.uniform;
  d["net_algorithm"] = pg.comm().net_algorithm();
  d["net_tree_max_bytes"] = pg.comm().net_tree_max_bytes();
  // Note [Auto by size and host count]: the S up to which each kind takes halving-doubling.
  py::dict doubling;
  doubling["all_reduce"] = pg.comm().net_doubling_max_bytes(smddp::NetOp::ALL_REDUCE);
  doubling["reduce_scatter"] = pg.comm().net_doubling_max_bytes(smddp::NetOp::REDUCE_SCATTER);
  doubling["all_gather"] = pg.comm().net_doubling_max_bytes(smddp::NetOp::ALL_GATHER);
  d["net_doubling_max_bytes"] = doubling;
  // The collectives that crossed hosts by each algorithm (Note [Auto by size and host count]).
  const std::pair<const char*, smddp::NetAlgo> algorithms[] = {
      {"mesh", smddp::NetAlgo::MESH},
      {"ring", smddp::NetAlgo::RING},
      {"halving_doubling", smddp::NetAlgo::HALVING_DOUBLING},
      {"tree", smddp::NetAlgo::TREE}};
  py::dict ops;
  for (const auto& [name, algo] : algorithms) ops[name] = pg.comm().net_ops(algo);
  d["net_ops"] = ops;
  d["machine_oversubscribed"] = pg.comm().machine_oversubscribed();
  return d;
}

py::dict pool_stats_of(const smddp::ProcessGroupSMDDP& pg) {
  auto pool = pg.comm().pool();
  py::dict d;
  d["pool_bytes"] = pool ? pool->bytes() : 0;
  d["in_use"] = pool ? pool->in_use() : 0;
  d["zero_copy_ops"] = pg.comm().zero_copy_ops();
  d["pool_reduce_reads"] = pg.comm().pool_reads(false);
  d["pool_gather_reads"] = pg.comm().pool_reads(true);
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native parts of torch_sagemaker (the smddp collective backend).";
  m.attr("has_smddp_backend") = true;

  auto base = py::module::import("torch._C._distributed_c10d").attr("Backend");
  py::class_<smddp::ProcessGroupSMDDP, c10::intrusive_ptr<smddp::ProcessGroupSMDDP>>(
      m, "ProcessGroupSMDDP", base)
      .def("_layout", &layout_of)
      .def("_pool_stats", &pool_stats_of)
      // SUM gets its own overload: converting Python's ReduceOp enum costs ~1 us a call.
      .def(
          "_all_reduce_direct",
          [](smddp::ProcessGroupSMDDP& pg, const at::Tensor& t) {
            pg.allreduce_direct(t, c10d::ReduceOp(c10d::ReduceOp::SUM));
          },
          py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("_all_reduce_direct", &smddp::ProcessGroupSMDDP::allreduce_direct, py::arg("tensor"),
           py::arg("op"), py::call_guard<py::gil_scoped_release>())
      // torch binds `options` for gloo and NCCL only; the same property here lets callers read
      // any group's timeout alike (getBackendOptions in backend.h).
      .def_property_readonly("options", &smddp::ProcessGroupSMDDP::getBackendOptions)
      .def("_settings",
           [](const smddp::ProcessGroupSMDDP& pg) {
             return smddp::describe(pg.comm().config().settings);
           })
      .def("_listen_port",
           [](const smddp::ProcessGroupSMDDP& pg) { return pg.comm().listen_port(); })
      .def("_listen_address",
           [](const smddp::ProcessGroupSMDDP& pg) { return pg.comm().listen_address(); })
      .def("_staging_trace", &smddp::ProcessGroupSMDDP::staging_trace)
      // (seq, phase, begin_ns, end_ns, bytes) since the last call (Note [Timeline]).
      .def("_timeline",
           [](smddp::ProcessGroupSMDDP& pg) {
             std::vector<std::tuple<uint64_t, std::string, int64_t, int64_t, uint64_t>> out;
             for (const auto& s : pg.take_timeline())
               out.emplace_back(s.seq, s.phase, s.begin_ns, s.end_ns, s.bytes);
             return out;
           })
      // The same for the phases of staged calls (Note [Staging timeline]): seq is the call's
      // number among the group's staged calls.
      .def("_staging_timeline",
           [](smddp::ProcessGroupSMDDP& pg) {
             std::vector<std::tuple<uint64_t, std::string, int64_t, int64_t, uint64_t>> out;
             for (const auto& s : pg.take_staging_timeline())
               out.emplace_back(s.seq, s.phase, s.begin_ns, s.end_ns, s.bytes);
             return out;
           })
      .def("_rejected_connections",
           [](const smddp::ProcessGroupSMDDP& pg) { return pg.comm().rejected_connections(); })
      .def("_transport_stats", [](const smddp::ProcessGroupSMDDP& pg) {
        const smddp::TransportStats t = pg.comm().transport_stats();
        return std::map<std::string, uint64_t>{{"messages_sent", t.messages_sent},
                                               {"messages_received", t.messages_received},
                                               {"send_calls", t.send_calls},
                                               {"recv_calls", t.recv_calls},
                                               {"polls", t.polls},
                                               {"bytes_received", t.bytes_received},
                                               {"stashed_bytes", t.stashed_bytes},
                                               {"connects_unreachable", t.connects_unreachable},
                                               {"connects_unanswered", t.connects_unanswered}};
      });

  // The store wait inside runs without the GIL so other Python threads keep running.
  m.def("create_backend", &create_backend, py::arg("dist_backend_opts"), py::arg("pg_options"),
        py::call_guard<py::gil_scoped_release>());
  m.def("kernel_isa", &smddp::kernel_isa);
  m.def("_wait_for_deferred_releases", &smddp::wait_for_deferred_releases, py::arg("timeout_s"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "_plan_chunks",
      [](int64_t numel, int64_t chunk_elems) {
        std::vector<std::pair<int64_t, int64_t>> out;
        for (const auto& c : smddp::plan_chunks(numel, chunk_elems))
          out.emplace_back(c.begin, c.count);
        return out;
      },
      py::arg("numel"), py::arg("chunk_elems"));
  m.def("setting_table", &setting_table);
  m.def("_resolve_settings", &resolve_for_test, py::arg("options"), py::arg("environ"));
}
