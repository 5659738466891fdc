// The native Metal executor: library compile/load, pipeline cache, argument binding, dispatch.
// Compiled with -fobjc-arc (see csrc/mps.cmake). Everything that can live in Python does
// (bnb_mps/executors/native.py); this file stays a thin, generic launcher.
//
// Launches follow the pattern of PyTorch's own Metal kernels: inside dispatch_sync on the current
// MPS stream's serial queue, take the stream's shared compute encoder (stream->commandEncoder()),
// set the pipeline, bind buffers at storage_offset * element_size and scalars with setBytes, and
// dispatch. PyTorch owns the encoder and the command buffer: nothing here ends, commits or waits,
// so consecutive kernels (ours and PyTorch's) coalesce into one encoder.

#include "mps_ops.h"

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "bnb_mps_kernels_embedded.h"  // generated at build time by bnb_mps/executors/_embed_kernels.py

// The torch this module is compiled against (csrc/mps.cmake); the Python side compares it with
// the running torch before trusting the module.
#if !defined(BNB_MPS_TORCH_VERSION) || !defined(BNB_MPS_TORCH_CXX11_ABI)
#error "BNB_MPS_TORCH_VERSION and BNB_MPS_TORCH_CXX11_ABI must be defined by the build (csrc/mps.cmake)"
#endif

namespace bnb_mps {
namespace {

// Metal's limit for setBytes; larger constants belong in a buffer.
constexpr size_t kMaxSetBytesLength = 4096;

std::string describe(NSError* error) {
  if (error == nil) {
    return "no error description";
  }
  // For compile failures, localizedDescription carries the compiler's log.
  const char* text = error.localizedDescription.UTF8String;
  return text != nullptr ? std::string(text) : std::string("no error description");
}

id<MTLDevice> metal_device() {
  // PyTorch's own device, so that pipelines and tensors live on the same MTLDevice.
  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  if (device == nil) {
    throw std::runtime_error("no Metal device (torch.backends.mps.is_available() is False)");
  }
  return device;
}

// The Metal language version compile() requests, applied to `options` (when given) and returned as
// {major, minor} ({0, 0}: the OS compiler's default, before macOS 14). What each gives:
// - Metal 3.2, from macOS 15 on when this module was built with the macOS 15 SDK or newer
//   (MTLLanguageVersion3_2 and __MAC_15_0 exist from that SDK on): the kernel source's `#pragma
//   METAL fp math_mode(safe)` and `#pragma METAL fp contract(off)` (kernels/bnb_math_mode.h) apply,
//   with use_safe_math below.
// - Metal 3.1 (the first with bfloat) on macOS 14, and on every macOS with an older SDK: those
//   pragmas are compiled out; safe math from use_safe_math alone (fastMathEnabled = NO).
// At both, the source's unconditional `#pragma clang fp contract(off)` keeps a * b + c from being
// contracted into a fused multiply-add, so both compute the same bits.
// Not yet run on a Mac: the acceptance run (scripts/mac_acceptance.sh) is the check.
std::pair<int, int> request_language_version(MTLCompileOptions* options) {
#if defined(__MAC_15_0)
  if (@available(macOS 15.0, *)) {
    if (options != nil) {
      options.languageVersion = MTLLanguageVersion3_2;
    }
    return {3, 2};
  }
#endif
  if (@available(macOS 14.0, *)) {
    if (options != nil) {
      options.languageVersion = MTLLanguageVersion3_1;
    }
    return {3, 1};
  }
  return {0, 0};
}

// Requests exactly Metal `version` (major, minor) of `options`: false where this SDK or OS has no
// such MTLLanguageVersion (3.1 from macOS 14, 3.2 from 15, 4.0 from 26). For the acceptance run's
// probes, which compare the same source at each version.
bool set_language_version(MTLCompileOptions* options, std::pair<int, int> version) {
  if (version == std::make_pair(3, 1)) {
    if (@available(macOS 14.0, *)) {
      options.languageVersion = MTLLanguageVersion3_1;
      return true;
    }
  }
#if defined(__MAC_15_0)
  if (version == std::make_pair(3, 2)) {
    if (@available(macOS 15.0, *)) {
      options.languageVersion = MTLLanguageVersion3_2;
      return true;
    }
  }
#endif
#if defined(__MAC_26_0)
  if (version == std::make_pair(4, 0)) {
    if (@available(macOS 26.0, *)) {
      options.languageVersion = MTLLanguageVersion4_0;
      return true;
    }
  }
#endif
  return false;
}

// Quantization must not depend on the compiler's math mode: no fast-math, precise functions.
// mathMode exists from the macOS 15 SDK on (whose headers define __MAC_15_0) and macOS 15 at run
// time; before that, fastMathEnabled = NO is the same request.
void use_safe_math(MTLCompileOptions* options) {
#if defined(__MAC_15_0)
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    return;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
  options.fastMathEnabled = NO;
#pragma clang diagnostic pop
}

// The MTLBuffer behind an mps tensor's storage. The MPS allocator's data pointer *is* the buffer
// object; __bridge borrows it without changing its retain count (PyTorch owns the buffer).
id<MTLBuffer> storage_buffer(const at::Tensor& tensor) {
  return (__bridge id<MTLBuffer>)(tensor.storage().data());
}

}  // namespace

struct KernelLibrary::Impl {
  id<MTLLibrary> library = nil;
  std::string origin;
  std::mutex mutex;  // guards `pipelines`
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;

  // Wraps a compiled or loaded library (the nested class may call the private constructor).
  static std::shared_ptr<KernelLibrary> wrap(id<MTLLibrary> library, std::string origin) {
    auto impl = std::make_unique<Impl>();
    impl->library = library;
    impl->origin = std::move(origin);
    return std::shared_ptr<KernelLibrary>(new KernelLibrary(std::move(impl)));
  }

  // The cached pipeline of `kernel`, created on first use. Creation happens under the lock: it is
  // rare (once per kernel and process) and keeps two threads from compiling the same kernel. Errors
  // are thrown after the autorelease pool is left (an exception must not unwind through one).
  id<MTLComputePipelineState> pipeline(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = pipelines.find(kernel);
    if (found != pipelines.end()) {
      return found->second;
    }
    id<MTLDevice> device = metal_device();  // (may throw: before the pool, never inside it)
    id<MTLComputePipelineState> state = nil;
    bool missing = false;
    std::string error;
    @autoreleasepool {
      NSString* name = [NSString stringWithUTF8String:kernel.c_str()];
      id<MTLFunction> function = name != nil ? [library newFunctionWithName:name] : nil;
      if (function == nil) {
        missing = true;
      } else {
        NSError* failure = nil;
        state = [device newComputePipelineStateWithFunction:function error:&failure];
        if (state == nil) {
          error = describe(failure);
        }
      }
    }
    if (missing) {
      throw std::invalid_argument("kernel '" + kernel + "' is not in the bnb_mps kernel library (" + origin + ")");
    }
    if (state == nil) {
      throw std::runtime_error("cannot create the compute pipeline of kernel '" + kernel + "': " + error);
    }
    pipelines.emplace(kernel, state);
    return state;
  }
};

namespace {

void check_args(const std::string& kernel, const std::vector<KernelArg>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const KernelArg& arg = args[i];
    const std::string where = "argument " + std::to_string(i) + " ([[buffer(" + std::to_string(i) +
                              ")]]) of kernel '" + kernel + "'";
    if (arg.tensor.defined()) {
      if (arg.tensor.device().type() != c10::DeviceType::MPS) {
        throw std::invalid_argument(where + " is a tensor on " + arg.tensor.device().str() +
                                    "; expected a tensor on mps");
      }
    } else if (arg.bytes.empty() || arg.bytes.size() > kMaxSetBytesLength) {
      throw std::invalid_argument(where + " is a scalar of " + std::to_string(arg.bytes.size()) +
                                  " bytes; expected 1 to " + std::to_string(kMaxSetBytesLength));
    }
  }
}

}  // namespace

KernelLibrary::KernelLibrary(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KernelLibrary::~KernelLibrary() = default;

// Compiling and loading run with the GIL released (see the module below): they take a Metal
// compiler's time. Errors are thrown after the autorelease pool is left.
std::shared_ptr<KernelLibrary> KernelLibrary::compile(const std::string& source, std::pair<int, int> version) {
  if (source.empty()) {
    throw std::invalid_argument("kernel source is empty");
  }
  id<MTLDevice> device = metal_device();  // (may throw: before the pool, never inside it)
  id<MTLLibrary> library = nil;
  bool bad_text = false;
  bool bad_version = false;
  std::string error;
  @autoreleasepool {
    NSString* text = [[NSString alloc] initWithBytes:source.data()
                                              length:source.size()
                                            encoding:NSUTF8StringEncoding];
    if (text == nil) {
      bad_text = true;
    } else {
      MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
      use_safe_math(options);
      if (version.first == 0) {
        request_language_version(options);  // 3.2 from macOS 15 on (the source's math-mode pragmas apply), else 3.1
      } else {
        bad_version = !set_language_version(options, version);
      }
      if (!bad_version) {
        NSError* failure = nil;
        library = [device newLibraryWithSource:text options:options error:&failure];
        if (library == nil) {
          error = describe(failure);
        }
      }
    }
  }
  if (bad_text) {
    throw std::invalid_argument("kernel source is not valid UTF-8");
  }
  if (bad_version) {
    throw std::invalid_argument("Metal " + std::to_string(version.first) + "." + std::to_string(version.second) +
                                " is not available with this build's SDK on this macOS");
  }
  if (library == nil) {
    throw std::runtime_error("the Metal compiler rejected the kernel source: " + error);
  }
  return Impl::wrap(library, "source");
}

std::shared_ptr<KernelLibrary> KernelLibrary::load_metallib(const std::string& path) {
  id<MTLDevice> device = metal_device();  // (may throw: before the pool, never inside it)
  id<MTLLibrary> library = nil;
  bool bad_path = false;
  std::string error;
  @autoreleasepool {
    NSString* ns_path = [NSString stringWithUTF8String:path.c_str()];
    if (ns_path == nil) {
      bad_path = true;
    } else {
      NSError* failure = nil;
      library = [device newLibraryWithURL:[NSURL fileURLWithPath:ns_path] error:&failure];
      if (library == nil) {
        error = describe(failure);
      }
    }
  }
  if (bad_path) {
    throw std::invalid_argument("metallib path is not valid UTF-8");
  }
  if (library == nil) {
    throw std::runtime_error("cannot load " + path + ": " + error);
  }
  return Impl::wrap(library, "metallib:" + path);
}

const std::string& KernelLibrary::origin() const {
  return impl_->origin;
}

std::vector<std::string> KernelLibrary::function_names() const {
  std::vector<std::string> names;
  @autoreleasepool {
    for (NSString* name in impl_->library.functionNames) {
      names.emplace_back(name.UTF8String);
    }
  }
  return names;
}

PipelineInfo KernelLibrary::pipeline_info(const std::string& kernel) {
  id<MTLComputePipelineState> state = impl_->pipeline(kernel);
  return PipelineInfo{state.maxTotalThreadsPerThreadgroup, state.threadExecutionWidth,
                      state.staticThreadgroupMemoryLength};
}

// What a watch keeps: the tracked buffers not yet reported, and what each reported.
struct CommandBufferWatch::State {
  std::mutex mutex;
  std::condition_variable reported;
  size_t pending = 0;                              // tracked buffers whose handler has not run yet
  std::vector<std::string> errors;                 // Metal's description of each failed one
  std::vector<std::pair<double, double>> times;    // (GPUStartTime, GPUEndTime) of each that reported

  void expect() {
    std::lock_guard<std::mutex> lock(mutex);
    ++pending;
  }
  void cancel() {  // an expected handler that was never attached
    std::lock_guard<std::mutex> lock(mutex);
    --pending;
    reported.notify_all();
  }
};

namespace {

// The completed handler of a watched command buffer: records its status, its error's text and its
// GPU start and end times (host time in seconds, CFTimeInterval, as Apple documents them), then
// counts it as reported. It runs on a Metal thread; the block keeps the state alive.
MTLCommandBufferHandler watch_handler(std::shared_ptr<CommandBufferWatch::State> state) {
  return ^(id<MTLCommandBuffer> buffer) {
    std::string error;
    double start = 0.0, end = 0.0;
    @autoreleasepool {  // (the error's description is autoreleased)
      if (buffer.status == MTLCommandBufferStatusError) {
        error = describe(buffer.error);
      }
      start = buffer.GPUStartTime;
      end = buffer.GPUEndTime;
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    if (!error.empty()) {
      state->errors.push_back(std::move(error));
    }
    state->times.emplace_back(start, end);
    --state->pending;
    state->reported.notify_all();
  };
}

}  // namespace

void KernelLibrary::launch(const std::string& kernel, const Dim3& grid, const Dim3& threadgroup,
                           const std::vector<KernelArg>& args, CommandBufferWatch* watch) {
  // The whole launch runs in one autorelease pool (what it creates is released when it returns, not
  // when some outer pool drains); an error is thrown only after the pool is left.
  std::exception_ptr failure;
  @autoreleasepool {
    try {
      encode(kernel, grid, threadgroup, args, watch);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

void KernelLibrary::encode(const std::string& kernel, const Dim3& grid, const Dim3& threadgroup,
                           const std::vector<KernelArg>& args, CommandBufferWatch* watch) {
  if (threadgroup[0] == 0 || threadgroup[1] == 0 || threadgroup[2] == 0) {
    throw std::invalid_argument("threadgroup of kernel '" + kernel + "' has a zero dimension");
  }
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
    return;  // nothing to run (and no command buffer to watch)
  }
  check_args(kernel, args);
  id<MTLComputePipelineState> state = impl_->pipeline(kernel);
  const uint64_t threads = threadgroup[0] * threadgroup[1] * threadgroup[2];
  if (threads > state.maxTotalThreadsPerThreadgroup) {
    throw PipelineLimit(kernel, threads, state.maxTotalThreadsPerThreadgroup);
  }

  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  const std::vector<KernelArg>* bound = &args;  // the block captures a pointer, not a copy
  const MTLSize groups = MTLSizeMake(grid[0], grid[1], grid[2]);
  const MTLSize group_size = MTLSizeMake(threadgroup[0], threadgroup[1], threadgroup[2]);
  // A watched launch attaches its completed handler in the same block as the dispatch, so that it
  // goes to the command buffer that holds this dispatch: once the block returns, another thread may
  // commit that buffer (and a handler cannot be added to a committed one). Not through
  // stream->addCompletedHandler, which would dispatch_sync on the queue this block runs on.
  std::shared_ptr<CommandBufferWatch::State> watched = watch != nullptr ? watch->state_ : nullptr;
  MTLCommandBufferHandler handler = nil;
  if (watched) {
    handler = watch_handler(watched);
  }
  __block bool attached = false;
  // C++ exceptions must not unwind through a GCD block: catch inside, rethrow on this thread.
  __block std::exception_ptr failure;
  if (watched) {
    watched->expect();
  }
  dispatch_sync(stream->queue(), ^() {
    try {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      [encoder setComputePipelineState:state];
      for (size_t i = 0; i < bound->size(); ++i) {
        const KernelArg& arg = (*bound)[i];
        if (arg.tensor.defined()) {
          [encoder setBuffer:storage_buffer(arg.tensor)
                      offset:static_cast<NSUInteger>(arg.tensor.storage_offset() * arg.tensor.element_size())
                     atIndex:i];
        } else {
          [encoder setBytes:arg.bytes.data() length:arg.bytes.size() atIndex:i];
        }
      }
      [encoder dispatchThreadgroups:groups threadsPerThreadgroup:group_size];
      if (handler != nil) {
        [stream->commandBuffer() addCompletedHandler:handler];  // (the buffer of the encoder above)
        attached = true;
      }
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (watched && !attached) {
    watched->cancel();
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

CommandBufferWatch::CommandBufferWatch() : state_(std::make_shared<State>()) {}

namespace {

// torch's MPSStream keeps its current command buffer in the private member `_commandBuffer` (nil once
// committed; aten/src/ATen/mps/MPSStream.h) and has no accessor that does not make one
// (commandBuffer() creates it, and so does MPSStream::addCompletedHandler). An explicit template
// instantiation may name a private member ([temp.spec.general]/6): this reads it, on the stream's queue.
struct CurrentCommandBuffer {
  using type = MPSCommandBuffer_t at::mps::MPSStream::*;
  friend type member(CurrentCommandBuffer);
};
template <typename Tag, typename Tag::type Member>
struct ReadPrivate {
  friend typename Tag::type member(Tag) { return Member; }
};
template struct ReadPrivate<CurrentCommandBuffer, &at::mps::MPSStream::_commandBuffer>;

}  // namespace

bool CommandBufferWatch::track() {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  MTLCommandBufferHandler handler = watch_handler(state_);
  __block bool attached = false;
  __block std::exception_ptr failure;
  state_->expect();
  // On the stream's serial queue: the handler goes to its current command buffer, if it has one (PyTorch
  // owns it and commits it; this only listens). None after a commit: nothing encoded since to watch.
  dispatch_sync(stream->queue(), ^() {
    try {
      MPSCommandBuffer_t current = stream->*member(CurrentCommandBuffer{});
      if (current != nil) {
        [current addCompletedHandler:handler];
        attached = true;
      }
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (!attached) {
    state_->cancel();
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
  return attached;
}

std::vector<std::string> CommandBufferWatch::errors(double timeout_seconds) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  const bool all = state_->reported.wait_for(lock, std::chrono::duration<double>(timeout_seconds),
                                             [&] { return state_->pending == 0; });
  std::vector<std::string> out = state_->errors;
  if (!all) {
    out.push_back(std::to_string(state_->pending) + " watched command buffer(s) did not report completion within " +
                  std::to_string(timeout_seconds) + " s");
  }
  return out;
}

std::vector<std::pair<double, double>> CommandBufferWatch::gpu_times() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->times;
}

std::pair<int, int> compile_language_version() {
  return request_language_version(nil);
}

std::string_view embedded_kernel_source() {
  return std::string_view(reinterpret_cast<const char*>(kBnbMpsKernelSource), kBnbMpsKernelSourceSize);
}

}  // namespace bnb_mps

// ---------------------------------------------------------------------------------------------
// Python module bnb_mps._native. Arguments: a sequence of mps tensors and `bytes` (a Scalar's
// to_bytes()). pybind11 turns std::invalid_argument into ValueError and std::runtime_error into
// RuntimeError; c10::Error is rewritten without its C++ backtrace; PipelineLimit becomes the
// executors' own bnb_mps.executors.base.PipelineLimitError(kernel, threads, maximum).

namespace py = pybind11;

namespace {

// bnb_mps.executors.base.PipelineLimitError, looked up once when the module is imported (a
// reference kept for the life of the process).
PyObject* pipeline_limit_error = nullptr;

void translate_pipeline_limit(std::exception_ptr failure) {
  try {
    std::rethrow_exception(failure);  // other exceptions go on to pybind11's other translators
  } catch (const bnb_mps::PipelineLimit& e) {
    PyErr_SetObject(pipeline_limit_error, py::make_tuple(e.kernel, e.threads, e.maximum).ptr());
  }
}

template <typename F>
auto translate_errors(F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::ValueError& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

std::vector<bnb_mps::KernelArg> to_kernel_args(const py::sequence& args) {
  std::vector<bnb_mps::KernelArg> out(args.size());
  for (size_t i = 0; i < out.size(); ++i) {
    py::object arg = args[i];  // owns a reference while we read it
    if (THPVariable_Check(arg.ptr())) {
      out[i].tensor = THPVariable_Unpack(arg.ptr());
    } else if (PyBytes_Check(arg.ptr())) {
      out[i].bytes = arg.cast<std::string>();
    } else {
      throw py::type_error("argument " + std::to_string(i) +
                           " must be a tensor or bytes (a Scalar's to_bytes()), got " +
                           std::string(py::str(py::type::of(arg).attr("__name__"))));
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "bnb_mps native Metal executor (see csrc/mps_ops.h)";
  m.attr("BUILT_WITH_TORCH") = BNB_MPS_TORCH_VERSION;
  m.attr("BUILT_WITH_CXX11_ABI") = static_cast<bool>(BNB_MPS_TORCH_CXX11_ABI);
  py::object limit_error = py::module_::import("bnb_mps.executors.base").attr("PipelineLimitError");
  pipeline_limit_error = limit_error.release().ptr();
  py::register_local_exception_translator(&translate_pipeline_limit);

  py::class_<bnb_mps::CommandBufferWatch>(m, "CommandBufferWatch")
      .def(py::init<>())
      .def(
          "errors",
          [](bnb_mps::CommandBufferWatch& self, double timeout) {
            py::gil_scoped_release no_gil;
            return self.errors(timeout);
          },
          py::arg("timeout") = 5.0,
          "After a synchronisation: the error text of every watched command buffer that failed (see "
          "csrc/mps_ops.h).")
      .def(
          "track",
          [](bnb_mps::CommandBufferWatch& self) {
            py::gil_scoped_release no_gil;  // (waits for the stream's queue)
            return translate_errors([&] { return self.track(); });
          },
          "Watch the current command buffer of PyTorch's MPS stream, if it has one (after the fact: see "
          "csrc/mps_ops.h; a launch given the watch is watched without a race). False: it had none.")
      .def("gpu_times", &bnb_mps::CommandBufferWatch::gpu_times,
           "After errors() has waited: the (GPUStartTime, GPUEndTime) pair, in seconds, of each watched "
           "launch's command buffer that has reported (see csrc/mps_ops.h).");

  py::class_<bnb_mps::KernelLibrary, std::shared_ptr<bnb_mps::KernelLibrary>>(m, "KernelLibrary")
      .def_property_readonly("origin", &bnb_mps::KernelLibrary::origin)
      .def("function_names", &bnb_mps::KernelLibrary::function_names)
      .def(
          "pipeline_info",
          [](bnb_mps::KernelLibrary& self, const std::string& kernel) {
            const auto info = translate_errors([&] { return self.pipeline_info(kernel); });
            py::dict out;
            out["max_total_threads_per_threadgroup"] = info.max_total_threads_per_threadgroup;
            out["thread_execution_width"] = info.thread_execution_width;
            out["static_threadgroup_memory_length"] = info.static_threadgroup_memory_length;
            return out;
          },
          py::arg("kernel"))
      .def(
          "launch",
          [](bnb_mps::KernelLibrary& self, const std::string& kernel, const bnb_mps::Dim3& grid,
             const bnb_mps::Dim3& threadgroup, const py::sequence& args, bnb_mps::CommandBufferWatch* watch) {
            std::vector<bnb_mps::KernelArg> bound = to_kernel_args(args);
            py::gil_scoped_release no_gil;  // encoding may wait for the stream's queue
            translate_errors([&] { self.launch(kernel, grid, threadgroup, bound, watch); });
          },
          py::arg("kernel"), py::arg("grid"), py::arg("threadgroup"), py::arg("args"), py::arg("watch") = nullptr,
          "`watch`: a CommandBufferWatch whose completed handler goes to the command buffer that holds "
          "this launch (attached in the launch's own step on the stream's queue).");

  m.def(
      "compile_library",
      [](const std::string& source, std::optional<std::pair<int, int>> language_version) {
        std::shared_ptr<bnb_mps::KernelLibrary> library;
        const std::pair<int, int> version = language_version.value_or(std::make_pair(0, 0));
        {
          py::gil_scoped_release no_gil;  // a Metal compile takes a while: other threads run meanwhile
          library = translate_errors([&] { return bnb_mps::KernelLibrary::compile(source, version); });
        }
        return library;
      },
      py::arg("source"), py::arg("language_version") = py::none(),
      "Compile MSL source (safe math; Metal 3.2 from macOS 15 on with the macOS 15 SDK, else 3.1; or exactly "
      "`language_version`, (major, minor), for the acceptance probes) into a KernelLibrary. "
      "bnb_mps.executors.native calls it once per kernel compile unit.");
  m.def(
      "load_metallib",
      [](const std::string& path) {
        std::shared_ptr<bnb_mps::KernelLibrary> library;
        {
          py::gil_scoped_release no_gil;
          library = translate_errors([&] { return bnb_mps::KernelLibrary::load_metallib(path); });
        }
        return library;
      },
      py::arg("path"), "Load a .metallib built offline into a KernelLibrary.");
  m.def(
      "language_version",
      []() -> py::object {
        const auto version = bnb_mps::compile_language_version();
        if (version.first == 0) {
          return py::none();
        }
        return py::make_tuple(version.first, version.second);
      },
      "The Metal language version compile_library requests here, (major, minor), or None for the OS's "
      "default.");
  m.def(
      "embedded_source", [] { return std::string(bnb_mps::embedded_kernel_source()); },
      "The kernel amalgamation embedded at build time ('' if the build saw no kernels).");
}
