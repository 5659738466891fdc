// Python module _metal_model: the control of the Metal model (test-side; see README.md). Installs the
// runtime the model compiles and runs kernels with (Python callables: the emulator), makes the
// "mps" tensors csrc/mps_ops.mm binds (a CPU tensor's memory as the storage of a tensor on device
// mps whose data pointer is a model MTLBuffer, as torch's MPS allocator hands out MTLBuffers), and
// synchronizes the modelled stream as torch.mps.synchronize() does.
#include "model.h"

#include <ATen/mps/MPSStream.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <thread>

namespace py = pybind11;

extern "C" size_t bnb_model_pool_height(void);
extern "C" size_t bnb_model_pool_depth(void);
void bnb_model_set_device_present(bool present);

namespace {

py::object* compile_callable = nullptr;
py::object* run_callable = nullptr;
py::dict* pipeline_limits = nullptr;
py::object* default_limit_callable = nullptr;
py::object* kernel_seconds_callable = nullptr;

// An mps tensor over `cpu`'s memory: its storage's data pointer is a model MTLBuffer of the CPU
// storage's bytes, and it has `cpu`'s sizes, strides and storage offset. Keeps `cpu`'s storage alive.
at::Tensor as_mps(const at::Tensor& cpu) {
  TORCH_CHECK_VALUE(cpu.device().is_cpu(), "as_mps: expected a CPU tensor, got one on ", cpu.device());
  at::Storage storage = cpu.storage();
  auto keep = std::make_shared<at::Storage>(storage);  // (the buffer's memory, alive while it is)
  BNBModelBuffer* buffer = [[BNBModelBuffer alloc] initWithContents:storage.mutable_data()
                                                             length:storage.nbytes()
                                                      releaseMemory:[keep]() mutable { keep.reset(); }];
  return at::for_blob((void*)buffer, cpu.sizes())
      .strides(cpu.strides())
      .storage_offset(cpu.storage_offset())
      .deleter([buffer](void*) { [buffer release]; })
      .options(cpu.options().device(c10::Device(c10::DeviceType::MPS, 0)))
      .target_device(c10::Device(c10::DeviceType::MPS, 0))
      .make_tensor();
}

void synchronize() {
  at::mps::MPSStream* stream = at::mps::getDefaultMPSStream();
  py::gil_scoped_release no_gil;  // (completed handlers and the GPU thread may need it)
  dispatch_sync(stream->queue(), ^() {
    stream->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
  });
}

// torch's own op on the stream, with `seconds` of modelled GPU work: an MPSGraph op
// (MPSStream::executeMPSGraph: endKernelCoalescing, encode into commandBuffer(), with commit-and-continue
// on: MPSGraph may commit the underlying command buffer and go on in a new one). The model takes the
// commit first: what was encoded before is committed, the op's work goes into a new buffer.
void torch_op(double seconds) {
  at::mps::MPSStream* stream = at::mps::getDefaultMPSStream();
  py::gil_scoped_release no_gil;
  dispatch_sync(stream->queue(), ^() {
    stream->synchronize(at::mps::SyncType::COMMIT);
    [stream->commandBuffer() modelAddWork:seconds];
  });
}

// Adds a completed handler to the stream's command buffer the way `where` says: "queue" (on the
// stream's queue, before commit: allowed), "off-queue" (from this thread, outside the queue), or
// "committed" (on the queue, to the buffer it has just committed). Returns whether the handler ran
// after a synchronize (what the model's rule says of it is in misuses()).
bool probe_completed_handler(const std::string& where) {
  at::mps::MPSStream* stream = at::mps::getDefaultMPSStream();
  __block bool ran = false;
  MTLCommandBufferHandler handler = ^(id<MTLCommandBuffer>) {
    ran = true;
  };
  {
    py::gil_scoped_release no_gil;
    if (where == "off-queue") {
      __block MPSCommandBuffer* buffer = nil;
      dispatch_sync(stream->queue(), ^() {
        buffer = stream->commandBuffer();
      });
      [buffer addCompletedHandler:handler];
    } else {
      dispatch_sync(stream->queue(), ^() {
        MPSCommandBuffer* buffer = stream->commandBuffer();
        if (where == "committed") {
          stream->synchronize(at::mps::SyncType::COMMIT);
        }
        [buffer addCompletedHandler:handler];
      });
    }
    dispatch_sync(stream->queue(), ^() {
      stream->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
    });
  }
  for (int i = 0; i < 200 && !ran && where == "queue"; ++i) {  // (handlers may run after the waiters woke)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ran;
}

void commit() {
  at::mps::MPSStream* stream = at::mps::getDefaultMPSStream();
  py::gil_scoped_release no_gil;
  dispatch_sync(stream->queue(), ^() {
    stream->synchronize(at::mps::SyncType::COMMIT);
  });
}

}  // namespace

PYBIND11_MODULE(_metal_model, m) {
  m.doc() = "The Metal model that runs csrc/mps_ops.mm on Linux (tests/metal_model/README.md).";
  m.def(
      "set_runtime",
      [](py::object compile, py::object run, py::object max_threads) {
        compile_callable = new py::object(std::move(compile));  // (kept for the process)
        run_callable = new py::object(std::move(run));
        pipeline_limits = new py::dict();
        bnb::Runtime& rt = bnb::runtime();
        rt.compile = [](const std::string& source, const std::string& version, long* handle,
                        std::vector<std::string>* names, std::string* error) -> bool {
          py::gil_scoped_acquire gil;
          try {
            py::tuple out = (*compile_callable)(py::bytes(source), version);
            *handle = out[0].cast<long>();
            *names = out[1].cast<std::vector<std::string>>();
            return true;
          } catch (py::error_already_set& e) {
            *error = e.what();
            return false;
          }
        };
        rt.run = [](long handle, const std::string& kernel, const std::array<uint64_t, 3>& grid,
                    const std::array<uint64_t, 3>& threadgroup, const std::vector<bnb::Binding>& bindings) {
          py::gil_scoped_acquire gil;
          py::list args;
          for (const bnb::Binding& b : bindings) {
            if (b.is_buffer) {
              args.append(py::make_tuple(b.address, b.length));
            } else {
              args.append(py::bytes(b.bytes));
            }
          }
          try {
            py::object fault = (*run_callable)(handle, kernel, grid, threadgroup, args);
            return fault.is_none() ? std::string() : fault.cast<std::string>();
          } catch (py::error_already_set& e) {
            return std::string("the model's runtime raised: ") + e.what();
          }
        };
        rt.max_threads = [](const std::string& kernel) -> uint64_t {
          py::gil_scoped_acquire gil;
          py::str key(kernel);
          if (pipeline_limits->contains(key)) {
            return (*pipeline_limits)[key].cast<uint64_t>();
          }
          return default_limit_callable != nullptr ? (*default_limit_callable)(key).cast<uint64_t>() : 1024;
        };
        if (!max_threads.is_none()) {
          default_limit_callable = new py::object(std::move(max_threads));
        }
      },
      py::arg("compile"), py::arg("run"), py::arg("max_threads") = py::none(),
      "compile(source: bytes, metal_version: str) -> (handle, [kernel names]) or raises with the compiler's "
      "message; "
      "run(handle, kernel, grid, threadgroup, [(address, length) or bytes]) -> None or the fault's text; "
      "max_threads(kernel) -> maxTotalThreadsPerThreadgroup of its pipelines (unless set_pipeline_limit).");
  m.def(
      "set_gpu_clock",
      [](py::object kernel_seconds, double buffer_seconds) {
        bnb::Runtime& rt = bnb::runtime();
        if (kernel_seconds.is_none()) {
          rt.modelled_clock = false;
          rt.kernel_seconds = nullptr;
          return;
        }
        delete kernel_seconds_callable;
        kernel_seconds_callable = new py::object(std::move(kernel_seconds));
        rt.buffer_seconds = buffer_seconds;
        rt.kernel_seconds = [](const std::string& kernel) -> double {
          py::gil_scoped_acquire gil;
          return (*kernel_seconds_callable)(kernel).cast<double>();
        };
        rt.modelled_clock = true;
      },
      py::arg("kernel_seconds"), py::arg("buffer_seconds") = 0.0,
      "The modelled GPU clock (tests/metal_model/model.h): kernel_seconds(kernel) -> seconds per dispatch, "
      "buffer_seconds per command buffer; None: GPU times are host times of the run.");
  m.def(
      "set_handler_delay", [](double seconds) { bnb::runtime().handler_delay = seconds; },
      "Seconds between waking a buffer's waiters and calling its completed handlers.");
  m.def("probe_completed_handler", &probe_completed_handler, py::arg("where"),
        "A completed handler added on the queue, off it, or after commit; whether it ran (tests of the model).");
  m.def("torch_op", &torch_op, py::arg("seconds"),
        "torch's own op (an MPSGraph op) on the stream: commit what is encoded, then `seconds` of modelled GPU "
        "work in a new command buffer.");
  m.def(
      "set_pipeline_limit",
      [](const std::string& kernel, uint64_t threads) { (*pipeline_limits)[py::str(kernel)] = threads; },
      "maxTotalThreadsPerThreadgroup of `kernel`'s pipelines created from now on.");
  m.def(
      "set_start_delay", [](double seconds) { bnb::runtime().start_delay = seconds; },
      "Seconds the modelled GPU waits before it starts each committed command buffer.");
  m.def(
      "set_deferred", [](bool deferred) { bnb::runtime().deferred = deferred; },
      "True: dispatches run only once their command buffer is committed (see tests/metal_model/model.h).");
  m.def("as_mps", &as_mps, py::arg("tensor"));
  m.def("synchronize", &synchronize, "torch.mps.synchronize() on the modelled stream: commit and wait.");
  m.def("commit", &commit, "Commit the stream's command buffer without waiting (torch's SyncType::COMMIT).");
  m.def(
      "misuses", [](bool clear) { return bnb::model_misuses(clear); }, py::arg("clear") = true,
      "Breaches of Apple's documented rules since the last call (a handler added after commit, ...).");
  m.def("live_objects", &bnb::model_live_objects, "Objective-C objects of the model alive now.");
  m.def("autorelease_pool_height", [] { return bnb_model_pool_height(); },
        "Objects waiting in this thread's autorelease pools.");
  m.def("autorelease_pool_depth", [] { return bnb_model_pool_depth(); },
        "Autorelease pools open on this thread (pushed, not popped).");
  m.def("set_device_present", &bnb_model_set_device_present, py::arg("present"),
        "False: MPSDevice::device() is nil, as where Metal finds no GPU.");
}
