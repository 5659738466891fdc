// bnb_mps._opkey: the metadata key of an op call (bnb_mps.ops.plan), computed in C++.
//
// The op layer keeps a launch plan per call signature: the dtypes, shapes, strides, storage offsets
// and devices of the call's tensors and the values of its other arguments. Read through PyTorch's
// Python bindings, that metadata costs several microseconds per call for an op with six tensors (a
// torch.Size, a stride tuple and a device object per tensor, then hashing them), more than the rest
// of a planned call. Here it is read from the tensors' C++ objects and written into one bytes
// object, which is the dictionary key: exact (two calls get equal keys only when every field is
// equal), cheap to hash.
//
//   key(args: tuple, skip: int) -> bytes | None
//
// `skip` is a bit mask of argument positions left out of the key (per-call values such as the
// optimizers' step). None means "no key": an argument this function does not describe (a sparse or
// nested tensor, a tensor with symbolic sizes, a Python object of another kind); the caller then
// takes its full path. bnb_mps.ops.plan.metadata_key is the same key in Python (used where this
// module is not built); tests/test_plan_cache.py checks that both tell the same calls apart.
//
// The module links against torch (tensor objects are read through libtorch_python), so it is
// built against the torch it runs with, like the native executor: the build records that torch
// (_opkey_build.json) and bnb_mps.ops.plan refuses a module built against another one.

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

// Field tags: a key is a sequence of tagged fields, so that no two different argument lists
// produce the same bytes.
enum Tag : char {
  kTensor = 'T',
  kNone = 'N',
  kSkipped = 'X',
  kBool = 'B',
  kInt = 'I',
  kFloat = 'F',
  kStr = 'S',
  kIntList = 'L',
  kDtype = 'D',
};

// The key's bytes: on the stack up to a size that holds every call of bitsandbytes' ops, on the
// heap beyond.
class KeyWriter {
 public:
  void tag(Tag t) { put(static_cast<char>(t)); }
  void byte(int v) { put(static_cast<char>(v)); }
  void i64(int64_t v) { append(reinterpret_cast<const char*>(&v), sizeof v); }
  void bytes(const char* p, size_t n) {
    i64(static_cast<int64_t>(n));
    append(p, n);
  }
  PyObject* result() const {
    return heap_.empty() ? PyBytes_FromStringAndSize(stack_, static_cast<Py_ssize_t>(used_))
                         : PyBytes_FromStringAndSize(heap_.data(), static_cast<Py_ssize_t>(heap_.size()));
  }

 private:
  void put(char c) { append(&c, 1); }
  void append(const char* p, size_t n) {
    if (heap_.empty() && used_ + n <= sizeof stack_) {
      std::memcpy(stack_ + used_, p, n);
      used_ += n;
      return;
    }
    if (heap_.empty()) heap_.assign(stack_, used_);
    heap_.append(p, n);
  }

  char stack_[1024];
  size_t used_ = 0;
  std::string heap_;
};

// Writes a tensor's dtype, device, sizes, strides and storage offset; false when the tensor is one
// this key does not describe (the caller then returns None).
bool write_tensor(KeyWriter& w, PyObject* obj) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (t.layout() != c10::kStrided || impl->has_symbolic_sizes_strides() || t.is_nested()) {
    return false;
  }
  w.tag(kTensor);
  w.byte(static_cast<int>(t.scalar_type()));
  w.byte(static_cast<int>(t.device().type()));
  w.byte(t.device().index());
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  w.byte(static_cast<int>(sizes.size()));
  for (size_t d = 0; d < sizes.size(); ++d) {
    w.i64(sizes[d]);
    w.i64(strides[d]);
  }
  w.i64(t.storage_offset());
  return true;
}

// Writes a list or tuple of Python ints; false for anything else.
bool write_int_list(KeyWriter& w, PyObject* seq) {
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  w.tag(kIntList);
  w.i64(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    w.i64(v);
  }
  return true;
}

// One argument; false when it cannot be described.
bool write_arg(KeyWriter& w, PyObject* a) {
  if (a == Py_None) {
    w.tag(kNone);
    return true;
  }
  if (THPVariable_CheckExact(a)) return write_tensor(w, a);  // (the common case, before the exact types)
  if (PyBool_Check(a)) {
    w.tag(kBool);
    w.byte(a == Py_True);
    return true;
  }
  if (PyLong_CheckExact(a)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    w.tag(kInt);
    w.i64(v);
    return true;
  }
  if (PyFloat_CheckExact(a)) {
    const double v = PyFloat_AS_DOUBLE(a);
    int64_t bits;
    std::memcpy(&bits, &v, sizeof bits);  // exact: -0.0 and 0.0, and NaN payloads, apart
    w.tag(kFloat);
    w.i64(bits);
    return true;
  }
  if (PyUnicode_CheckExact(a)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(a, &n);
    if (s == nullptr) {
      PyErr_Clear();
      return false;
    }
    w.tag(kStr);
    w.bytes(s, static_cast<size_t>(n));
    return true;
  }
  if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) return write_int_list(w, a);
  if (THPDtype_Check(a)) {
    w.tag(kDtype);
    w.byte(static_cast<int>(reinterpret_cast<THPDtype*>(a)->scalar_type));
    return true;
  }
  if (THPVariable_Check(a)) return write_tensor(w, a);  // a Tensor subclass (bitsandbytes' Params4bit, ...)
  return false;
}

PyObject* key(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyLong_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "key(args: tuple, skip: int)");
    return nullptr;
  }
  const unsigned long long skip = PyLong_AsUnsignedLongLongMask(argv[1]);
  if (skip == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
  PyObject* args = argv[0];
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  KeyWriter w;
  w.byte(static_cast<int>(n));
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i < 64 && ((skip >> i) & 1u)) {
        w.tag(kSkipped);
        continue;
      }
      if (!write_arg(w, PyTuple_GET_ITEM(args, i))) Py_RETURN_NONE;
    }
  } catch (const std::exception&) {  // e.g. a tensor whose metadata cannot be read: no key
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return w.result();
}

PyMethodDef methods[] = {
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(key)), METH_FASTCALL,
     "key(args: tuple, skip: int) -> bytes | None: the metadata key of an op call (bnb_mps.ops.plan)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_opkey", "Metadata keys of op calls (bnb_mps.ops.plan).", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit__opkey() {
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "BUILT_WITH_TORCH", BNB_MPS_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "BUILT_WITH_CXX11_ABI", BNB_MPS_TORCH_CXX11_ABI) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
