// The native Metal executor of bnb_mps: compile or load the kernel library once, cache one compute
// pipeline per kernel name, and encode launches on PyTorch's current MPS stream.
//
// This interface is plain C++ (no Objective-C types), so that it can be read and included without
// Apple's SDK; everything Metal lives in mps_ops.mm. It knows nothing of bitsandbytes: the Python
// op layer chooses kernels, grids and arguments (bnb_mps/ops), the Python executor validates the
// launch geometry (bnb_mps/executors/native.py).
//
// Errors are C++ exceptions, never aborts: std::invalid_argument for bad input (ValueError in
// Python), std::runtime_error for Metal failures (RuntimeError in Python), PipelineLimit for a
// threadgroup larger than a kernel's pipeline allows (PipelineLimitError in Python).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bnb_mps {

// Thrown by KernelLibrary::launch before anything is encoded: the threadgroup has more threads than
// the kernel's pipeline allows on this GPU (maxTotalThreadsPerThreadgroup, which register pressure
// can bring below 1024, per kernel and GPU). Python sees bnb_mps.executors.base.PipelineLimitError.
struct PipelineLimit : std::runtime_error {
  PipelineLimit(const std::string& kernel_, uint64_t threads_, uint64_t maximum_)
      : std::runtime_error("threadgroup of " + std::to_string(threads_) + " threads exceeds the " +
                           std::to_string(maximum_) + " that kernel '" + kernel_ + "' allows"),
        kernel(kernel_),
        threads(threads_),
        maximum(maximum_) {}

  std::string kernel;
  uint64_t threads;  // threads per threadgroup the launch asked for
  uint64_t maximum;  // the pipeline's maxTotalThreadsPerThreadgroup
};

class CommandBufferWatch;

// Threadgroups per grid, or threads per threadgroup: (x, y, z).
using Dim3 = std::array<uint64_t, 3>;

// One launch argument, bound to [[buffer(i)]] for the i-th argument: either an mps tensor (bound
// as its storage's MTLBuffer at byte offset storage_offset * element_size) or the exact bytes of
// a `constant T&` scalar (bound with setBytes).
struct KernelArg {
  at::Tensor tensor;  // defined() for a buffer argument
  std::string bytes;  // otherwise: the scalar's bytes (1..4096 of them)
};

// What Metal reports for one compiled kernel.
struct PipelineInfo {
  uint64_t max_total_threads_per_threadgroup;
  uint64_t thread_execution_width;
  uint64_t static_threadgroup_memory_length;
};

class KernelLibrary {
 public:
  // Compiles MSL source at run time with safe math (no fast-math), at Metal 3.2 from macOS 15 on
  // (where the source's `#pragma METAL fp` lines apply) and 3.1 on macOS 14 (see
  // compile_language_version). Throws std::runtime_error with the compiler's message on failure.
  // The Python side calls it once per compile unit (one .metal file with its includes inlined).
  // `version`: {0, 0} for the version compile_language_version() says, else exactly that Metal
  // language version (std::invalid_argument where this SDK or OS has none).
  static std::shared_ptr<KernelLibrary> compile(const std::string& source, std::pair<int, int> version = {0, 0});

  // Loads a .metallib built offline (xcrun metal). Throws std::runtime_error on failure.
  static std::shared_ptr<KernelLibrary> load_metallib(const std::string& path);

  ~KernelLibrary();
  KernelLibrary(const KernelLibrary&) = delete;
  KernelLibrary& operator=(const KernelLibrary&) = delete;

  // "source" or "metallib:<path>".
  const std::string& origin() const;

  // Names of the kernel functions in the library.
  std::vector<std::string> function_names() const;

  // Creates (on first use) and describes the pipeline of `kernel`; std::invalid_argument naming
  // it when the library has no such function.
  PipelineInfo pipeline_info(const std::string& kernel);

  // Encodes `kernel` over `grid` threadgroups of `threadgroup` threads on PyTorch's current MPS
  // stream. Asynchronous: never ends the encoder, commits or waits. A grid with a zero dimension
  // encodes nothing; a threadgroup above the pipeline's maximum throws PipelineLimit.
  // With a `watch`, the command buffer that holds the dispatch gets the watch's completed handler,
  // attached on the stream's queue in the same step as the dispatch (see CommandBufferWatch).
  void launch(const std::string& kernel, const Dim3& grid, const Dim3& threadgroup,
              const std::vector<KernelArg>& args, CommandBufferWatch* watch = nullptr);

  struct Impl;

 private:
  explicit KernelLibrary(std::unique_ptr<Impl> impl);
  // The body of launch(), run inside its autorelease pool.
  void encode(const std::string& kernel, const Dim3& grid, const Dim3& threadgroup,
              const std::vector<KernelArg>& args, CommandBufferWatch* watch);
  std::unique_ptr<Impl> impl_;
};

// What the GPU reports of the command buffers that hold some launches: whether it ran them, which
// torch's synchronize() does not say (it waits for a command buffer but never reads its status),
// and when. A launch given the watch (KernelLibrary::launch) adds the watch's completed handler to
// the command buffer of PyTorch's current MPS stream that holds it, inside the launch's own
// dispatch_sync on the stream's queue (so it cannot land on a later buffer, or on one already
// committed). Each watched launch adds one handler, so a buffer that holds several reports several
// times. After a synchronisation:
// - `errors()` waits (at most `timeout_seconds`) until every handler has run and returns the error
//   text of each buffer that failed (a GPU page fault, a watchdog timeout, ...), plus a line if some
//   did not report in time. First-use verification (bnb_mps/ops/verify) reads it.
// - `gpu_times()`, after errors() has waited, returns the (GPUStartTime, GPUEndTime) pair of each
//   handler that has run, in seconds (CFTimeInterval, one clock for every buffer): the GPU's own
//   times of the buffer, host encoding and waiting excluded. A batch of launches took
//   max(end) - min(start) of the pairs of its watch (a pair with end <= start is no measurement).
// `track()` instead adds the handler to the stream's current command buffer after the fact (on the
// stream's queue): the buffer of what was encoded last only if no other thread committed it
// meanwhile, so launches that can be given the watch should be. Where the stream has no current
// buffer (everything encoded was committed, e.g. by a synchronisation) it watches nothing and
// returns false: it never makes an empty buffer to watch.
// The launch path never reads a watch.
class CommandBufferWatch {
 public:
  CommandBufferWatch();
  bool track();
  std::vector<std::string> errors(double timeout_seconds);
  std::vector<std::pair<double, double>> gpu_times() const;

  struct State;

 private:
  friend class KernelLibrary;  // (launch attaches the handler)
  std::shared_ptr<State> state_;
};

// The Metal language version KernelLibrary::compile requests here, {major, minor}: {3, 2} from macOS
// 15 on when the module was built with the macOS 15 SDK or newer, {3, 1} on macOS 14 (and on every
// macOS with an older SDK), {0, 0} (the OS compiler's default) before.
std::pair<int, int> compile_language_version();

// The kernel amalgamation embedded at build time (empty if the build saw no kernel files).
std::string_view embedded_kernel_source();

}  // namespace bnb_mps
