// Model of the part of torch's MPS runtime that csrc/mps_ops.mm uses (test-side; see README.md),
// written from torch's aten/src/ATen/mps/MPSStream.mm and MPSDevice.mm: the default stream with its
// serial dispatch queue, its current command buffer (created on first use) and one shared compute
// encoder (kernel coalescing), addCompletedHandler (dispatch_sync onto the queue, then the current
// buffer's addCompletedHandler:), and synchronize(COMMIT_AND_WAIT): end the encoder, commit the
// buffer, wait for it, start a new one on next use. MPSDevice::device() is the Metal model's device.
// GCD's dispatch_sync is modelled too: the block runs on the calling thread with the queue held; a
// dispatch_sync onto the queue the caller is running on is a deadlock in GCD, recorded here (and
// thrown) instead of hanging.
#include "model.h"

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <mutex>
#include <stdexcept>
#include <thread>

id<MTLDevice> bnb_model_device();

struct dispatch_queue_s {
  std::mutex mutex;
  std::thread::id owner;  // the thread running a block on the queue now
};

bool bnb::on_queue(dispatch_queue_t queue) { return queue->owner == std::this_thread::get_id(); }

extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block) {
  if (queue->owner == std::this_thread::get_id()) {
    bnb::model_misuse("dispatch_sync onto the serial queue the caller is running on (a deadlock in GCD)");
    throw std::runtime_error("modelled deadlock: dispatch_sync onto the serial queue the caller is running on");
  }
  std::lock_guard<std::mutex> lock(queue->mutex);
  queue->owner = std::this_thread::get_id();
  try {
    block();
  } catch (...) {
    queue->owner = std::thread::id();
    throw;
  }
  queue->owner = std::thread::id();
}

namespace at::mps {

MPSDevice* MPSDevice::_device = nullptr;

MPSDevice* MPSDevice::getInstance() {
  static std::once_flag once;
  std::call_once(once, [] { _device = new MPSDevice(); });
  return _device;
}

namespace {
id<MTLDevice>* device_slot = nullptr;  // MPSDevice's _mtl_device (the model can take the device away)
}  // namespace

MPSDevice::MPSDevice() : _mtl_device(nil) {
  _mtl_device = [bnb_model_device() retain];
  device_slot = &_mtl_device;
}

MPSDevice::~MPSDevice() {
  [_mtl_device release];
}

MPSStream::MPSStream(Stream stream) : _stream(stream) {
  _serialQueue = new dispatch_queue_s();
}

MPSStream::~MPSStream() {
  [_commandEncoder release];
  [_commandBuffer release];
  delete _serialQueue;
}

MPSCommandBuffer* MPSStream::commandBuffer() {
  if (!_commandBuffer) {
    _commandBuffer = [[MPSCommandBuffer commandBufferFromCommandQueue:_commandQueue] retain];
    [_commandBuffer modelSetQueue:_serialQueue];
  }
  return _commandBuffer;
}

id<MTLComputeCommandEncoder> MPSStream::commandEncoder() {
  if (!_commandEncoder) {
    _commandEncoder = [[commandBuffer() computeCommandEncoder] retain];
  }
  return _commandEncoder;
}

void MPSStream::endKernelCoalescing() {
  if (_commandEncoder) {
    [_commandEncoder endEncoding];
    [_commandEncoder release];
    _commandEncoder = nil;
  }
}

void MPSStream::addCompletedHandler(MTLCommandBufferHandler block) {
  dispatch_sync(_serialQueue, ^() {
    @autoreleasepool {
      [commandBuffer() addCompletedHandler:block];
    }
  });
}

void MPSStream::commit() {
  if (_commandBuffer) {
    [_commandBuffer commit];
    [_commandBuffer release];
    _commandBuffer = nil;
  }
}

void MPSStream::commitAndWait() {
  if (_commandBuffer) {
    [_commandBuffer commit];
    [_commandBuffer waitUntilCompleted];
    [_commandBuffer release];
    _commandBuffer = nil;
  }
}

void MPSStream::synchronize(SyncType syncType) {
  endKernelCoalescing();
  switch (syncType) {
    case SyncType::NONE:
      break;
    case SyncType::COMMIT:
    case SyncType::COMMIT_ADAPTIVE:
    case SyncType::COMMIT_AND_CONTINUE:  // (the model never continues a committed buffer)
      commit();
      break;
    case SyncType::COMMIT_AND_WAIT:
      commitAndWait();
      break;
  }
}

MPSStream* MPSStreamImpl::_stream = nullptr;

MPSStream* MPSStreamImpl::getInstance() {
  static std::once_flag once;
  std::call_once(once, [] {
    _stream = new MPSStream(Stream(Stream::UNSAFE, c10::Device(DeviceType::MPS, 0), 0));
  });
  return _stream;
}

MPSStream* getCurrentMPSStream() {
  return getDefaultMPSStream();
}

MPSStream* getDefaultMPSStream() {
  return MPSStreamImpl::getInstance();
}

}  // namespace at::mps

// The model's "no Metal device": MPSDevice::device() returns nil (as where Metal finds no GPU) until
// the device is given back.
void bnb_model_set_device_present(bool present) {
  at::mps::MPSDevice::getInstance();
  id<MTLDevice> device = present ? bnb_model_device() : nil;
  [device retain];
  [*at::mps::device_slot release];
  *at::mps::device_slot = device;
}
