// Shared declarations of the Metal model (test-side; see README.md). Objective-C++ only.
#pragma once

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#import <MetalPerformanceShaders/MetalPerformanceShaders.h>
#include <dispatch/dispatch.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// Foundation model helpers (foundation.mm): autoreleased objects.
NSString* bnb_model_string(const std::string& text);
std::string bnb_model_text(NSString* string);
NSArray* bnb_model_array_of_strings(const std::vector<std::string>& texts);
std::string bnb_model_url_path(NSURL* url);
NSError* bnb_model_error(const std::string& description, long code);

// What the model's classes add to the declarations of tests/native_stubs (Apple's API, as torch's
// MPSStream.mm calls it: +[MPSCommandBuffer commandBufferFromCommandQueue:], -computeCommandEncoder,
// -waitUntilCompleted), and the model's own buffer.
@interface MPSCommandBuffer ()
+ (MPSCommandBuffer*)commandBufferFromCommandQueue:(id<MTLCommandQueue>)commandQueue;
// (the model's) the serial queue of the stream whose buffer this is: its state is touched only there
- (void)modelSetQueue:(dispatch_queue_t)queue;
// (the model's) modelled GPU work of torch's own ops (an MPSGraph op) encoded into this buffer
- (void)modelAddWork:(double)seconds;
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (void)waitUntilCompleted;
@end

@interface BNBModelBuffer : NSObject <MTLBuffer>
// `release_memory` runs when the buffer is deallocated (what keeps `contents` alive until then)
- (instancetype)initWithContents:(void*)contents
                          length:(NSUInteger)length
                   releaseMemory:(std::function<void()>)release_memory;
- (void*)contents;
@end

namespace bnb {

bool valid_utf8(const std::string& text);
bool ascii(const std::string& text);
void model_count_object(int delta);  // live Objective-C objects of the model
long model_live_objects();

// Breaches of Apple's documented rules that real Metal or GCD would assert on, hang on, or leave
// undefined (a completed handler added after commit, dispatch_sync onto the queue it runs on, ...):
// recorded, for the tests to fail on.
void model_misuse(const std::string& what);
std::vector<std::string> model_misuses(bool clear);

// One argument of a recorded dispatch: a buffer's bytes from `address` (contents + offset) to the
// buffer's end, or setBytes' bytes (copied when set, as Metal does).
struct Binding {
  bool is_buffer = false;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string bytes;
  // The bound MTLBuffer, retained until the command buffer is done with it (Metal's command buffers
  // retain the resources their encoders bind, unless made with unretained references).
  std::shared_ptr<void> retained;
};

// How the model compiles and runs kernels (the Python side installs the emulator here).
struct Runtime {
  // MSL source at a Metal language version ("3.1", "3.2", "4.0": the compile options') -> a library
  // handle and its kernel names; false with the compiler's message.
  std::function<bool(const std::string& source, const std::string& version, long* handle,
                     std::vector<std::string>* names, std::string* error)>
      compile;
  // Runs one dispatch of `kernel` of library `handle` over `grid` threadgroups of `threadgroup`
  // threads; "" when it ran, else the fault's text.
  std::function<std::string(long handle, const std::string& kernel, const std::array<uint64_t, 3>& grid,
                            const std::array<uint64_t, 3>& threadgroup, const std::vector<Binding>& bindings)>
      run;
  // maxTotalThreadsPerThreadgroup of a kernel's pipeline (1024 unless the tests say otherwise)
  std::function<uint64_t(const std::string& kernel)> max_threads;
  // seconds the modelled GPU waits before it starts a committed command buffer (the host goes on)
  double start_delay = 0.0;
  // false (the default): each dispatch runs when it is encoded, in stream order with the CPU work
  // torch's own ops do on the same CPU tensors (on a Mac those ops follow on the same stream, so they
  // see the kernel's results; here they run on the host at once); the command buffer still reports
  // completion (status, error, GPU times, handlers) only after its commit, asynchronously.
  // true: dispatches run when the modelled GPU takes the committed buffer (nothing is computed
  // before a commit: a test that the host never reads a result before synchronizing).
  bool deferred = false;
  // The modelled GPU clock (deterministic): when `modelled_clock`, the GPU runs committed buffers back to
  // back from a clock of its own, each taking `buffer_seconds` plus `kernel_seconds(kernel)` per
  // dispatch that ran (a buffer stops at its first fault) plus the modelled work of torch's own ops
  // in it; GPUStartTime/GPUEndTime are that clock's. Otherwise they are host times of the run.
  bool modelled_clock = false;
  double buffer_seconds = 0.0;
  std::function<double(const std::string& kernel)> kernel_seconds;
  // seconds the modelled GPU waits, after waking the buffer's waiters, before calling its completed
  // handlers (Metal promises no order between the two)
  double handler_delay = 0.0;
};
Runtime& runtime();

// Host time in seconds (CFTimeInterval), the clock of GPUStartTime/GPUEndTime.
double host_time();

// True when the calling thread runs a block on `queue` now (GCD's dispatch_sync, modelled in stream.mm).
bool on_queue(dispatch_queue_t queue);

}  // namespace bnb
