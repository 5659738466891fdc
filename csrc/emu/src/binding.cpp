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

py::object run(const Module& m, const std::string& kernel, const std::vector<uint64_t>& groups,
               const std::vector<uint64_t>& group_size, const std::vector<uint64_t>& threads, py::list buffers,
               int order, uint64_t seed, int poison, bool race_check) {
  bnb_emu::LaunchRequest q;
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
  std::vector<std::string> scalars;
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
  bnb_emu::LaunchResult r;
  {
    py::gil_scoped_release nogil;
    r = bnb_emu::launch(q);
  }
  if (r.kind == BNB_EMU_OK) return py::none();
  return py::make_tuple(r.kind, r.message, r.where, r.object_path, r.pc_offset);
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
          py::arg("race_check"));
  mod.def("worker_count", &bnb_emu::worker_count);
}
