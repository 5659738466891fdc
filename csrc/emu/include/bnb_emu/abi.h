/* The binary interface between the emulator runtime (the `bnb_mps._emu` extension) and a kernel
 * module (a shared object built at run time from MSL text with the shim headers).
 *
 * A kernel module links against nothing: the runtime hands it this table of function pointers
 * when it is loaded, and the module hands back its kernels. Plain C types only, so that the
 * runtime and a module built by a different compiler agree on the layout.
 */
#ifndef BNB_EMU_ABI_H
#define BNB_EMU_ABI_H

#include <stddef.h>
#include <stdint.h>

#define BNB_EMU_ABI_VERSION 8

#ifdef __cplusplus
extern "C" {
#endif

/* What one simulated thread knows about itself (the values of the kernel attributes). */
typedef struct bnb_emu_lane {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];          /* actual size (smaller in non-uniform edge groups) */
  uint32_t dispatch_threads_per_threadgroup[3]; /* the size the dispatch asked for */
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t threads_per_simdgroup;     /* always 32, as on Apple GPUs */
  uint32_t simdgroups_per_threadgroup;
  uint32_t lanes_in_simdgroup;        /* threads that exist in this lane's simdgroup (<= 32) */
} bnb_emu_lane;

/* Computes a SIMD-group collective once every active lane has arrived. operands[i] and
 * results[i] point into lane i's own stack (NULL for inactive lanes); active has bit i set for
 * each lane that takes part. Resolvers are compiled into the kernel module (they know T). */
typedef void (*bnb_emu_resolver)(void* const* operands, void* const* results, uint32_t active);

/* Fault kinds, shared with the Python side (bnb_mps/emulator/errors.py). */
enum {
  BNB_EMU_OK = 0,
  BNB_EMU_OUT_OF_BOUNDS = 1,
  BNB_EMU_RACE = 2,
  BNB_EMU_BARRIER_DIVERGENCE = 3,
  BNB_EMU_DIVERGENT_COLLECTIVE = 4,
  BNB_EMU_LIMIT_EXCEEDED = 5,
  BNB_EMU_UNBOUND_BUFFER = 6,
  BNB_EMU_MEMORY_FAULT = 7,
  BNB_EMU_STACK_OVERFLOW = 8,
  BNB_EMU_KERNEL_ERROR = 9,
  BNB_EMU_COHERENCE = 10
};

/* Race-checker access kinds (only called by modules built with BNB_EMU_RACE_CHECK). */
enum { BNB_EMU_ACCESS_READ = 0, BNB_EMU_ACCESS_ATOMIC = 1 };

/* Atomic operations reported to the coherence check (coherence_atomic): what the operation did to
 * its location. A read-modify-write that did not write (a failed compare-exchange) is a READ. */
enum { BNB_EMU_ATOMIC_READ = 0, BNB_EMU_ATOMIC_STORE = 1, BNB_EMU_ATOMIC_RMW = 2 };

/* Profiler access kinds (only called by modules built with BNB_EMU_PROFILE). FORCED: record the
 * access even while the lane is muted (the shim reports what an operation it emulates with other
 * accesses, e.g. simdgroup_load, really moves). */
enum {
  BNB_EMU_PROFILE_LOAD = 0,
  BNB_EMU_PROFILE_STORE = 1,
  BNB_EMU_PROFILE_ATOMIC = 2,
  BNB_EMU_PROFILE_KIND_MASK = 3,
  BNB_EMU_PROFILE_FORCED = 4
};

/* Profiler: the memory a profiled dispatch counts, for a cheap first test in the kernel module's
 * hooks (most instrumented accesses are to the stack). An address in neither range is neither a
 * counted buffer nor threadgroup memory; sizes are 0 outside a profiled dispatch. */
typedef struct bnb_emu_profile_window {
  uintptr_t buffers_lo, buffers_size;         /* spans every counted buffer */
  uintptr_t threadgroup_lo, threadgroup_size; /* spans every worker's threadgroup memory */
} bnb_emu_profile_window;

/* A simdgroup_matrix operation (load, store, multiply) as the first lane of its simdgroup to run it
 * logged it; the other lanes' n-th operation must be the same (see bnb_emu_fiber). */
typedef struct bnb_emu_matrix_op {
  const char* what;
  const char* file;
  int32_t line;
  uint32_t lane; /* thread_index_in_threadgroup of the lane that logged it */
  uint32_t size; /* bytes of args */
  unsigned char args[44];
} bnb_emu_matrix_op;

/* A simdgroup's simdgroup_matrix operations since it last synchronised (a SIMD-group function, a
 * threadgroup barrier). */
typedef struct bnb_emu_matrix_log {
  bnb_emu_matrix_op* ops;
  uint32_t count;
} bnb_emu_matrix_log;

/* What a simulated thread keeps at the top of its fiber stack, where kernel modules find it without
 * a call: every fiber stack lies in a block of `stack_align` bytes (a power of two) aligned to its
 * size, and this header fills the block's last bytes, so that for any address p on the stack the
 * header is at ((p | (stack_align - 1)) + 1) - sizeof(bnb_emu_fiber). */
typedef struct bnb_emu_fiber {
  const bnb_emu_lane* lane;
  bnb_emu_matrix_log* matrix_log; /* its simdgroup's */
  uint32_t matrix_ops;            /* how many operations of matrix_log this lane has run */
  uint32_t reserved;
} bnb_emu_fiber;

/* The running dispatch's buffers, read by kernel modules without a call (dispatches run one at a
 * time per process): buffers[i] is the address of [[buffer(i)]] for i < buffer_count. Set before
 * the worker threads start a dispatch and cleared after it. */
typedef struct bnb_emu_dispatch {
  void* const* buffers;
  uint32_t buffer_count;
} bnb_emu_dispatch;

typedef struct bnb_emu_runtime {
  uint32_t abi_version;
  /* The calling simulated thread. */
  const bnb_emu_lane* (*lane)(void);
  /* Address of [[buffer(index)]]; reports UnboundBuffer (never returns) if nothing is bound (modules
   * read bound buffers from `dispatch` and call this for the others). */
  void* (*buffer)(uint32_t index, const char* file, int line);
  /* Threadgroup storage for one declaration site, shared by the threadgroup: the first lane to
   * arrive allocates it and fills it with the poison byte. */
  void* (*threadgroup_alloc)(const void* site, size_t size, size_t align, const char* name, const char* file,
                             int line);
  /* threadgroup_barrier: yields until every thread of the threadgroup has arrived. */
  void (*barrier)(uint32_t flags, const char* file, int line);
  /* A SIMD-group collective: yields until the simdgroup has no runnable lane, then `fn` runs. */
  void (*simd_collective)(bnb_emu_resolver fn, const char* what, void* operand, void* result, const char* file,
                          int line);
  /* Race checker: the calling lane accesses [p, p+n). */
  void (*threadgroup_access)(const void* p, size_t n, int kind, const char* file, int line);
  /* Ends the calling simulated thread with a fault (never returns). */
  void (*fail)(int kind, const char* message, const char* file, int line);
  /* Profiler: the calling lane accesses [p, p+n) (a BNB_EMU_PROFILE_* kind); ignored outside a
   * profiled dispatch and for memory that is neither a bound buffer nor threadgroup memory. */
  void (*profile_access)(const void* p, size_t n, int kind);
  /* Profiler: while muted (on != 0), the calling lane's accesses are not recorded unless FORCED. */
  void (*profile_mute)(int on);
  const volatile bnb_emu_profile_window* profile_window;
  /* A simdgroup_matrix load, store or multiply of the calling lane that is not the simdgroup's
   * matrix_log->ops[matrix_ops] (kernel modules compare first, see bnb_emu_fiber): logs it when no
   * other lane of the simdgroup has run that many operations since it last synchronised, else
   * compares it in full (the same `what`, file and line, and the same `size` bytes of `args`) and
   * reports a DivergentCollective (never returns then) when they differ. Counts it in matrix_ops.
   * Not a yield point. Returns the calling lane. */
  const bnb_emu_lane* (*matrix_op)(const char* what, const void* args, size_t size, const char* file, int line);
  const bnb_emu_dispatch* dispatch;
  uintptr_t stack_align; /* see bnb_emu_fiber */
  /* After an atomic store or read-modify-write of the calling lane at `p`: where `p` is device memory
   * (not threadgroup memory) and the dispatch is not profiled, the lane's threadgroup may be stalled
   * there while other threadgroups run (rt_device_atomic in runtime.cpp). Not a yield point. */
  void (*device_atomic)(const void* p);
  /* Coherence check (docs/emulator.md, "Memory model"): the calling lane's atomic operation at `p`
   * (a BNB_EMU_ATOMIC_* kind), called before device_atomic. Ignored outside a checked dispatch. */
  void (*coherence_atomic)(const void* p, int kind);
  /* atomic_thread_fence(flags, order, scope) of the calling lane (MSL's enum values). */
  void (*fence)(uint32_t flags, int order, int scope);
  /* The calling lane took a coherent(device) buffer argument bound at `p`. */
  void (*coherent_buffer)(const void* p);
} bnb_emu_runtime;

typedef void (*bnb_emu_kernel_fn)(void);

typedef struct bnb_emu_kernel_entry {
  const char* name;
  bnb_emu_kernel_fn fn;
} bnb_emu_kernel_entry;

typedef void (*bnb_emu_add_kernel)(void* ctx, const bnb_emu_kernel_entry* entry);

/* Exported by every kernel module. Returns the ABI version the module was built with. */
typedef uint32_t (*bnb_emu_module_init_fn)(const bnb_emu_runtime* rt, bnb_emu_add_kernel add, void* ctx);
#define BNB_EMU_MODULE_INIT_SYMBOL "bnb_emu_module_init"

#ifdef __cplusplus
}
#endif

#endif
