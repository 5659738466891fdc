// Model of the Metal objects csrc/mps_ops.mm and torch's MPS stream use, after Apple's Metal
// documentation (test-side; see README.md): a device that compiles MSL source into libraries, their
// functions and compute pipelines; command buffers with one compute encoder at a time, which record
// setComputePipelineState/setBuffer/setBytes/dispatchThreadgroups; commit, which hands the buffer to
// the modelled GPU (one thread taking committed buffers in commit order, after the host has gone
// on); then status, error, GPUStartTime/GPUEndTime, the waiters woken and then the completed handlers
// (Metal documents no order between waitUntilCompleted returning and the handlers: the model wakes the
// waiters first, so code that reads what a handler records must wait for the handler itself).
// addCompletedHandler: only before commit (Apple: "Call this method before you commit the command
// buffer") and, for a buffer of torch's stream, on the stream's serial queue (torch's stream state is
// touched only there; off it, a commit on the queue can come first). Kernels run under the emulator through bnb::runtime(): by default each dispatch
// as it is encoded (bnb::Runtime::deferred says why), the buffer reporting it after its commit.
// Manual reference counting.
#include "model.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

extern "C" void* _Block_copy(const void*);
extern "C" void _Block_release(const void*);

namespace bnb {

Runtime& runtime() {
  static Runtime* instance = new Runtime();
  return *instance;
}

double host_time() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {
std::mutex misuse_mutex;
std::vector<std::string>* misuse_list = new std::vector<std::string>();
std::atomic<long> live_objects{0};
}  // namespace

void model_misuse(const std::string& what) {
  std::lock_guard<std::mutex> lock(misuse_mutex);
  misuse_list->push_back(what);
}

std::vector<std::string> model_misuses(bool clear) {
  std::lock_guard<std::mutex> lock(misuse_mutex);
  std::vector<std::string> out = *misuse_list;
  if (clear) {
    misuse_list->clear();
  }
  return out;
}

void model_count_object(int delta) { live_objects += delta; }

extern "C" void bnb_model_misuse_c(const char* what) { model_misuse(what); }
long model_live_objects() { return live_objects.load(); }

bool ascii(const std::string& text) {
  for (unsigned char c : text) {
    if (c >= 0x80) return false;
  }
  return true;
}

bool valid_utf8(const std::string& text) {
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = text[i];
    size_t n;  // continuation bytes of this sequence
    if (c < 0x80) {
      n = 0;
    } else if ((c >> 5) == 0x6) {
      n = 1;
    } else if ((c >> 4) == 0xE) {
      n = 2;
    } else if ((c >> 3) == 0x1E) {
      n = 3;
    } else {
      return false;
    }
    if (i + n >= text.size() && n > 0) {
      return false;
    }
    for (size_t k = 1; k <= n; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) >> 6) != 0x2) return false;
    }
    i += n + 1;
  }
  return true;
}

}  // namespace bnb

// -- buffers, libraries, functions, pipelines ---------------------------------------------------------

@implementation BNBModelBuffer {
  void* _contents;
  NSUInteger _length;
  std::function<void()>* _release_memory;
}
- (instancetype)initWithContents:(void*)contents
                          length:(NSUInteger)length
                   releaseMemory:(std::function<void()>)release_memory {
  _contents = contents;
  _length = length;
  _release_memory = new std::function<void()>(std::move(release_memory));
  return self;
}
- (void)dealloc {
  if (*_release_memory) {
    (*_release_memory)();
  }
  delete _release_memory;
  [super dealloc];
}
- (void*)contents {
  return _contents;
}
- (NSUInteger)length {
  return _length;
}
@end

@interface BNBModelFunction : NSObject <MTLFunction>
- (instancetype)initWithName:(const std::string&)name library:(long)handle;
- (const std::string&)modelName;
- (long)modelLibrary;
@end

@implementation BNBModelFunction {
  std::string* _name;
  long _library;
}
- (instancetype)initWithName:(const std::string&)name library:(long)handle {
  _name = new std::string(name);
  _library = handle;
  return self;
}
- (NSString*)name {
  return bnb_model_string(*_name);
}
- (const std::string&)modelName {
  return *_name;
}
- (long)modelLibrary {
  return _library;
}
- (void)dealloc {
  delete _name;
  [super dealloc];
}
@end

@interface BNBModelLibrary : NSObject <MTLLibrary>
- (instancetype)initWithHandle:(long)handle names:(const std::vector<std::string>&)names;
@end

@implementation BNBModelLibrary {
  long _handle;
  std::vector<std::string>* _names;
}
- (instancetype)initWithHandle:(long)handle names:(const std::vector<std::string>&)names {
  _handle = handle;
  _names = new std::vector<std::string>(names);
  return self;
}
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName {
  const std::string name = bnb_model_text(functionName);
  for (const std::string& known : *_names) {
    if (known == name) {
      return [[BNBModelFunction alloc] initWithName:name library:_handle];  // (new...: +1)
    }
  }
  return nil;
}
- (NSArray<NSString*>*)functionNames {
  return bnb_model_array_of_strings(*_names);
}
- (void)dealloc {
  delete _names;
  [super dealloc];
}
@end

@interface BNBModelPipeline : NSObject <MTLComputePipelineState>
- (instancetype)initWithFunction:(BNBModelFunction*)function;
- (long)modelLibrary;
- (const std::string&)modelKernel;
@end

@implementation BNBModelPipeline {
  long _library;
  std::string* _kernel;
  NSUInteger _max_threads;
}
- (instancetype)initWithFunction:(BNBModelFunction*)function {
  _library = [function modelLibrary];
  _kernel = new std::string([function modelName]);
  _max_threads = bnb::runtime().max_threads ? bnb::runtime().max_threads(*_kernel) : 1024;
  return self;
}
- (long)modelLibrary {
  return _library;
}
- (const std::string&)modelKernel {
  return *_kernel;
}
- (NSUInteger)maxTotalThreadsPerThreadgroup {
  return _max_threads;
}
- (NSUInteger)threadExecutionWidth {
  return 32;  // every Apple GPU so far
}
- (NSUInteger)staticThreadgroupMemoryLength {
  return 0;  // (the model does not size the kernels' threadgroup arrays)
}
- (void)dealloc {
  delete _kernel;
  [super dealloc];
}
@end

@implementation MTLCompileOptions {
  BOOL _fast_math;
  MTLMathMode _math_mode;
  MTLMathFloatingPointFunctions _functions;
  MTLLanguageVersion _version;
}
- (instancetype)init {
  _fast_math = YES;  // (Apple's defaults)
  _math_mode = MTLMathModeFast;
  _functions = MTLMathFloatingPointFunctionsFast;
  _version = MTLLanguageVersion3_0;
  return self;
}
- (BOOL)fastMathEnabled {
  return _fast_math;
}
- (void)setFastMathEnabled:(BOOL)value {
  _fast_math = value;
  _math_mode = value ? MTLMathModeFast : MTLMathModeSafe;
}
- (MTLMathMode)mathMode {
  return _math_mode;
}
- (void)setMathMode:(MTLMathMode)value {
  _math_mode = value;
  _fast_math = value == MTLMathModeFast;
}
- (MTLMathFloatingPointFunctions)mathFloatingPointFunctions {
  return _functions;
}
- (void)setMathFloatingPointFunctions:(MTLMathFloatingPointFunctions)value {
  _functions = value;
}
- (MTLLanguageVersion)languageVersion {
  return _version;
}
- (void)setLanguageVersion:(MTLLanguageVersion)value {
  _version = value;
}
@end

// -- command buffers and their compute encoder --------------------------------------------------------

namespace {

struct Dispatch {
  long library;
  std::string kernel;
  std::array<uint64_t, 3> grid, threadgroup;
  std::vector<bnb::Binding> bindings;
};

// The modelled GPU: runs committed command buffers one at a time, in commit order, on its thread.
class Gpu {
 public:
  static Gpu& instance() {
    static Gpu* gpu = new Gpu();  // (lives for the process; its thread is detached)
    return *gpu;
  }
  void submit(MPSCommandBuffer* buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(buffer);
    ready_.notify_one();
  }

 private:
  Gpu() { std::thread([this] { loop(); }).detach(); }
  void loop();
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<MPSCommandBuffer*> queue_;
};

}  // namespace

@interface MPSCommandBuffer ()
- (void)modelRun;
- (void)modelRecord:(const Dispatch&)dispatch;
+ (std::string)modelExecute:(const Dispatch&)dispatch;
- (void)modelEncoderEnded;
+ (double)modelSeconds:(const Dispatch&)dispatch;
@end

@interface BNBModelComputeEncoder : NSObject <MTLComputeCommandEncoder>
- (instancetype)initWithBuffer:(MPSCommandBuffer*)buffer;
@end

@implementation BNBModelComputeEncoder {
  MPSCommandBuffer* _buffer;  // (not retained: the buffer owns its encoder's lifetime in the model)
  BNBModelPipeline* _pipeline;
  std::map<NSUInteger, bnb::Binding>* _bindings;
  bool _ended;
}
- (instancetype)initWithBuffer:(MPSCommandBuffer*)buffer {
  _buffer = buffer;
  _bindings = new std::map<NSUInteger, bnb::Binding>();
  return self;
}
- (bool)usable:(const char*)call {
  if (_ended) {
    bnb::model_misuse(std::string(call) + " on a compute encoder after endEncoding");
    return false;
  }
  return true;
}
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state {
  if (![self usable:"setComputePipelineState:"]) return;
  [(id)state retain];
  [_pipeline release];
  _pipeline = (BNBModelPipeline*)state;
}
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index {
  if (![self usable:"setBytes:length:atIndex:"]) return;
  if (length > 4096) {
    bnb::model_misuse("setBytes: of " + std::to_string(length) + " bytes (Metal allows at most 4096)");
  }
  bnb::Binding binding;
  binding.bytes.assign(static_cast<const char*>(bytes), length);  // (copied now, as Metal does)
  (*_bindings)[index] = binding;
}
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index {
  if (![self usable:"setBuffer:offset:atIndex:"]) return;
  bnb::Binding binding;
  binding.is_buffer = true;
  if (buffer != nil) {
    BNBModelBuffer* model = (BNBModelBuffer*)buffer;
    if (offset > [model length]) {
      bnb::model_misuse("setBuffer: offset " + std::to_string(offset) + " beyond the buffer's " +
                        std::to_string([model length]) + " bytes");
    }
    binding.address = reinterpret_cast<uint64_t>([model contents]) + offset;
    binding.length = offset <= [model length] ? [model length] - offset : 0;
    binding.retained = std::shared_ptr<void>((void*)[model retain], [](void* held) { [(id)held release]; });
  }
  (*_bindings)[index] = binding;
}
- (void)dispatchThreadgroups:(MTLSize)groups threadsPerThreadgroup:(MTLSize)threads {
  if (![self usable:"dispatchThreadgroups:threadsPerThreadgroup:"]) return;
  if (_pipeline == nil) {
    bnb::model_misuse("dispatchThreadgroups: without a compute pipeline state");
    return;
  }
  Dispatch dispatch;
  dispatch.library = [_pipeline modelLibrary];
  dispatch.kernel = [_pipeline modelKernel];
  dispatch.grid = {groups.width, groups.height, groups.depth};
  dispatch.threadgroup = {threads.width, threads.height, threads.depth};
  NSUInteger count = _bindings->empty() ? 0 : _bindings->rbegin()->first + 1;
  for (NSUInteger i = 0; i < count; ++i) {
    auto found = _bindings->find(i);
    if (found == _bindings->end()) {
      bnb::model_misuse("dispatch of '" + dispatch.kernel + "' with [[buffer(" + std::to_string(i) + ")]] unbound");
      return;
    }
    dispatch.bindings.push_back(found->second);
  }
  [_buffer modelRecord:dispatch];
}
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threads {
  bnb::model_misuse("dispatchThreads: is not modelled (the native executor dispatches threadgroups)");
}
- (void)endEncoding {
  if (![self usable:"endEncoding"]) return;
  _ended = true;
  [_buffer modelEncoderEnded];
}
- (void)dealloc {
  [_pipeline release];
  delete _bindings;
  [super dealloc];
}
@end

@implementation MPSCommandBuffer {
  std::mutex* _mutex;
  std::condition_variable* _done;
  MTLCommandBufferStatus _status;
  NSError* _error;
  double _start, _end;
  std::vector<Dispatch>* _dispatches;
  std::vector<MTLCommandBufferHandler>* _handlers;
  BNBModelComputeEncoder* _encoder;  // the open one, if any
  double _eager_start, _eager_end;     // dispatches run as encoded: when they ran,
  std::string* _eager_fault;           // and the first fault
  double _work;                        // modelled GPU seconds of what ran (bnb::Runtime::modelled_clock)
  dispatch_queue_t _queue;             // the serial queue of the stream that owns it (nullptr: none)
}
+ (MPSCommandBuffer*)commandBufferFromCommandQueue:(id<MTLCommandQueue>)commandQueue {
  return [[[self alloc] init] autorelease];
}
- (instancetype)init {
  _mutex = new std::mutex();
  _done = new std::condition_variable();
  _status = MTLCommandBufferStatusNotEnqueued;
  _dispatches = new std::vector<Dispatch>();
  _handlers = new std::vector<MTLCommandBufferHandler>();
  _eager_fault = new std::string();
  return self;
}
- (id<MTLComputeCommandEncoder>)computeCommandEncoder {
  std::lock_guard<std::mutex> lock(*_mutex);
  if (_status != MTLCommandBufferStatusNotEnqueued) {
    bnb::model_misuse("computeCommandEncoder on a committed command buffer");
    return nil;
  }
  if (_encoder != nil) {
    bnb::model_misuse("computeCommandEncoder while another encoder of the buffer is open (not ended)");
  }
  [_encoder release];
  _encoder = [[BNBModelComputeEncoder alloc] initWithBuffer:self];
  return [[_encoder retain] autorelease];
}
- (void)modelSetQueue:(dispatch_queue_t)queue {
  std::lock_guard<std::mutex> lock(*_mutex);
  _queue = queue;
}
- (void)modelAddWork:(double)seconds {
  std::lock_guard<std::mutex> lock(*_mutex);
  if (_status != MTLCommandBufferStatusNotEnqueued) {
    bnb::model_misuse("work encoded into a committed command buffer");
    return;
  }
  if (_eager_fault->empty()) {
    _work += seconds;  // (a buffer runs nothing after its first fault)
  }
}
- (void)modelRecord:(const Dispatch&)dispatch {
  if (bnb::runtime().deferred) {
    std::lock_guard<std::mutex> lock(*_mutex);
    _dispatches->push_back(dispatch);
    return;
  }
  // Run in stream order now (see bnb::Runtime::deferred); the buffer reports it after its commit.
  std::string fault;
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    if (!_eager_fault->empty()) {
      return;  // (a buffer stops at its first fault)
    }
  }
  const double start = bnb::host_time();
  fault = [MPSCommandBuffer modelExecute:dispatch];
  const double end = bnb::host_time();
  std::lock_guard<std::mutex> lock(*_mutex);
  _eager_start = _eager_start == 0 ? start : _eager_start;
  _eager_end = end;
  *_eager_fault = fault;
  _work += [MPSCommandBuffer modelSeconds:dispatch];
}
+ (double)modelSeconds:(const Dispatch&)d {
  return bnb::runtime().kernel_seconds ? bnb::runtime().kernel_seconds(d.kernel) : 0.0;
}
+ (std::string)modelExecute:(const Dispatch&)d {
  return bnb::runtime().run ? bnb::runtime().run(d.library, d.kernel, d.grid, d.threadgroup, d.bindings)
                            : "the Metal model has no runtime to run kernels with";
}
- (void)modelEncoderEnded {
  std::lock_guard<std::mutex> lock(*_mutex);
  [_encoder release];
  _encoder = nil;
}
- (void)addCompletedHandler:(MTLCommandBufferHandler)block {
  std::lock_guard<std::mutex> lock(*_mutex);
  if (_status != MTLCommandBufferStatusNotEnqueued) {
    // Apple: "Call this method before you commit the command buffer."
    bnb::model_misuse("addCompletedHandler: on a command buffer already committed (its handler would never run)");
    return;
  }
  if (_queue != nullptr && !bnb::on_queue(_queue)) {
    bnb::model_misuse("addCompletedHandler: off the serial queue of the stream that owns the command buffer "
                      "(a commit on the queue may come first, and the handler is then never called)");
    return;
  }
  _handlers->push_back((MTLCommandBufferHandler)_Block_copy((const void*)block));
}
- (void)commit {
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    if (_status != MTLCommandBufferStatusNotEnqueued) {
      bnb::model_misuse("commit of a command buffer committed before");
      return;
    }
    if (_encoder != nil) {
      bnb::model_misuse("commit with a compute encoder not ended (endEncoding)");
    }
    _status = MTLCommandBufferStatusCommitted;
  }
  [self retain];  // (the GPU holds it until it has run)
  Gpu::instance().submit(self);
}
- (void)waitUntilCompleted {
  std::unique_lock<std::mutex> lock(*_mutex);
  if (_status == MTLCommandBufferStatusNotEnqueued) {
    bnb::model_misuse("waitUntilCompleted on a command buffer never committed (waits forever)");
    return;
  }
  _done->wait(lock, [&] { return _status == MTLCommandBufferStatusCompleted || _status == MTLCommandBufferStatusError; });
}
- (void)modelRun {
  std::vector<Dispatch> dispatches;
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    _status = MTLCommandBufferStatusScheduled;
    dispatches = *_dispatches;
  }
  double start = bnb::host_time();
  std::string fault;
  double work = 0.0;
  for (const Dispatch& d : dispatches) {
    fault = [MPSCommandBuffer modelExecute:d];
    work += [MPSCommandBuffer modelSeconds:d];
    if (!fault.empty()) {
      break;  // (the rest of the buffer does not run)
    }
  }
  double end = bnb::host_time();
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    if (_eager_start != 0) {  // (ran as encoded)
      start = _eager_start;
      end = _eager_end;
      fault = *_eager_fault;
    }
    work += _work;
  }
  const bool modelled = bnb::runtime().modelled_clock;
  if (modelled) {  // (the GPU thread runs one buffer at a time: the clock is its own)
    static double gpu_now = 1000.0;
    start = gpu_now;
    end = start + bnb::runtime().buffer_seconds + work;
    gpu_now = end;
  }
  std::vector<MTLCommandBufferHandler> handlers;
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    _start = start;
    _end = end > start || modelled ? end : start + 1e-9;
    if (!fault.empty()) {
      _error = [bnb_model_error("Execution of the command buffer was aborted due to an error during execution. " +
                                    fault,
                                3) retain];
    }
    handlers.swap(*_handlers);
  }
  {
    std::lock_guard<std::mutex> lock(*_mutex);
    _status = fault.empty() ? MTLCommandBufferStatusCompleted : MTLCommandBufferStatusError;
    _done->notify_all();  // (waiters first: see the top of this file)
  }
  if (bnb::runtime().handler_delay > 0 && !handlers.empty()) {
    std::this_thread::sleep_for(std::chrono::duration<double>(bnb::runtime().handler_delay));
  }
  @autoreleasepool {
    for (MTLCommandBufferHandler handler : handlers) {  // (Metal calls them once the buffer has run)
      handler(self);
      _Block_release((const void*)handler);
    }
  }
}
- (MTLCommandBufferStatus)status {
  std::lock_guard<std::mutex> lock(*_mutex);
  return _status;
}
- (nullable NSError*)error {
  std::lock_guard<std::mutex> lock(*_mutex);
  return [[_error retain] autorelease];
}
- (CFTimeInterval)GPUStartTime {
  std::lock_guard<std::mutex> lock(*_mutex);
  return _start;
}
- (CFTimeInterval)GPUEndTime {
  std::lock_guard<std::mutex> lock(*_mutex);
  return _end;
}
- (void)dealloc {
  for (MTLCommandBufferHandler handler : *_handlers) {
    _Block_release((const void*)handler);
  }
  [_encoder release];
  [_error release];
  delete _handlers;
  delete _eager_fault;
  delete _dispatches;
  delete _done;
  delete _mutex;
  [super dealloc];
}
@end

void Gpu::loop() {
  for (;;) {
    MPSCommandBuffer* buffer;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [&] { return !queue_.empty(); });
      buffer = queue_.front();
      queue_.pop_front();
    }
    if (bnb::runtime().start_delay > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(bnb::runtime().start_delay));
    }
    @autoreleasepool {
      [buffer modelRun];
    }
    [buffer release];
  }
}

// -- the device ---------------------------------------------------------------------------------------

@interface BNBModelDevice : NSObject <MTLDevice>
@end

// The version a compile asks for, as the emulator names it (its __METAL_VERSION__ follows: the source's
// `#if __METAL_VERSION__ >= 320` parts exist at 3.2 and later only). nil options: Metal's default, taken
// as 3.1 (every version the module requests is set explicitly).
static std::string model_language_version(MTLCompileOptions* options) {
  const MTLLanguageVersion version = options != nil ? options.languageVersion : MTLLanguageVersion3_1;
  if (version == MTLLanguageVersion4_0) return "4.0";
  if (version == MTLLanguageVersion3_2) return "3.2";
  if (version != MTLLanguageVersion3_1) {
    bnb::model_misuse("a compile at a Metal language version the model does not run (below 3.1)");
  }
  return "3.1";
}

@implementation BNBModelDevice
- (NSString*)name {
  return bnb_model_string("bnb-mps Metal model (kernels under the emulator)");
}
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error {
  long handle = -1;
  std::vector<std::string> names;
  std::string message;
  if (!bnb::runtime().compile) {
    message = "the Metal model has no runtime to compile kernels with";
  } else if (bnb::runtime().compile(bnb_model_text(source), model_language_version(options), &handle, &names,
                                    &message)) {
    return [[BNBModelLibrary alloc] initWithHandle:handle names:names];
  }
  if (error != nullptr) {
    *error = bnb_model_error("Compilation failed: \n\n" + message, 3);
  }
  return nil;
}
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(__autoreleasing NSError* _Nullable* _Nullable)error {
  if (error != nullptr) {  // (no metallib exists here: Xcode's `metal` makes them)
    *error = bnb_model_error("Invalid library file " + bnb_model_url_path(url) + " (the Metal model loads no metallib)", 1);
  }
  return nil;
}
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)function
                                                                      error:(__autoreleasing NSError* _Nullable* _Nullable)error {
  return [[BNBModelPipeline alloc] initWithFunction:(BNBModelFunction*)function];
}
@end

id<MTLDevice> bnb_model_device() {
  static BNBModelDevice* device = [[BNBModelDevice alloc] init];
  return device;
}
