// The emulator runtime: runs one kernel dispatch over simulated threadgroups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bnb_emu/abi.h"

namespace bnb_emu {

enum class LaneOrder { Forward = 0, Reverse = 1, Random = 2 };

// One [[buffer(i)]] binding: host memory that is copied into a guarded allocation for the
// dispatch (and back afterwards when `writable`).
struct HostBuffer {
  uintptr_t host = 0;
  size_t size = 0;
  size_t align = 1;  // natural alignment of the data (element size), at most 16
  bool writable = true;
};

struct LaunchRequest {
  bnb_emu_kernel_fn fn = nullptr;
  std::string kernel;
  uint32_t groups[3] = {1, 1, 1};     // threadgroups per grid
  uint32_t group_size[3] = {1, 1, 1}; // threads per threadgroup (dispatch size)
  uint32_t threads[3] = {0, 0, 0};    // threads per grid (non-uniform edge groups when not a multiple)
  std::vector<HostBuffer> buffers;
  LaneOrder order = LaneOrder::Forward;
  uint64_t seed = 0;
  uint8_t poison = 0xFF;
  bool race_check = false;
};

struct LaunchResult {
  int kind = BNB_EMU_OK;
  std::string message;
  std::string where;        // "file:line" of the construct, when known
  std::string object_path;  // the shared object holding the faulting instruction, if any
  uintptr_t pc_offset = 0;  // its offset in that object (for addr2line)
};

// Runs the dispatch on the worker pool; blocks until it finishes.
LaunchResult launch(const LaunchRequest& req);

// The table handed to kernel modules.
const bnb_emu_runtime* runtime_table();

// Number of worker threads (BNB_MPS_EMU_THREADS, default: hardware threads).
unsigned worker_count();

}  // namespace bnb_emu
