// Python binding of the emulator runtime: `bnb_mps._emu`. The Python package
// (bnb_mps/emulator) builds kernel modules and marshals arguments; this only loads modules and
// runs dispatches.
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>

#include "runtime.h"

namespace py = pybind11;

namespace {

// A loaded kernel module (shared object). Kept loaded for the life of the process: kernels may
// still be referenced by a pending exception or another Library object.
class Module {
 public:
  explicit Module(const std::string& path) : path_(path) {
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) throw std::runtime_error(std::string("cannot load kernel module: ") + dlerror());
    auto init = reinterpret_cast<bnb_emu_module_init_fn>(dlsym(handle_, BNB_EMU_MODULE_INIT_SYMBOL));
    if (!init) throw std::runtime_error("not a kernel module (no " BNB_EMU_MODULE_INIT_SYMBOL "): " + path);
    uint32_t v = init(bnb_emu::runtime_table(), &Module::add, this);
    if (v != BNB_EMU_ABI_VERSION)
      throw std::runtime_error("kernel module built for emulator ABI " + std::to_string(v) + ", runtime has " +
                               std::to_string(BNB_EMU_ABI_VERSION) + ": " + path);
  }
  std::vector<std::string> kernels() const {
    std::vector<std::string> out;
    for (const auto& kv : kernels_) out.push_back(kv.first);
    return out;
  }
  bnb_emu_kernel_fn find(const std::string& name) const {
    auto it = kernels_.find(name);
    return it == kernels_.end() ? nullptr : it->second;
  }
  const std::string& path() const { return path_; }

 private:
  static void add(void* ctx, const bnb_emu_kernel_entry* e) {
    static_cast<Module*>(ctx)->kernels_[e->name] = e->fn;
  }
  std::string path_;
  void* handle_ = nullptr;
  std::map<std::string, bnb_emu_kernel_fn> kernels_;
};

std::array<uint32_t, 3> dim3(const std::vector<uint64_t>& v, const char* what) {
  if (v.size() != 3) throw py::value_error(std::string(what) + " must have 3 components");
  std::array<uint32_t, 3> out{};
  for (int i = 0; i < 3; ++i) {
    if (v[size_t(i)] > 0xFFFFFFFFull) throw py::value_error(std::string(what) + " component too large");
    out[size_t(i)] = uint32_t(v[size_t(i)]);
  }
  return out;
}

// Fills the request shared by launch and profile. `scalars` keeps bytes arguments alive.
void make_request(bnb_emu::LaunchRequest& q, std::vector<std::string>& scalars, const Module& m,
                  const std::string& kernel, const std::vector<uint64_t>& groups,
                  const std::vector<uint64_t>& group_size, const std::vector<uint64_t>& threads, py::list buffers,
                  int order, uint64_t seed, int poison, bool race_check, bool flush_subnormals) {
  q.fn = m.find(kernel);
  if (!q.fn) throw py::key_error(kernel);
  q.kernel = kernel;
  auto g = dim3(groups, "grid"), t = dim3(group_size, "threadgroup"), n = dim3(threads, "threads");
  for (int i = 0; i < 3; ++i) {
    q.groups[i] = g[size_t(i)];
    q.group_size[i] = t[size_t(i)];
    q.threads[i] = n[size_t(i)];
  }
  // Scalars arrive as bytes; keep copies alive for the dispatch.
  scalars.reserve(buffers.size());
  for (py::handle item : buffers) {
    bnb_emu::HostBuffer b;
    if (py::isinstance<py::bytes>(item)) {
      scalars.push_back(item.cast<std::string>());
      b.host = reinterpret_cast<uintptr_t>(scalars.back().data());
      b.size = scalars.back().size();
      b.align = 1;
      while (b.align < 16 && b.size % (b.align * 2) == 0) b.align *= 2;
      b.writable = false;
    } else {
      auto tup = item.cast<py::tuple>();
      b.host = tup[0].cast<uintptr_t>();
      b.size = tup[1].cast<size_t>();
      b.align = tup[2].cast<size_t>();
      b.writable = tup[3].cast<bool>();
    }
    q.buffers.push_back(b);
  }
  if (order < 0 || order > 2) throw py::value_error("order must be 0, 1 or 2");
  q.order = bnb_emu::LaneOrder(order);
  q.seed = seed;
  q.poison = uint8_t(poison);
  q.race_check = race_check;
  q.flush_subnormals = flush_subnormals;
}

py::object fault_tuple(const bnb_emu::LaunchResult& r) {
  if (r.kind == BNB_EMU_OK) return py::none();
  return py::make_tuple(r.kind, r.message, r.where, r.object_path, r.pc_offset);
}

py::object run(const Module& m, const std::string& kernel, const std::vector<uint64_t>& groups,
               const std::vector<uint64_t>& group_size, const std::vector<uint64_t>& threads, py::list buffers,
               int order, uint64_t seed, int poison, bool race_check, bool flush_subnormals, bool coherence_check,
               uint32_t metal_version) {
  bnb_emu::LaunchRequest q;
  std::vector<std::string> scalars;
  make_request(q, scalars, m, kernel, groups, group_size, threads, buffers, order, seed, poison, race_check,
               flush_subnormals);
  q.coherence_check = coherence_check;
  q.metal_version = metal_version;
  bnb_emu::LaunchResult r;
  {
    py::gil_scoped_release nogil;
    r = bnb_emu::launch(q);
  }
  return fault_tuple(r);
}

// Like run, for a module built with BNB_EMU_PROFILE: `counted[i]` says whether buffer i is
// memory traffic, `line_offsets[i]` where it starts relative to a line. Returns (fault or None,
// counts as a dict).
py::tuple profile(const Module& m, const std::string& kernel, const std::vector<uint64_t>& groups,
                  const std::vector<uint64_t>& group_size, const std::vector<uint64_t>& threads, py::list buffers,
                  int order, uint64_t seed, int poison, bool race_check, bool flush_subnormals,
                  const std::vector<bool>& counted,
                  const std::vector<uint32_t>& line_offsets, uint32_t line_bytes) {
  bnb_emu::LaunchRequest q;
  std::vector<std::string> scalars;
  make_request(q, scalars, m, kernel, groups, group_size, threads, buffers, order, seed, poison, race_check,
               flush_subnormals);
  if (counted.size() != q.buffers.size() || line_offsets.size() != q.buffers.size())
    throw py::value_error("profile: one counted flag and one line offset per buffer expected");
  q.profiling = true;
  q.line_bytes = line_bytes;
  for (size_t i = 0; i < q.buffers.size(); ++i) q.profile.push_back({bool(counted[i]), line_offsets[i]});
  bnb_emu::LaunchResult r;
  {
    py::gil_scoped_release nogil;
    r = bnb_emu::launch(q);
  }
  const bnb_emu::ProfileResult& p = r.profile;
  py::list bufs;
  for (const auto& t : p.buffers) {
    py::dict b;
    b["load_bytes"] = t.load_bytes;
    b["store_bytes"] = t.store_bytes;
    b["atomic_bytes"] = t.atomic_bytes;
    b["accesses"] = t.accesses;
    b["unique_bytes"] = t.unique_bytes;
    b["lines"] = t.lines;
    b["lines_summed_over_threadgroups"] = t.lines_summed;
    b["transactions"] = t.transactions;
    bufs.append(b);
  }
  py::dict out;
  out["buffers"] = bufs;
  out["instructions"] = p.instructions;
  out["transactions"] = p.transactions;
  out["threadgroups"] = p.threadgroups;
  out["threads"] = p.threads;
  out["barriers"] = p.barriers;
  out["barriers_max"] = p.barriers_max;
  out["collectives"] = p.collectives;
  out["threadgroup_memory_max"] = p.threadgroup_memory_max;
  out["threadgroup_load_bytes"] = p.threadgroup_load_bytes;
  out["threadgroup_store_bytes"] = p.threadgroup_store_bytes;
  out["threadgroup_atomic_bytes"] = p.threadgroup_atomic_bytes;
  return py::make_tuple(fault_tuple(r), out);
}

}  // namespace

PYBIND11_MODULE(_emu, mod) {
  mod.doc() = "Metal-on-CPU emulator runtime (see bnb_mps.emulator)";
  mod.attr("ABI_VERSION") = BNB_EMU_ABI_VERSION;
  py::class_<Module>(mod, "Module")
      .def(py::init<const std::string&>())
      .def_property_readonly("kernels", &Module::kernels)
      .def_property_readonly("path", &Module::path);
  mod.def("launch", &run, py::arg("module"), py::arg("kernel"), py::arg("groups"), py::arg("group_size"),
          py::arg("threads"), py::arg("buffers"), py::arg("order"), py::arg("seed"), py::arg("poison"),
          py::arg("race_check"), py::arg("flush_subnormals"), py::arg("coherence_check") = false,
          py::arg("metal_version") = 310);
  mod.def("profile", &profile, py::arg("module"), py::arg("kernel"), py::arg("groups"), py::arg("group_size"),
          py::arg("threads"), py::arg("buffers"), py::arg("order"), py::arg("seed"), py::arg("poison"),
          py::arg("race_check"), py::arg("flush_subnormals"), py::arg("counted"), py::arg("line_offsets"), py::arg("line_bytes"));
  mod.def("worker_count", &bnb_emu::worker_count);
}
