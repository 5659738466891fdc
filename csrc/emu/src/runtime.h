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

// Profiling (bnb_mps.emulator's Library.profile): how each binding is counted.
struct ProfileBinding {
  bool counted = false;     // a buffer argument; scalars (Metal's setBytes) are not memory traffic
  uint32_t line_offset = 0; // where the binding starts relative to a line boundary on the GPU
};

// What one counted binding saw during a profiled dispatch (lines are line_bytes long).
struct BufferTraffic {
  uint64_t load_bytes = 0, store_bytes = 0, atomic_bytes = 0;
  uint64_t accesses = 0;       // device accesses (loads, stores, atomics) into this binding
  uint64_t unique_bytes = 0;   // distinct bytes touched
  uint64_t lines = 0;          // distinct lines touched
  uint64_t lines_summed = 0;   // distinct lines touched by each threadgroup, summed over threadgroups
  uint64_t transactions = 0;   // lines touched by SIMD-group memory instructions, summed over them
};

struct ProfileResult {
  std::vector<BufferTraffic> buffers;  // one per binding (all zero for uncounted ones)
  uint64_t instructions = 0;           // SIMD-group memory instructions
  uint64_t transactions = 0;           // sum of buffers[].transactions
  uint64_t threadgroups = 0, threads = 0;
  uint64_t barriers = 0, barriers_max = 0;  // barriers executed: in all, most in one threadgroup
  uint64_t collectives = 0;                 // SIMD-group collectives executed (once per simdgroup)
  uint64_t threadgroup_memory_max = 0;      // largest threadgroup allocation of one threadgroup
  uint64_t threadgroup_load_bytes = 0, threadgroup_store_bytes = 0, threadgroup_atomic_bytes = 0;
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
  // Float arithmetic as on Apple GPUs: float32 subnormal inputs and results flush to zero (fp16
  // keeps its subnormals). False runs IEEE arithmetic, for comparison.
  bool flush_subnormals = true;
  // The coherence check (runtime.cpp, "Memory model"): needs a module built with BNB_EMU_PROFILE
  // (its loads and stores instrumented); metal_version is __METAL_VERSION__ (310, 320, 400).
  bool coherence_check = false;
  uint32_t metal_version = 310;
  // Profiling: needs a module built with BNB_EMU_PROFILE; one entry per buffer.
  bool profiling = false;
  uint32_t line_bytes = 128;
  std::vector<ProfileBinding> profile;
};

struct LaunchResult {
  int kind = BNB_EMU_OK;
  std::string message;
  std::string where;        // "file:line" of the construct, when known
  std::string object_path;  // the shared object holding the faulting instruction, if any
  uintptr_t pc_offset = 0;  // its offset in that object (for addr2line)
  ProfileResult profile;    // when profiling and kind == BNB_EMU_OK
};

// Runs the dispatch on the worker pool; blocks until it finishes.
LaunchResult launch(const LaunchRequest& req);

// The table handed to kernel modules.
const bnb_emu_runtime* runtime_table();

// Number of worker threads (BNB_MPS_EMU_THREADS, default: hardware threads).
unsigned worker_count();

}  // namespace bnb_emu
