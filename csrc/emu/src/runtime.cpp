// The emulator runtime: a pool of worker threads; each runs whole threadgroups, one fiber per
// simulated thread ("lane"). A lane runs until it reaches a yield point (threadgroup barrier,
// SIMD-group collective) or exits; when no lane can run, the scheduler resolves collectives and
// barriers and checks that the lanes agree on what they are waiting for.
#include "runtime.h"

#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "context.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BNB_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define BNB_EMU_ASAN 1
#endif
#ifndef BNB_EMU_ASAN
#define BNB_EMU_ASAN 0
#endif
#if BNB_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace bnb_emu {
namespace {

constexpr uint32_t kMaxThreadsPerGroup = 1024;
constexpr size_t kMaxThreadgroupMemory = 32768;
constexpr uint32_t kSimdWidth = 32;

size_t page_size() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

size_t stack_bytes() {
  static const size_t s = [] {
    size_t kb = BNB_EMU_ASAN ? 256 : 64;
    if (const char* e = std::getenv("BNB_MPS_EMU_STACK_KB")) {
      long v = std::strtol(e, nullptr, 10);
      if (v >= 16) kb = size_t(v);
    }
    return round_up(kb * 1024, page_size());
  }();
  return s;
}

// The block a fiber stack lies in (bnb_emu_fiber): a power of two, at least the stack and a guard page.
size_t stack_align() {
  static const size_t a = [] {
    size_t v = page_size();
    while (v < stack_bytes() + page_size()) v *= 2;
    return v;
  }();
  return a;
}

// Bytes at the top of a fiber stack that hold its bnb_emu_fiber header.
constexpr size_t kFiberHeaderBytes = 64;
static_assert(sizeof(bnb_emu_fiber) <= kFiberHeaderBytes, "the fiber header must fit its slot");

enum LaneState : uint8_t { RUNNABLE, AT_BARRIER, AT_SIMD, DONE, FAULTED };

// A fiber stack: the top stack_bytes() of a block of stack_align() bytes aligned to its size, the
// bnb_emu_fiber header in its last bytes (where kernel modules find it from any stack address), and
// PROT_NONE below (the guard: at least a page). Stacks grow down.
struct Stack {
  char* map = nullptr;  // the block; the guard runs from here to lo
  char* lo = nullptr;   // usable stack [lo, lo + size), the header above it
  size_t size = 0;
  bnb_emu_fiber* header = nullptr;
  Stack() = default;
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() {
    if (map) munmap(map, stack_align());
  }
  bool allocate() {
    const size_t align = stack_align(), bytes = stack_bytes();
    void* m = mmap(nullptr, 2 * align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return false;
    const uintptr_t start = reinterpret_cast<uintptr_t>(m), base = (start + align - 1) & ~uintptr_t(align - 1);
    if (base > start) munmap(m, base - start);
    if (base + align < start + 2 * align) munmap(reinterpret_cast<void*>(base + align), start + align - base);
    char* top = reinterpret_cast<char*>(base + align);
    map = reinterpret_cast<char*>(base);
    if (mprotect(top - bytes, bytes, PROT_READ | PROT_WRITE) != 0) return false;
    lo = top - bytes;
    size = bytes - kFiberHeaderBytes;
    header = reinterpret_cast<bnb_emu_fiber*>(top - sizeof(bnb_emu_fiber));
    return true;
  }
};

struct Worker;

uint32_t nsg_of(uint32_t lanes) { return (lanes + kSimdWidth - 1) / kSimdWidth; }

struct Lane {
  Context ctx;
  bnb_emu_lane pub;
  LaneState state = DONE;
  uint32_t index = 0;  // thread_index_in_threadgroup
  const char* file = nullptr;
  int line = 0;
  bnb_emu_resolver resolver = nullptr;
  const char* what = nullptr;
  void* operand = nullptr;
  void* result = nullptr;
  Stack* stack = nullptr;
  Worker* worker = nullptr;
  void* asan_fake = nullptr;
  bnb_emu_fiber* fiber = nullptr;  // the header of its stack
  // Coherence check (see "Memory model" below): this lane's count of device writes and fences in
  // the running threadgroup, the count at its last device-scope release fence, the publications its
  // atomic reads observed, and those it acquired (observed, then ordered before an acquire fence).
  uint32_t coh_seq = 0, coh_released = 0;
  std::vector<uint32_t> coh_observed, coh_acquired;
};

using MatrixOp = bnb_emu_matrix_op;

// A simdgroup's simdgroup_matrix operations since it last synchronised: `pub` is what kernel
// modules read (bnb_emu_fiber); the storage is kept across threadgroups.
struct MatrixLog {
  bnb_emu_matrix_log pub{nullptr, 0};
  std::vector<MatrixOp> storage;
  MatrixOp& append() {
    if (pub.count == storage.size()) {
      storage.resize(storage.empty() ? 64 : 2 * storage.size());
      pub.ops = storage.data();
    }
    return storage[pub.count++];
  }
};

// A fault as recorded where it happens (possibly in a signal handler: no allocation there).
struct RawFault {
  int kind = BNB_EMU_OK;
  char message[512] = {0};
  const char* file = nullptr;
  int line = 0;
  uintptr_t addr = 0;
  uintptr_t pc = 0;
  int is_write = -1;  // -1 unknown
  int si_code = 0;
  bool have_lane = false;
  bnb_emu_lane lane{};
  uintptr_t stack_guard_lo = 0, stack_guard_hi = 0;
};

struct Guard {
  uintptr_t lo, hi;       // the protected page
  uintptr_t data_end;     // end of the bound data right below it
  std::vector<int> args;  // buffer indices bound into this region
  size_t size;            // bytes of data
};

struct Binding {
  char* dev = nullptr;
  size_t size = 0;
};

// ---------------------------------------------------------------------------------------------
// Memory model: the coherence check (LaunchRequest::coherence_check, docs/emulator.md).
//
// Threadgroups of one dispatch see each other's device writes only as the Metal language version
// promises. Below Metal 3.2 nothing is promised but an atomic's own value. From 3.2 (MSL section
// 6.15) a write W of thread t in threadgroup G is visible to a read R of thread r in another
// threadgroup H when the buffer is coherent(device) and
//   W -> device-scope release fence in t -> (program order, or a threadgroup barrier of G) -> an
//   atomic write A by a thread of G -> A's value (or a later read-modify-write's: the release
//   sequence) read by an atomic of a thread of H -> (program order, or a threadgroup barrier of H)
//   -> device-scope acquire fence in r -> R.
// A fence orders its own thread's accesses only: a barrier carries a fence's effect to another
// thread of the threadgroup, never a fence of thread 0 to the writes of the others (no Apple text
// says barriers are cumulative at device scope). Every plain device read of a byte another
// threadgroup wrote in the dispatch is checked against that; a read that fails it ends the dispatch
// with BNB_EMU_COHERENCE. Reads of one's own threadgroup's writes, and of what earlier dispatches
// wrote, are not checked. A GPU may be more forgiving than this model, never less.

// The last plain write of a byte in this dispatch: its threadgroup (linear index + 1; 0: none),
// thread (index in threadgroup) and that thread's coh_seq when it wrote. Kept packed in one 64-bit
// word per byte (group1 in bits 32..63, thread in 22..31, seq in 0..21, saturating), written and read
// without a lock.
struct WriteRec {
  uint32_t group1 = 0, thread = 0, seq = 0;
  static constexpr uint32_t kSeqMax = (1u << 22) - 1;
  uint64_t pack() const { return uint64_t(group1) << 32 | uint64_t(thread) << 22 | std::min(seq, kSeqMax); }
  static WriteRec unpack(uint64_t v) {
    return WriteRec{uint32_t(v >> 32), uint32_t(v >> 22) & 1023u, uint32_t(v) & kSeqMax};
  }
};

// An atomic write that may publish writes of its threadgroup: each thread's writes up to its last
// release fence ordered before the atomic (the publishing thread's own, or through a barrier).
struct Publication {
  uint64_t group;
  uint32_t thread, own;  // the publishing thread and its coh_released at the atomic
  std::shared_ptr<const std::vector<uint32_t>> released;  // per thread, at the last barrier (or null)
};

// One guarded region of device memory (bindings that overlap share one).
struct CoherenceRegion {
  uintptr_t lo = 0;
  size_t size = 0;
  std::vector<int> args;
  std::atomic<bool> coherent{false};  // some argument of it is a coherent(device) buffer
  // Per byte, a packed WriteRec; allocated (under Coherence::mu) at the region's first write.
  std::unique_ptr<std::atomic<uint64_t>[]> storage;
  std::atomic<std::atomic<uint64_t>*> shadow{nullptr};
};

struct Coherence {
  std::mutex mu;
  uint32_t version = 310;  // __METAL_VERSION__ of the dispatch
  std::vector<std::unique_ptr<CoherenceRegion>> regions;
  std::vector<Publication> pubs;
  // Per atomic location, the publications a read of it synchronises with: the release sequence
  // headed by its last atomic store (a plain store starts a new one; read-modify-writes extend it).
  std::unordered_map<uintptr_t, std::vector<uint32_t>> at;
  CoherenceRegion* region(uintptr_t a) {
    for (auto& r : regions)
      if (a - r->lo < r->size) return r.get();
    return nullptr;
  }
};

// ---------------------------------------------------------------------------------------------
// Profiling: one worker's counts for a profiled dispatch (merged by launch() at the end).
//
// Every device access of a lane is recorded into its counted binding: bytes by kind, a bitmap of
// the bytes touched (unique bytes and lines, after merging the workers' bitmaps), a per-line stamp
// of the last threadgroup that touched the line (lines summed over threadgroups), and a key
// appended to the lane's access list (kept here, not in Lane: plain dispatches never touch
// profiling state). When the lanes of a simdgroup synchronise (a SIMD-group
// collective, a threadgroup barrier, the end of the threadgroup), the lists are flushed into
// SIMD-group memory instructions: the n-th access of each lane to one buffer with one kind (load,
// store, atomic) since the last synchronisation. In uniform control flow that is the k-th access
// of each lane, the instruction the hardware issues; in divergent code it keeps a lane's extra
// access (`if (lane == 0) absmax[b] = m;`) from shifting the pairing of the other buffers'
// accesses, and it does not depend on how the compiler laid out the code. An instruction's
// transactions are the distinct lines its lanes touch.

// Access keys: buffer slot in bits 56..63, kind in 54..55, extra lines spanned in 48..53, first
// line in 0..47.
constexpr int kKeySlotShift = 56, kKeyKindShift = 54, kKeySpanShift = 48;
constexpr uint64_t kKeyLineMask = (uint64_t(1) << kKeySpanShift) - 1;

struct BufferState {
  int binding = 0;
  uintptr_t lo = 0;
  size_t size = 0;
  uint32_t offset = 0;
  BufferTraffic t;
  std::vector<uint64_t> touched;  // bit per byte
  std::vector<uint32_t> stamp;    // per line: token of the last threadgroup that touched it
};

struct WorkerProfile {
  std::vector<BufferState> bufs;  // the counted bindings, in binding order
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  uint32_t line_bytes = 128, line_shift = 7;
  uint32_t token = 0;          // the running threadgroup (1, 2, ... on this worker)
  uint64_t group_barriers = 0;
  ProfileResult r;             // the scalar counters (buffers stay in bufs)
  // Per lane of the running threadgroup: its device accesses since its simdgroup last
  // synchronised, one key each.
  std::vector<std::vector<uint64_t>> accesses;
  // Nonzero while the shim mutes the running lane's instrumented accesses (a scope without a
  // yield point, so one counter per worker is enough).
  int muted = 0;
  // Scratch for flush.
  std::vector<uint64_t> counters, max_count, base, buckets, distinct;
  std::vector<uint32_t> fill;

  void record(std::vector<uint64_t>& list, uintptr_t a, size_t n, int kind) {
    if (a < lo || a >= hi) return;
    for (size_t slot = 0; slot < bufs.size(); ++slot) {
      BufferState& b = bufs[slot];
      size_t off = size_t(a - b.lo);
      if (a < b.lo || off >= b.size) continue;
      size_t m = std::min(n, b.size - off);
      if (kind == BNB_EMU_PROFILE_STORE)
        b.t.store_bytes += n;
      else if (kind == BNB_EMU_PROFILE_ATOMIC)
        b.t.atomic_bytes += n;
      else
        b.t.load_bytes += n;
      ++b.t.accesses;
      for (size_t i = off, end = off + m; i < end;) {  // set bits [off, off + m), a word at a time
        size_t bit = i & 63, count = std::min<size_t>(64 - bit, end - i);
        b.touched[i >> 6] |= (count == 64 ? ~uint64_t(0) : ((uint64_t(1) << count) - 1)) << bit;
        i += count;
      }
      uint64_t first = (off + b.offset) >> line_shift, last = (off + m - 1 + b.offset) >> line_shift;
      for (uint64_t line = first; line <= last; ++line)
        if (b.stamp[line] != token) {
          b.stamp[line] = token;
          ++b.t.lines_summed;
        }
      uint64_t span = std::min<uint64_t>(last - first, 63);
      list.push_back((uint64_t(slot) << kKeySlotShift) | (uint64_t(kind) << kKeyKindShift) |
                     (span << kKeySpanShift) | first);
      return;
    }
  }

  // Turns the access lists of a simdgroup's lanes into SIMD-group memory instructions: the n-th
  // access of each lane with one (buffer, kind) is instruction base[(buffer, kind)] + n, which
  // holds at most one access per lane (a bucket of kSimdWidth keys).
  void flush(uint32_t first_lane, uint32_t count) {
    std::vector<uint64_t>* lanes = &accesses[first_lane];
    const size_t kinds = bufs.size() * 4;
    max_count.assign(kinds, 0);
    bool any = false;
    for (uint32_t i = 0; i < count; ++i) {
      const std::vector<uint64_t>& list = lanes[i];
      if (list.empty()) continue;
      any = true;
      counters.assign(kinds, 0);
      for (uint64_t key : list) ++counters[key >> kKeyKindShift];
      for (size_t k = 0; k < kinds; ++k) max_count[k] = std::max(max_count[k], counters[k]);
    }
    if (!any) return;
    base.resize(kinds);
    size_t instructions = 0;
    for (size_t k = 0; k < kinds; ++k) {
      base[k] = instructions;
      instructions += max_count[k];
    }
    fill.assign(instructions, 0);
    buckets.resize(instructions * kSimdWidth);
    for (uint32_t i = 0; i < count; ++i) {
      std::vector<uint64_t>& list = lanes[i];
      if (list.empty()) continue;
      counters.assign(kinds, 0);
      for (uint64_t key : list) {
        uint64_t k = key >> kKeyKindShift, ins = base[k] + counters[k]++;
        buckets[ins * kSimdWidth + fill[ins]++] = key;
      }
      list.clear();
    }
    for (size_t ins = 0; ins < instructions; ++ins) {
      if (!fill[ins]) continue;
      ++r.instructions;
      const uint64_t* keys = &buckets[ins * kSimdWidth];
      distinct.clear();
      for (uint32_t j = 0; j < fill[ins]; ++j) {
        uint64_t span = (keys[j] >> kKeySpanShift) & 0x3F, line = keys[j] & kKeyLineMask;
        for (uint64_t l = line; l <= line + span; ++l)
          if (std::find(distinct.begin(), distinct.end(), l) == distinct.end()) distinct.push_back(l);
      }
      r.transactions += distinct.size();
      bufs[size_t(keys[0] >> kKeySlotShift)].t.transactions += distinct.size();
    }
  }
};

struct Dispatch {
  const LaunchRequest* req = nullptr;
  std::vector<Binding> bindings;
  std::vector<void*> buffers;  // bindings[i].dev, for bnb_emu_dispatch
  std::vector<Guard> guards;
  bool misaligned = false;  // some buffer is bound at an address less aligned than its host copy
  uint32_t edge[3] = {0, 0, 0};
  uint64_t total_groups = 0;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  bool have_fault = false;
  RawFault fault;
  std::string kernel_message_suffix;
  // Profiling: one slot per worker, claimed when the worker joins the dispatch.
  std::vector<std::unique_ptr<WorkerProfile>> profiles;
  std::atomic<size_t> next_profile{0};
  // Stalls after device atomics (rt_device_atomic): the workers that have not left the dispatch,
  // and the tickets of those stalled, oldest first.
  std::mutex stall_mu;
  std::condition_variable stall_cv;
  unsigned running = 0;
  std::vector<uint64_t> stalled;
  uint64_t tickets = 0;
  // The coherence check's state (null unless the request asks for it).
  std::unique_ptr<Coherence> coherence;
};

// ---------------------------------------------------------------------------------------------
// Race checker state for one threadgroup: per-byte last writer and reader since the last barrier.

constexpr uint16_t kMulti = 0xFFFF;

struct RaceState {
  std::vector<unsigned char> snapshot;
  std::vector<uint16_t> writer, writer_epoch, reader, reader_epoch;
  std::vector<uint8_t> reader_sg, atomic;
  uint32_t sg_epoch[kMaxThreadsPerGroup / kSimdWidth] = {0};
  void init() {
    if (!snapshot.empty()) return;
    snapshot.resize(kMaxThreadgroupMemory);
    writer.resize(kMaxThreadgroupMemory);
    writer_epoch.resize(kMaxThreadgroupMemory);
    reader.resize(kMaxThreadgroupMemory);
    reader_epoch.resize(kMaxThreadgroupMemory);
    reader_sg.resize(kMaxThreadgroupMemory);
    atomic.resize(kMaxThreadgroupMemory);
  }
  void clear(size_t used) {
    std::fill_n(writer.begin(), used, 0);
    std::fill_n(reader.begin(), used, 0);
    std::fill_n(atomic.begin(), used, 0);
  }
};

struct Site {
  const void* key;
  size_t offset, size;
  const char* name;
};

thread_local Worker* t_worker = nullptr;

struct Worker {
  Context sched;
  Lane* current = nullptr;
  volatile bool in_fiber = false;
  Dispatch* d = nullptr;
  std::vector<Lane> lanes;
  // Lanes [0, lanes_ready) of `lanes` (at lanes_base) have their constant fields and fiber headers
  // set; 0 after a threadgroup ended in a fault (its lanes' matrix counts were not reset).
  const Lane* lanes_base = nullptr;
  uint32_t lanes_ready = 0;
  std::vector<std::unique_ptr<Stack>> stacks;
  std::vector<uint32_t> order, sg_order;
  // The lanes of the running round, in order (run_group), and the next one to run.
  std::vector<Lane*> round;
  size_t round_next = 0;
  unsigned char* arena = nullptr;
  size_t arena_used = 0;
  std::vector<Site> sites;
  RaceState race;
  uint32_t group_index[3] = {0, 0, 0};
  uint32_t nlanes = 0;
  uint64_t rng = 0;
  RawFault pending;  // written by fail()/the signal handler, read by the scheduler
  bool has_pending = false;
  void* altstack = nullptr;
  void* asan_sched_bottom = nullptr;
  size_t asan_sched_size = 0;
  WorkerProfile* prof = nullptr;  // set for profiled dispatches
  // Coherence check: the running threadgroup's linear index; per thread, its coh_released at the
  // last barrier (null before the first release); the publications its threads had observed by then;
  // the muted depth (the shim's own accesses, as for the profiler).
  uint64_t group_linear = 0;
  std::shared_ptr<const std::vector<uint32_t>> coh_barrier_released;
  std::vector<uint32_t> coh_barrier_observed;
  int coh_muted = 0;
  // Per simdgroup of the running threadgroup: its simdgroup_matrix operations since it last
  // synchronised (capacity kept across threadgroups).
  MatrixLog matrix_log[kMaxThreadsPerGroup / kSimdWidth];

  // `arena`: this worker's kMaxThreadgroupMemory bytes of threadgroup memory (owned by the pool,
  // which keeps all workers' arenas in one block: one range for the profiler's window).
  explicit Worker(unsigned char* threadgroup_memory) : arena(threadgroup_memory) {}

  bool run_group(uint64_t linear);
  void run_round();
  int resolve_simdgroup(uint32_t sg);
  bool resolve_barrier();
  bool matrix_sync(uint32_t sg);
  void race_diff(Lane& l);
  void profile_flush(uint32_t sg);
  void profile_group_done();
  void coherence_group_start();
  void coherence_barrier();
  void fault_from_scheduler(int kind, const Lane* l, const char* file, int line, const char* fmt, ...)
      __attribute__((format(printf, 6, 7)));
};

// ---------------------------------------------------------------------------------------------
// Switching between the scheduler and a lane (with AddressSanitizer's fiber annotations).

// One context switch, annotated for AddressSanitizer: `fake` keeps the leaving fiber's fake stack
// (null for a lane that is dying, so that ASan frees it), `bottom` and `size` are the stack entered.
inline void switch_fiber(Context* from, Context* to, void** fake, void* bottom, size_t size) {
#if BNB_EMU_ASAN
  __sanitizer_start_switch_fiber(fake, bottom, size);
  context_switch(from, to);
  __sanitizer_finish_switch_fiber(fake ? *fake : nullptr, nullptr, nullptr);
#else
  (void)fake, (void)bottom, (void)size;
  context_switch(from, to);
#endif
}

void switch_to_lane(Worker* w, Lane* l) {
  void* fake = nullptr;
  switch_fiber(&w->sched, &l->ctx, &fake, l->stack->lo, l->stack->size);
}

void switch_to_scheduler(Lane* l, bool dying) {
  Worker* w = l->worker;
  switch_fiber(&l->ctx, &w->sched, dying ? nullptr : &l->asan_fake, w->asan_sched_bottom, w->asan_sched_size);
}

// From one lane straight to another (a round hands the worker from lane to lane, see run_group).
void switch_lane_to_lane(Lane* from, Lane* to, bool dying) {
  switch_fiber(&from->ctx, &to->ctx, dying ? nullptr : &from->asan_fake, to->stack->lo, to->stack->size);
}

void yield_lane(Lane* l, bool dying);

void fiber_main(void* arg) {
  Lane* l = static_cast<Lane*>(arg);
#if BNB_EMU_ASAN
  // The first fiber a worker ever runs is entered from its scheduler: remember that stack.
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
  if (!l->worker->asan_sched_bottom) {
    l->worker->asan_sched_bottom = const_cast<void*>(bottom);
    l->worker->asan_sched_size = size;
  }
#endif
  l->worker->d->req->fn();
  l->state = DONE;
  yield_lane(l, true);
  std::abort();  // a finished lane is never resumed
}

// Ends the calling lane with a fault recorded in w->pending.
[[noreturn]] void abandon_lane(Worker* w, Lane* l) {
  l->state = FAULTED;
  switch_to_scheduler(l, true);
  std::abort();
}

void format_position(char* out, size_t n, const bnb_emu_lane& p) {
  std::snprintf(out, n,
                "thread_position_in_threadgroup (%u, %u, %u), threadgroup_position_in_grid (%u, %u, %u), "
                "thread_position_in_grid (%u, %u, %u)",
                p.thread_position_in_threadgroup[0], p.thread_position_in_threadgroup[1],
                p.thread_position_in_threadgroup[2], p.threadgroup_position_in_grid[0],
                p.threadgroup_position_in_grid[1], p.threadgroup_position_in_grid[2],
                p.thread_position_in_grid[0], p.thread_position_in_grid[1], p.thread_position_in_grid[2]);
}

std::string where(const char* file, int line) {
  if (!file) return "";
  return std::string(file) + ":" + std::to_string(line);
}

// ---------------------------------------------------------------------------------------------
// The table kernel modules call.

Worker* cur_worker() { return t_worker; }

const bnb_emu_lane* rt_lane() { return &t_worker->current->pub; }

[[noreturn]] void rt_fail(int kind, const char* message, const char* file, int line) {
  Worker* w = t_worker;
  Lane* l = w->current;
  RawFault& f = w->pending;
  f = RawFault{};
  f.kind = kind;
  std::snprintf(f.message, sizeof f.message, "%s", message);
  f.file = file;
  f.line = line;
  f.have_lane = true;
  f.lane = l->pub;
  w->has_pending = true;
  abandon_lane(w, l);
}

void* rt_buffer(uint32_t index, const char* file, int line) {
  Worker* w = t_worker;
  const auto& b = w->d->bindings;
  if (index >= b.size()) {
    char msg[200];
    std::snprintf(msg, sizeof msg, "[[buffer(%u)]] is not bound (the launch binds %zu buffer%s)", index, b.size(),
                  b.size() == 1 ? "" : "s");
    rt_fail(BNB_EMU_UNBOUND_BUFFER, msg, file, line);
  }
  return b[index].dev;
}

void* rt_threadgroup_alloc(const void* site, size_t size, size_t align, const char* name, const char* file,
                           int line) {
  Worker* w = t_worker;
  for (const Site& s : w->sites)
    if (s.key == site) return w->arena + s.offset;
  if (align < 16) align = 16;
  size_t off = round_up(w->arena_used, align);
  if (off + size > kMaxThreadgroupMemory) {
    char msg[300];
    std::snprintf(msg, sizeof msg,
                  "threadgroup memory exceeds the Metal limit of %zu bytes: '%s' needs %zu bytes at offset %zu",
                  kMaxThreadgroupMemory, name, size, off);
    rt_fail(BNB_EMU_LIMIT_EXCEEDED, msg, file, line);
  }
  std::memset(w->arena + off, w->d->req->poison, size);
  if (w->d->req->race_check) std::memset(w->race.snapshot.data() + off, w->d->req->poison, size);
  w->arena_used = off + size;
  w->sites.push_back(Site{site, off, size, name});
  return w->arena + off;
}

void rt_barrier(uint32_t /*flags*/, const char* file, int line) {
  Worker* w = t_worker;
  Lane* l = w->current;
  l->state = AT_BARRIER;
  l->file = file;
  l->line = line;
  yield_lane(l, false);
}

void rt_simd_collective(bnb_emu_resolver fn, const char* what, void* operand, void* result, const char* file,
                        int line) {
  Worker* w = t_worker;
  Lane* l = w->current;
  l->state = AT_SIMD;
  l->resolver = fn;
  l->what = what;
  l->operand = operand;
  l->result = result;
  l->file = file;
  l->line = line;
  yield_lane(l, false);
}

bool same_site(const char* file_a, int line_a, const char* file_b, int line_b) {
  return line_a == line_b && (file_a == file_b || (file_a && file_b && std::strcmp(file_a, file_b) == 0));
}

// rt_matrix_op's full comparison when the quick one (pointers, bytes) failed: reports an operation
// that differs from the simdgroup's n-th one (never returns then).
__attribute__((noinline, cold)) void matrix_op_check(Worker* w, const MatrixOp& op, const char* what, const void* args,
                                                     size_t size, const char* file, int line) {
  if (!same_site(op.file, op.line, file, line) || std::strcmp(op.what, what) != 0) {
    char msg[512];
    std::snprintf(msg, sizeof msg,
                  "SIMD-group collective in divergent control flow: this thread is at %s (%s) while lane %u of its "
                  "simdgroup is at %s (%s)",
                  what, where(file, line).c_str(), w->lanes[op.lane].pub.thread_index_in_simdgroup, op.what,
                  where(op.file, op.line).c_str());
    rt_fail(BNB_EMU_DIVERGENT_COLLECTIVE, msg, file, line);
  }
  if (op.size != size || (size && std::memcmp(op.args, args, size) != 0))
    rt_fail(BNB_EMU_DIVERGENT_COLLECTIVE,
            "simdgroup_matrix operation with arguments that differ between the lanes of the simdgroup", file, line);
}

const bnb_emu_lane* rt_matrix_op(const char* what, const void* args, size_t size, const char* file, int line) {
  Worker* w = t_worker;
  Lane* l = w->current;
  MatrixLog& log = w->matrix_log[l->index / kSimdWidth];
  const uint32_t n = l->fiber->matrix_ops++;
  if (n < log.pub.count) {  // another lane of the simdgroup ran its n-th operation first: the same one?
    matrix_op_check(w, log.pub.ops[n], what, args, size, file, line);
    return &l->pub;
  }
  if (size > sizeof(MatrixOp::args))
    rt_fail(BNB_EMU_KERNEL_ERROR, "simdgroup_matrix operation: arguments too large", file, line);
  MatrixOp& op = log.append();
  op.what = what;
  op.file = file;
  op.line = line;
  op.lane = l->index;
  op.size = uint32_t(size);
  if (size) std::memcpy(op.args, args, size);
  return &l->pub;
}

const Site* site_of(Worker* w, size_t off) {
  for (const Site& s : w->sites)
    if (off >= s.offset && off < s.offset + s.size) return &s;
  return nullptr;
}

// Whether an access by lane `me` conflicts with an earlier one by `other` (lane index + 1, 0 for
// none) made when other's simdgroup had collective epoch `epoch`: no conflict with oneself, nor
// with a lane of one's own simdgroup that has since passed a SIMD collective with us.
bool conflicts(const Worker* w, uint32_t other, uint32_t epoch, uint32_t me) {
  if (other == 0 || other == me + 1) return false;
  uint32_t sg = me / kSimdWidth;
  if ((other - 1) / kSimdWidth == sg && epoch < w->race.sg_epoch[sg]) return false;
  return true;
}

const Lane* lane_at(const Worker* w, uint32_t idx) { return &w->lanes[idx]; }

void rt_threadgroup_access(const void* p, size_t n, int kind, const char* file, int line) {
  Worker* w = t_worker;
  if (!w->d->req->race_check) return;
  Lane* l = w->current;
  auto* b = static_cast<const unsigned char*>(p);
  if (b < w->arena || b + n > w->arena + w->arena_used) return;  // not threadgroup memory
  size_t off = size_t(b - w->arena);
  RaceState& r = w->race;
  uint32_t me = l->index, sg = me / kSimdWidth, ep = r.sg_epoch[sg];
  for (size_t i = off; i < off + n; ++i) {
    if (kind == BNB_EMU_ACCESS_ATOMIC) {
      r.atomic[i] = 1;
      continue;
    }
    if (!r.atomic[i] && conflicts(w, r.writer[i], r.writer_epoch[i], me)) {
      const Site* s = site_of(w, i);
      char pos[300], msg[512];
      format_position(pos, sizeof pos, lane_at(w, r.writer[i] - 1)->pub);
      std::snprintf(msg, sizeof msg,
                    "threadgroup race: reads '%s' (byte %zu) written since the last threadgroup_barrier by "
                    "another thread (%s)",
                    s ? s->name : "?", s ? i - s->offset : i, pos);
      rt_fail(BNB_EMU_RACE, msg, file, line);
    }
    uint16_t rd = r.reader[i];
    if (rd == 0 || rd == me + 1) {
      r.reader[i] = uint16_t(me + 1);
      r.reader_sg[i] = uint8_t(sg);
    } else {
      if (r.reader_sg[i] != sg) r.reader_sg[i] = 0xFF;
      r.reader[i] = kMulti;
    }
    r.reader_epoch[i] = uint16_t(ep);
  }
}

// A GPU promises nothing about when a threadgroup runs, nor that it runs on after it published
// something through device memory: it may be descheduled right after an atomic while every other
// threadgroup of the dispatch runs to its end. The emulator does that on purpose. A lane's atomic
// store or read-modify-write of device memory stalls its worker (and so its threadgroup, part-way)
// until every worker still in the dispatch is stalled or has left it; then the newest stalled one
// goes on. So the first threadgroup to publish waits while the others run, and a kernel whose other
// threadgroups read what that one's other threads had not written yet (a hand-over without the
// barrier that orders those writes first) reads it unwritten. Nothing waits in a profiled dispatch
// (its counts do not depend on the order) or with one worker.
void release_stalled(Dispatch* d) {
  if (!d->stalled.empty() && d->stalled.size() >= d->running) {
    d->stalled.pop_back();
    d->stall_cv.notify_all();
  }
}

void rt_device_atomic(const void* p) {
  Worker* w = t_worker;
  Dispatch* d = w ? w->d : nullptr;
  if (!d || d->req->profiling || d->running < 2) return;
  auto* b = static_cast<const unsigned char*>(p);
  if (b >= w->arena && b < w->arena + w->arena_used) return;  // threadgroup memory
  std::unique_lock<std::mutex> lk(d->stall_mu);
  const uint64_t ticket = ++d->tickets;
  d->stalled.push_back(ticket);
  release_stalled(d);
  d->stall_cv.wait(lk, [&] { return std::find(d->stalled.begin(), d->stalled.end(), ticket) == d->stalled.end(); });
}

// --- the coherence check ("Memory model" above) ----------------------------------------------

// Adds the ids of `from` to the sorted set `into`.
void merge_ids(std::vector<uint32_t>& into, const std::vector<uint32_t>& from) {
  if (from.empty()) return;
  into.insert(into.end(), from.begin(), from.end());
  std::sort(into.begin(), into.end());
  into.erase(std::unique(into.begin(), into.end()), into.end());
}

Coherence* coherence_of(Worker* w) { return (w && w->d && w->current) ? w->d->coherence.get() : nullptr; }

bool in_threadgroup_memory(const Worker* w, const void* p) {
  auto* b = static_cast<const unsigned char*>(p);
  return b >= w->arena && b < w->arena + kMaxThreadgroupMemory;
}

void group_position(const LaunchRequest& q, uint64_t linear, uint32_t out[3]) {
  out[0] = uint32_t(linear % q.groups[0]);
  out[1] = uint32_t((linear / q.groups[0]) % q.groups[1]);
  out[2] = uint32_t(linear / (uint64_t(q.groups[0]) * q.groups[1]));
}

// Why thread `l` of worker `w`'s threadgroup may not read the byte `rec` describes (another
// threadgroup's write), or null where the model makes the write visible.
bool from_group(const Coherence& c, const std::vector<uint32_t>& ids, uint32_t group1) {
  for (uint32_t id : ids)
    if (c.pubs[id].group + 1 == group1) return true;
  return false;
}

const char* coherence_violation(const Coherence& c, const CoherenceRegion& r, const Worker& w, const Lane& l,
                                const WriteRec& rec) {
  if (c.version < 320)
    return "below Metal 3.2 nothing makes another threadgroup's device writes visible within a dispatch (only an "
           "atomic's own value): hand the data over through a second dispatch, or compile at 3.2 with a "
           "coherent(device) buffer and device-scope fences";
  if (!r.coherent)
    return "the buffer is not coherent(device): from Metal 3.2 only a coherent(device) buffer's writes can be made "
           "visible to another threadgroup of the dispatch";
  bool acquired_any = false;
  for (uint32_t id : l.coh_acquired) {
    const Publication& p = c.pubs[id];
    if (p.group + 1 != rec.group1) continue;
    acquired_any = true;
    uint32_t released = p.thread == rec.thread ? p.own : 0;
    if (p.released && rec.thread < p.released->size()) released = std::max(released, (*p.released)[rec.thread]);
    if (released > rec.seq) return nullptr;
  }
  bool published = false;
  for (const Publication& p : c.pubs) published = published || p.group + 1 == rec.group1;
  if (acquired_any || !published)
    return "the writing thread has no device-scope release fence (atomic_thread_fence(mem_flags::mem_device, "
           "memory_order_release, thread_scope_device)) after this write, ordered (in that thread, or by a "
           "threadgroup barrier) before an atomic write of its threadgroup that the reader observed; a fence orders "
           "only its own thread's writes";
  if (from_group(c, l.coh_observed, rec.group1) || from_group(c, w.coh_barrier_observed, rec.group1))
    return "the reading thread has no device-scope acquire fence (atomic_thread_fence(mem_flags::mem_device, "
           "memory_order_acquire, thread_scope_device)) after the atomic read that observed the writer's release, "
           "ordered to it in this thread or by a threadgroup barrier; a fence orders only its own thread's reads";
  return "no atomic read of the reading threadgroup observed the atomic write that published this write (before "
         "this read, through a threadgroup barrier or in the reading thread)";
}

void coherence_access(Worker* w, Lane* l, uintptr_t a, size_t n, int kind) {
  Coherence& c = *w->d->coherence;
  CoherenceRegion* r = c.region(a);
  if (!r || (kind != BNB_EMU_PROFILE_STORE && kind != BNB_EMU_PROFILE_LOAD)) return;
  const size_t off = a - r->lo;
  n = std::min(n, r->size - off);
  const uint32_t mine = uint32_t(w->group_linear + 1);
  std::atomic<uint64_t>* shadow = r->shadow.load(std::memory_order_acquire);
  if (kind == BNB_EMU_PROFILE_STORE) {
    if (!shadow) {
      std::lock_guard<std::mutex> lk(c.mu);
      shadow = r->shadow.load(std::memory_order_relaxed);
      if (!shadow) {
        r->storage.reset(new std::atomic<uint64_t>[r->size]());
        shadow = r->storage.get();
        r->shadow.store(shadow, std::memory_order_release);
      }
    }
    const uint64_t rec = WriteRec{mine, l->index, ++l->coh_seq}.pack();
    for (size_t i = 0; i < n; ++i) shadow[off + i].store(rec, std::memory_order_relaxed);
    return;
  }
  if (!shadow) return;
  for (size_t i = 0; i < n; ++i) {
    const WriteRec rec = WriteRec::unpack(shadow[off + i].load(std::memory_order_relaxed));
    if (rec.group1 == 0 || rec.group1 == mine) continue;
    std::unique_lock<std::mutex> lk(c.mu);
    const char* why = coherence_violation(c, *r, *w, *l, rec);
    if (!why) continue;
    // The argument the byte belongs to, and its offset there.
    int arg = r->args.empty() ? -1 : r->args[0];
    size_t at = off + i;
    for (int k : r->args) {
      const Binding& b = w->d->bindings[size_t(k)];
      const uintptr_t lo = reinterpret_cast<uintptr_t>(b.dev);
      if (a + i - lo < b.size) {
        arg = k;
        at = a + i - lo;
        break;
      }
    }
    uint32_t writer[3];
    group_position(*w->d->req, rec.group1 - 1, writer);
    char msg[1024];
    std::snprintf(msg, sizeof msg,
                  "coherence: buffer(%d) byte %zu: threadgroup (%u, %u, %u) thread %u reads what threadgroup "
                  "(%u, %u, %u) thread %u wrote in this dispatch, and Metal %u.%u does not make that write visible: %s",
                  arg, at, l->pub.threadgroup_position_in_grid[0], l->pub.threadgroup_position_in_grid[1],
                  l->pub.threadgroup_position_in_grid[2], l->index, writer[0], writer[1], writer[2], rec.thread,
                  c.version / 100, c.version / 10 % 10, why);
    lk.unlock();
    rt_fail(BNB_EMU_COHERENCE, msg, nullptr, 0);
  }
}

void rt_coherence_atomic(const void* p, int kind) {
  Worker* w = t_worker;
  Coherence* c = coherence_of(w);
  if (!c || c->version < 320 || in_threadgroup_memory(w, p)) return;
  Lane* l = w->current;
  std::lock_guard<std::mutex> lk(c->mu);
  const auto key = reinterpret_cast<uintptr_t>(p);
  if (kind != BNB_EMU_ATOMIC_STORE) {
    auto it = c->at.find(key);
    if (it != c->at.end()) merge_ids(l->coh_observed, it->second);
  }
  if (kind == BNB_EMU_ATOMIC_READ) return;
  std::vector<uint32_t>& sequence = c->at[key];
  if (kind == BNB_EMU_ATOMIC_STORE) sequence.clear();
  if (l->coh_released == 0 && !w->coh_barrier_released) return;  // publishes nothing
  sequence.push_back(uint32_t(c->pubs.size()));
  c->pubs.push_back(Publication{w->group_linear, l->index, l->coh_released, w->coh_barrier_released});
}

// MSL's values: mem_flags::mem_device = 1; memory_order_acquire 2, release 3, acq_rel 4, seq_cst 5;
// thread_scope_device 3.
void rt_fence(uint32_t flags, int order, int scope) {
  Worker* w = t_worker;
  Coherence* c = coherence_of(w);
  if (!c || c->version < 320 || !(flags & 1u) || scope != 3) return;
  Lane* l = w->current;
  if (order == 3 || order == 4 || order == 5) l->coh_released = ++l->coh_seq;
  if (order == 2 || order == 4 || order == 5) {
    merge_ids(l->coh_acquired, l->coh_observed);
    merge_ids(l->coh_acquired, w->coh_barrier_observed);
  }
}

void rt_coherent_buffer(const void* p) {
  Coherence* c = coherence_of(t_worker);
  if (!c) return;
  if (CoherenceRegion* r = c->region(reinterpret_cast<uintptr_t>(p))) r->coherent.store(true);
}

void rt_profile_access(const void* p, size_t n, int kind) {
  Worker* w = t_worker;
  if (w && w->d && w->d->coherence) {
    Lane* l = w->current;
    if (l && (w->coh_muted == 0 || (kind & BNB_EMU_PROFILE_FORCED)))
      coherence_access(w, l, reinterpret_cast<uintptr_t>(p), n, kind & BNB_EMU_PROFILE_KIND_MASK);
    return;
  }
  if (!w || !w->prof) return;
  Lane* l = w->current;
  if (!l || (w->prof->muted > 0 && !(kind & BNB_EMU_PROFILE_FORCED))) return;
  kind &= BNB_EMU_PROFILE_KIND_MASK;
  auto a = reinterpret_cast<uintptr_t>(p), arena = reinterpret_cast<uintptr_t>(w->arena);
  if (a >= arena && a < arena + w->arena_used) {
    ProfileResult& r = w->prof->r;
    (kind == BNB_EMU_PROFILE_STORE ? r.threadgroup_store_bytes
                                   : kind == BNB_EMU_PROFILE_ATOMIC ? r.threadgroup_atomic_bytes : r.threadgroup_load_bytes) += n;
    return;
  }
  w->prof->record(w->prof->accesses[l->index], a, n, kind);
}

void rt_profile_mute(int on) {
  Worker* w = t_worker;
  if (w && w->prof && w->current) w->prof->muted += on ? 1 : -1;
  if (w && w->d && w->d->coherence && w->current) w->coh_muted += on ? 1 : -1;
}

// The profiler's window (bnb_emu_profile_window), set by Pool::run for the dispatch it runs.
volatile bnb_emu_profile_window g_window = {0, 0, 0, 0};
// The running dispatch's buffers (bnb_emu_dispatch), set by Pool::run.
bnb_emu_dispatch g_dispatch = {nullptr, 0};

const bnb_emu_runtime g_table = {
    BNB_EMU_ABI_VERSION,  rt_lane,    rt_buffer,
    rt_threadgroup_alloc, rt_barrier, rt_simd_collective,
    rt_threadgroup_access, rt_fail, rt_profile_access,
    rt_profile_mute,      &g_window,   rt_matrix_op,
    &g_dispatch,           stack_align(),   rt_device_atomic,
    rt_coherence_atomic,   rt_fence,        rt_coherent_buffer,
};

// ---------------------------------------------------------------------------------------------
// Faults in kernel code (guard pages, wild pointers, stack overflow): SIGSEGV/SIGBUS on an
// alternate stack. A fault in a lane abandons that lane's fiber and returns to its scheduler.

struct sigaction g_prev_segv, g_prev_bus;
std::mutex g_signal_mu;

void get_pc(void* ucv, RawFault& f) {
  (void)ucv;
#if defined(__linux__) && defined(__x86_64__)
  auto* uc = static_cast<ucontext_t*>(ucv);
  f.pc = uintptr_t(uc->uc_mcontext.gregs[REG_RIP]);
  f.is_write = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#elif defined(__linux__) && defined(__aarch64__)
  auto* uc = static_cast<ucontext_t*>(ucv);
  f.pc = uintptr_t(uc->uc_mcontext.pc);
#elif defined(__APPLE__) && defined(__aarch64__)
  auto* uc = static_cast<ucontext_t*>(ucv);
  f.pc = uintptr_t(uc->uc_mcontext->__ss.__pc);
#elif defined(__APPLE__) && defined(__x86_64__)
  auto* uc = static_cast<ucontext_t*>(ucv);
  f.pc = uintptr_t(uc->uc_mcontext->__ss.__rip);
#endif
}

void on_fault(int sig, siginfo_t* si, void* uc) {
  Worker* w = t_worker;
  if (w && w->in_fiber && w->current) {
    Lane* l = w->current;
    RawFault& f = w->pending;
    f.kind = BNB_EMU_MEMORY_FAULT;
    f.message[0] = 0;
    f.file = nullptr;
    f.line = 0;
    f.addr = uintptr_t(si->si_addr);
    f.si_code = si->si_code;
    f.is_write = -1;
    get_pc(uc, f);
    f.have_lane = true;
    f.lane = l->pub;
    f.stack_guard_lo = reinterpret_cast<uintptr_t>(l->stack->map);
    f.stack_guard_hi = reinterpret_cast<uintptr_t>(l->stack->lo);
    w->has_pending = true;
    abandon_lane(w, l);  // never returns; SA_NODEFER keeps the signal unblocked
  }
  // Not a simulated thread: put the previous handler back and let the fault happen again.
  sigaction(sig, sig == SIGSEGV ? &g_prev_segv : &g_prev_bus, nullptr);
}

void install_handlers() {
  std::lock_guard<std::mutex> lk(g_signal_mu);
  struct sigaction cur;
  sigaction(SIGSEGV, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_fault) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_prev_segv);
  sigaction(SIGBUS, &sa, &g_prev_bus);
}

// ---------------------------------------------------------------------------------------------
// Running one threadgroup.

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void Worker::fault_from_scheduler(int kind, const Lane* l, const char* file, int line, const char* fmt, ...) {
  pending = RawFault{};
  pending.kind = kind;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(pending.message, sizeof pending.message, fmt, ap);
  va_end(ap);
  pending.file = file;
  pending.line = line;
  if (l) {
    pending.have_lane = true;
    pending.lane = l->pub;
  }
  has_pending = true;
}

void Worker::profile_flush(uint32_t sg) {
  uint32_t lo = sg * kSimdWidth, hi = std::min(lo + kSimdWidth, nlanes);
  prof->flush(lo, hi - lo);
}

void Worker::profile_group_done() {
  for (uint32_t sg = 0; sg < nsg_of(nlanes); ++sg) profile_flush(sg);
  ProfileResult& r = prof->r;
  ++r.threadgroups;
  r.threads += nlanes;
  r.barriers += prof->group_barriers;
  r.barriers_max = std::max(r.barriers_max, prof->group_barriers);
  r.threadgroup_memory_max = std::max<uint64_t>(r.threadgroup_memory_max, arena_used);
}

// Runs the lanes of `round` in order: the scheduler switches to the first; each lane, when it stops
// (a yield point, or it returns), switches straight to the next (yield_lane), the last back to the
// scheduler. One context switch per lane and turn instead of two, and each switch returns to the
// same call site, which the CPU predicts.
void Worker::run_round() {
  round_next = 1;
  current = round[0];
  in_fiber = true;
  switch_to_lane(this, round[0]);
  in_fiber = false;
  current = nullptr;
}

// The end of lane `l`'s turn (it waits at a yield point, or `dying`: it returned): the race checker
// attributes what it wrote, then the worker goes to the round's next lane, or back to the scheduler
// after the last one or a fault.
void yield_lane(Lane* l, bool dying) {
  Worker* w = l->worker;
  if (w->d->req->race_check && !w->has_pending) w->race_diff(*l);
  if (!w->has_pending && w->round_next < w->round.size()) {
    Lane* next = w->round[w->round_next++];
    w->current = next;
    switch_lane_to_lane(l, next, dying);
  } else {
    switch_to_scheduler(l, dying);
  }
}

// Attributes every byte of threadgroup memory that changed while lane `l` ran to that lane.
void Worker::race_diff(Lane& l) {
  RaceState& r = race;
  unsigned char* snap = r.snapshot.data();
  size_t n = arena_used;
  if (std::memcmp(arena, snap, n) == 0) return;
  uint32_t me = l.index, sg = me / kSimdWidth, ep = r.sg_epoch[sg];
  for (size_t i = 0; i < n; ++i) {
    if (arena[i] == snap[i]) continue;
    snap[i] = arena[i];
    if (r.atomic[i]) continue;
    const char* what = nullptr;
    uint32_t other = 0;
    if (conflicts(this, r.writer[i], r.writer_epoch[i], me)) {
      what = "writes";
      other = r.writer[i] - 1;
    } else if (r.reader[i] != 0 && r.reader[i] != me + 1) {
      bool synced = r.reader[i] == kMulti ? (r.reader_sg[i] == sg && r.reader_epoch[i] < ep)
                                          : !conflicts(this, r.reader[i], r.reader_epoch[i], me);
      if (!synced) {
        what = "reads";
        other = r.reader[i] == kMulti ? UINT32_MAX : r.reader[i] - 1;
      }
    }
    if (what) {
      const Site* s = site_of(this, i);
      char pos[300] = "several threads";
      if (other != UINT32_MAX) format_position(pos, sizeof pos, lanes[other].pub);
      fault_from_scheduler(BNB_EMU_RACE, &l, nullptr, 0,
                           "threadgroup race: writes '%s' (byte %zu), which another thread %s since the last "
                           "threadgroup_barrier (%s)",
                           s ? s->name : "?", s ? i - s->offset : i, what, pos);
      return;
    }
    r.writer[i] = uint16_t(me + 1);
    r.writer_epoch[i] = uint16_t(ep);
  }
}

// At a synchronisation of simdgroup `sg` (a SIMD-group collective, a threadgroup barrier, the end
// of the threadgroup): every lane of it must have run the simdgroup_matrix operations logged since
// the last one (rt_matrix_op compared each as it ran). Returns false on a fault.
bool Worker::matrix_sync(uint32_t sg) {
  MatrixLog& log = matrix_log[sg];
  if (log.pub.count == 0) return true;
  const uint32_t lo = sg * kSimdWidth, hi = std::min(lo + kSimdWidth, nlanes);
  for (uint32_t i = lo; i < hi; ++i) {
    const Lane& l = lanes[i];
    if (l.fiber->matrix_ops == log.pub.count) continue;
    const MatrixOp& op = log.pub.ops[l.fiber->matrix_ops];  // the first operation this lane did not run
    const Lane* ran = &lanes[op.lane];
    char pos[300];
    format_position(pos, sizeof pos, l.pub);
    if (l.state == DONE) {
      fault_from_scheduler(BNB_EMU_DIVERGENT_COLLECTIVE, ran, op.file, op.line,
                           "SIMD-group collective in divergent control flow: this thread is at %s (%s) but a "
                           "thread of its simdgroup has returned without reaching it (%s)",
                           op.what, where(op.file, op.line).c_str(), pos);
    } else {
      fault_from_scheduler(BNB_EMU_DIVERGENT_COLLECTIVE, ran, op.file, op.line,
                           "SIMD-group collective in divergent control flow: this thread is at %s (%s) while lane %u "
                           "of its simdgroup is at %s (%s) without having reached it",
                           op.what, where(op.file, op.line).c_str(), l.pub.thread_index_in_simdgroup,
                           l.state == AT_BARRIER ? "threadgroup_barrier" : l.what, where(l.file, l.line).c_str());
    }
    return false;
  }
  log.pub.count = 0;
  for (uint32_t i = lo; i < hi; ++i) lanes[i].fiber->matrix_ops = 0;
  return true;
}

// Called when no lane of simdgroup `sg` can run: resolves the collective its lanes wait at, if they
// all do. Returns 1 if it did (the lanes can run again), 0 if they wait at no collective (at a
// barrier, or done), -1 on a fault (recorded in `pending`).
int Worker::resolve_simdgroup(uint32_t sg) {
  uint32_t lo = sg * kSimdWidth, hi = std::min(lo + kSimdWidth, nlanes);
  Lane* first = nullptr;
  Lane* barrier = nullptr;
  for (uint32_t i = lo; i < hi; ++i) {
    Lane& l = lanes[i];
    if (l.state == AT_SIMD) {
      if (!first) {
        first = &l;
      } else if (l.resolver != first->resolver || l.line != first->line ||
                 (l.file != first->file && std::strcmp(l.file, first->file) != 0)) {
        fault_from_scheduler(BNB_EMU_DIVERGENT_COLLECTIVE, &l, l.file, l.line,
                             "SIMD-group collective in divergent control flow: this thread is at %s (%s) while "
                             "lane %u of its simdgroup is at %s (%s)",
                             l.what, where(l.file, l.line).c_str(), first->pub.thread_index_in_simdgroup,
                             first->what, where(first->file, first->line).c_str());
        return -1;
      }
    } else if (l.state == AT_BARRIER && !barrier) {
      barrier = &l;
    }
  }
  if (!first) return 0;
  // The project's kernels keep SIMD collectives in simdgroup-uniform control flow: every lane
  // that exists reaches each one. (Metal itself would run it over the remaining active lanes,
  // which hides `if (...) x = simd_sum(x);` and early returns before a collective.)
  for (uint32_t i = lo; i < hi; ++i) {
    if (lanes[i].state == DONE) {
      char pos[300];
      format_position(pos, sizeof pos, lanes[i].pub);
      fault_from_scheduler(BNB_EMU_DIVERGENT_COLLECTIVE, first, first->file, first->line,
                           "SIMD-group collective in divergent control flow: this thread is at %s (%s) but a "
                           "thread of its simdgroup has returned without reaching it (%s)",
                           first->what, where(first->file, first->line).c_str(), pos);
      return -1;
    }
  }
  if (barrier) {
    fault_from_scheduler(BNB_EMU_DIVERGENT_COLLECTIVE, first, first->file, first->line,
                         "SIMD-group collective in divergent control flow: this thread is at %s while lane %u of "
                         "its simdgroup waits at threadgroup_barrier (%s)",
                         first->what, barrier->pub.thread_index_in_simdgroup,
                         where(barrier->file, barrier->line).c_str());
    return -1;
  }
  if (!matrix_sync(sg)) return -1;
  if (prof) {
    profile_flush(sg);
    ++prof->r.collectives;
  }
  uint32_t mask = 0;
  void* ops[kSimdWidth] = {nullptr};
  void* res[kSimdWidth] = {nullptr};
  for (uint32_t i = lo; i < hi; ++i)
    if (lanes[i].state == AT_SIMD) {
      mask |= 1u << (i - lo);
      ops[i - lo] = lanes[i].operand;
      res[i - lo] = lanes[i].result;
    }
  if (first->resolver) first->resolver(ops, res, mask);
  for (uint32_t i = lo; i < hi; ++i)
    if (lanes[i].state == AT_SIMD) lanes[i].state = RUNNABLE;
  ++race.sg_epoch[sg];
  return 1;
}

// Called when no lane of the threadgroup can run and none waits at a collective: releases the
// threadgroup barrier they all wait at. Returns false on a fault (recorded in `pending`).
bool Worker::resolve_barrier() {
  const uint32_t nsg = nsg_of(nlanes);
  // Every lane left is at a threadgroup barrier: all must be at the same one, and none may have
  // exited (Metal requires every thread of the threadgroup to reach each barrier).
  Lane* first = nullptr;
  Lane* exited = nullptr;
  for (uint32_t i = 0; i < nlanes; ++i) {
    Lane& l = lanes[i];
    if (l.state == DONE) {
      if (!exited) exited = &l;
    } else if (l.state == AT_BARRIER) {
      if (!first) {
        first = &l;
      } else if (l.line != first->line || (l.file != first->file && std::strcmp(l.file, first->file) != 0)) {
        char pos[300];
        format_position(pos, sizeof pos, first->pub);
        fault_from_scheduler(BNB_EMU_BARRIER_DIVERGENCE, &l, l.file, l.line,
                             "barrier divergence: this thread waits at threadgroup_barrier (%s) while another "
                             "waits at a different one (%s; %s)",
                             where(l.file, l.line).c_str(), where(first->file, first->line).c_str(), pos);
        return false;
      }
    }
  }
  if (!first) return true;
  if (exited) {
    char pos[300];
    format_position(pos, sizeof pos, exited->pub);
    fault_from_scheduler(BNB_EMU_BARRIER_DIVERGENCE, first, first->file, first->line,
                         "barrier divergence: threads wait at threadgroup_barrier (%s) but a thread of the "
                         "threadgroup has already returned (%s)",
                         where(first->file, first->line).c_str(), pos);
    return false;
  }
  for (uint32_t sg = 0; sg < nsg_of(nlanes); ++sg)
    if (!matrix_sync(sg)) return false;
  if (prof) {
    for (uint32_t sg = 0; sg < nsg_of(nlanes); ++sg) profile_flush(sg);
    ++prof->group_barriers;
  }
  if (d->coherence) coherence_barrier();
  for (uint32_t i = 0; i < nlanes; ++i)
    if (lanes[i].state == AT_BARRIER) lanes[i].state = RUNNABLE;
  if (d->req->race_check) race.clear(arena_used);
  return true;
}

// A threadgroup barrier carries each thread's last release fence and what its atomics observed to
// every thread of the threadgroup ("Memory model").
void Worker::coherence_barrier() {
  bool released = false;
  for (uint32_t i = 0; i < nlanes; ++i) {
    released = released || lanes[i].coh_released != 0;
    merge_ids(coh_barrier_observed, lanes[i].coh_observed);
  }
  if (!released) return;
  auto v = std::make_shared<std::vector<uint32_t>>(nlanes);
  for (uint32_t i = 0; i < nlanes; ++i) (*v)[i] = lanes[i].coh_released;
  coh_barrier_released = std::move(v);
}

void Worker::coherence_group_start() {
  for (uint32_t i = 0; i < nlanes; ++i) {
    Lane& l = lanes[i];
    l.coh_seq = l.coh_released = 0;
    l.coh_observed.clear();
    l.coh_acquired.clear();
  }
  coh_barrier_released.reset();
  coh_barrier_observed.clear();
  coh_muted = 0;
}

// The i-th threadgroup a dispatch runs: in grid order (forward), backwards (reverse), or in an order
// the seed picks (random: i -> (a i + b) mod total, a coprime with total), so that a kernel whose
// threadgroups meet through device memory (atomics, a last threadgroup that finishes the work) is
// tested with the threadgroups arriving in different orders, as a GPU runs them. Workers claim
// indices concurrently, so the order is only the claim order.
static uint64_t group_in_order(const Dispatch& d, uint64_t i) {
  const LaunchRequest& q = *d.req;
  const uint64_t n = d.total_groups;
  if (q.order == LaneOrder::Reverse) return n - 1 - i;
  if (q.order != LaneOrder::Random || n < 2) return i;
  uint64_t a = (q.seed * 2654435761u) % n | 1u;
  auto gcd = [](uint64_t x, uint64_t y) {
    while (y) {
      const uint64_t t = x % y;
      x = y;
      y = t;
    }
    return x;
  };
  while (gcd(a, n) != 1) ++a;
  const uint64_t b = (q.seed * 40503u + 7u) % n;
  return (uint64_t((unsigned __int128)a * i % n) + b) % n;
}

bool Worker::run_group(uint64_t linear) {
  const LaunchRequest& q = *d->req;
  uint32_t g[3];
  g[0] = uint32_t(linear % q.groups[0]);
  g[1] = uint32_t((linear / q.groups[0]) % q.groups[1]);
  g[2] = uint32_t(linear / (uint64_t(q.groups[0]) * q.groups[1]));
  uint32_t size[3];
  for (int k = 0; k < 3; ++k) {
    size[k] = q.group_size[k];
    if (g[k] + 1 == q.groups[k] && d->edge[k]) size[k] = d->edge[k];
  }
  nlanes = size[0] * size[1] * size[2];
  if (lanes.size() < nlanes) lanes.resize(nlanes);
  while (stacks.size() < nlanes) {
    auto s = std::make_unique<Stack>();
    if (!s->allocate()) {
      fault_from_scheduler(BNB_EMU_KERNEL_ERROR, nullptr, nullptr, 0, "cannot allocate fiber stacks");
      return false;
    }
    stacks.push_back(std::move(s));
  }
  uint32_t nsg = (nlanes + kSimdWidth - 1) / kSimdWidth;
  if (lanes_base != lanes.data()) {  // the Lane objects moved: their fiber headers point at the old ones
    lanes_base = lanes.data();
    lanes_ready = 0;
  }
  // What every lane of the threadgroup shares, then each lane's own position.
  bnb_emu_lane shared{};
  for (int k = 0; k < 3; ++k) {
    shared.threadgroup_position_in_grid[k] = g[k];
    shared.threads_per_threadgroup[k] = size[k];
    shared.dispatch_threads_per_threadgroup[k] = q.group_size[k];
    shared.threadgroups_per_grid[k] = q.groups[k];
    shared.threads_per_grid[k] = q.threads[k];
  }
  shared.threads_per_simdgroup = kSimdWidth;
  shared.simdgroups_per_threadgroup = nsg;
  uint32_t t[3] = {0, 0, 0};  // thread_position_in_threadgroup of lane i
  for (uint32_t i = 0; i < nlanes; ++i) {
    Lane& l = lanes[i];
    if (i >= lanes_ready) {  // (the same for every threadgroup that has this lane)
      l.index = i;
      l.worker = this;
      l.stack = stacks[i].get();
      l.fiber = l.stack->header;
      l.fiber->lane = &l.pub;
      l.fiber->matrix_log = &matrix_log[i / kSimdWidth].pub;
      l.fiber->matrix_ops = 0;  // (then back to 0 at each synchronisation: matrix_sync)
    }
    l.state = RUNNABLE;
    bnb_emu_lane& p = l.pub;
    p = shared;
    for (int k = 0; k < 3; ++k) {
      p.thread_position_in_threadgroup[k] = t[k];
      p.thread_position_in_grid[k] = g[k] * q.group_size[k] + t[k];
    }
    if (++t[0] == size[0]) {
      t[0] = 0;
      if (++t[1] == size[1]) {
        t[1] = 0;
        ++t[2];
      }
    }
    p.thread_index_in_threadgroup = i;
    p.thread_index_in_simdgroup = i % kSimdWidth;
    p.simdgroup_index_in_threadgroup = i / kSimdWidth;
    p.lanes_in_simdgroup = std::min(kSimdWidth, nlanes - (i / kSimdWidth) * kSimdWidth);
#if BNB_EMU_ASAN
    // Frames of fibers that never returned (finished or abandoned) leave poisoned redzones.
    __asan_unpoison_memory_region(l.stack->lo, l.stack->size);
#endif
    // Stagger the stack tops ("cache colouring"): stacks are a whole number of pages apart, so
    // unstaggered tops would all compete for the same few cache sets.
    context_init(&l.ctx, l.stack->lo, l.stack->size - (i % 61) * 64, fiber_main, &l);
  }
  lanes_ready = std::max(lanes_ready, nlanes);
  if (q.race_check) {
    race.init();
    race.clear(kMaxThreadgroupMemory);
    std::fill_n(race.sg_epoch, nsg, 0u);
  }
  arena_used = 0;
  sites.clear();
  for (uint32_t sg = 0; sg < nsg; ++sg) matrix_log[sg].pub.count = 0;
  // The order of the simdgroups, and of the lanes within each (order[lo, hi) permutes the lanes of
  // the simdgroup [lo, hi)): forward, reverse, or shuffled before each pass and round (random).
  const bool reverse = q.order == LaneOrder::Reverse, random = q.order == LaneOrder::Random;
  order.resize(nlanes);
  for (uint32_t i = 0; i < nlanes; ++i) {
    const uint32_t lo = i / kSimdWidth * kSimdWidth, hi = std::min(lo + kSimdWidth, nlanes);
    order[i] = reverse ? lo + hi - 1 - i : i;
  }
  sg_order.resize(nsg);
  for (uint32_t sg = 0; sg < nsg; ++sg) sg_order[sg] = reverse ? nsg - 1 - sg : sg;
  rng = q.seed * 0x2545F4914F6CDD1Dull + linear;
  group_linear = linear;
  if (d->coherence) coherence_group_start();
  if (prof) {
    ++prof->token;
    prof->group_barriers = 0;
    prof->muted = 0;
    if (prof->accesses.size() < nlanes) prof->accesses.resize(nlanes);
    for (uint32_t i = 0; i < nlanes; ++i) prof->accesses[i].clear();
  }

  // Passes over the simdgroups until every lane is done. In a pass each simdgroup runs until none
  // of its lanes can run: rounds of its runnable lanes, each followed by the SIMD-group collective
  // they then all wait at. Simdgroups need each other only at threadgroup barriers, released
  // between passes; running one at a time keeps the stacks of 32 lanes, not of the whole
  // threadgroup, in the CPU's caches.
  for (;;) {
    if (random)
      for (uint32_t i = nsg; i > 1; --i) std::swap(sg_order[i - 1], sg_order[splitmix(rng) % i]);
    bool any = false;
    for (uint32_t sg : sg_order) {
      const uint32_t lo = sg * kSimdWidth, hi = std::min(lo + kSimdWidth, nlanes);
      for (;;) {
        if (random)
          for (uint32_t i = hi - lo; i > 1; --i) std::swap(order[lo + i - 1], order[lo + splitmix(rng) % i]);
        round.clear();
        for (uint32_t k = lo; k < hi; ++k) {
          Lane& l = lanes[order[k]];
          if (l.state == RUNNABLE) round.push_back(&l);
        }
        if (round.empty()) break;
        any = true;
        run_round();
        if (has_pending) return false;
        const int resolved = resolve_simdgroup(sg);
        if (resolved < 0) return false;
        if (resolved == 0) break;
      }
    }
    if (!any) {
      bool all_done = true;
      for (uint32_t i = 0; i < nlanes && all_done; ++i) all_done = lanes[i].state == DONE;
      if (all_done) {
        for (uint32_t sg = 0; sg < nsg_of(nlanes); ++sg)
          if (!matrix_sync(sg)) return false;
        if (prof) profile_group_done();
        return true;
      }
    }
    if (!resolve_barrier()) return false;
  }
}

// ---------------------------------------------------------------------------------------------
// Float arithmetic as on Apple GPUs. Their float32 units flush subnormal inputs and results to
// zero (sign kept) and keep fp16 subnormals (what Asahi Mesa's Apple-GPU driver reports:
// shaderDenormFlushToZeroFloat32, shaderDenormPreserveFloat16). The kernels' float32 arithmetic
// runs in SSE (x86-64) or the FP unit (aarch64) of the worker thread, so the worker sets the same
// mode for the dispatch: MXCSR's FTZ (flush results) and DAZ (inputs as zero), or FPCR.FZ, which
// does both for single and double precision while FPCR.FZ16 stays clear. `half` arithmetic is done
// in float after an exact widening (fp16 subnormals are normal floats), so fp16 subnormals
// survive; bfloat subnormals are float subnormals and flush, as on the GPU. The fibers of a worker
// run with its mode: on x86-64 the switch leaves MXCSR alone; on aarch64 the switch carries FPCR
// and a new fiber starts from the worker's (context_init).
class FloatModeScope {
 public:
  explicit FloatModeScope(bool flush) {
#if defined(__x86_64__)
    constexpr unsigned kFtzDaz = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
    saved_ = _mm_getcsr();
    _mm_setcsr(flush ? (saved_ | kFtzDaz) : (saved_ & ~kFtzDaz));
#elif defined(__aarch64__)
    constexpr uint64_t kFz = uint64_t(1) << 24;
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved_));
    uint64_t v = flush ? (saved_ | kFz) : (saved_ & ~kFz);
    __asm__ volatile("msr fpcr, %0" : : "r"(v));
#else
    (void)flush;  // other hosts run IEEE arithmetic only (bnb_mps.emulator says so)
#endif
  }
  ~FloatModeScope() {
#if defined(__x86_64__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FloatModeScope(const FloatModeScope&) = delete;
  FloatModeScope& operator=(const FloatModeScope&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

// ---------------------------------------------------------------------------------------------
// The worker pool.

class Pool {
 public:
  explicit Pool(unsigned n) {
    arenas_ = static_cast<unsigned char*>(std::aligned_alloc(64, n * kMaxThreadgroupMemory));
    for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(arenas_ + i * kMaxThreadgroupMemory); });
  }
  unsigned size() const { return unsigned(threads_.size()); }
  uintptr_t arenas() const { return reinterpret_cast<uintptr_t>(arenas_); }

  void run(Dispatch* d, const bnb_emu_profile_window* window) {
    std::lock_guard<std::mutex> serial(run_mu_);
    if (window) {
      g_window.buffers_lo = window->buffers_lo;
      g_window.buffers_size = window->buffers_size;
      g_window.threadgroup_lo = window->threadgroup_lo;
      g_window.threadgroup_size = window->threadgroup_size;
    }
    g_dispatch.buffers = d->buffers.data();
    g_dispatch.buffer_count = uint32_t(d->buffers.size());
    d->running = size();  // (each worker leaves it in `loop`)
    std::unique_lock<std::mutex> lk(mu_);
    job_ = d;
    active_ = size();
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lk, [&] { return active_ == 0; });
    job_ = nullptr;
    g_dispatch.buffers = nullptr;
    g_dispatch.buffer_count = 0;
    g_window.buffers_size = 0;
    g_window.threadgroup_size = 0;
  }

 private:
  void loop(unsigned char* arena) {
    Worker w(arena);
    t_worker = &w;
    // Alternate signal stack: a lane that overflows its stack faults with no stack left.
    size_t alt = 256 * 1024;
    w.altstack = std::malloc(alt);
    stack_t ss{};
    ss.ss_sp = w.altstack;
    ss.ss_size = alt;
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    uint64_t seen = 0;
    for (;;) {
      Dispatch* d;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        d = job_;
      }
      w.d = d;
      w.prof = nullptr;
      if (d->req->profiling) {
        size_t slot = d->next_profile.fetch_add(1);
        if (slot < d->profiles.size()) w.prof = d->profiles[slot].get();
      }
      FloatModeScope float_mode(d->req->flush_subnormals);
      // Threadgroups are claimed a few at a time (chunk: a 16th of each worker's share, at most
      // 64), so that the workers rarely meet on the shared counter.
      const uint64_t chunk = std::max<uint64_t>(1, std::min<uint64_t>(64, d->total_groups / (16 * size())));
      for (bool running = true; running;) {
        const uint64_t first = d->next.fetch_add(chunk, std::memory_order_relaxed);
        for (uint64_t i = first; i < first + chunk; ++i) {
          if (i >= d->total_groups || d->failed.load(std::memory_order_relaxed)) {
            running = false;
            break;
          }
          w.has_pending = false;
          if (!w.run_group(group_in_order(*d, i))) {
            w.lanes_ready = 0;
            std::lock_guard<std::mutex> lk(d->mu);
            if (!d->have_fault) {
              d->have_fault = true;
              d->fault = w.pending;
            }
            d->failed.store(true);
            running = false;
            break;
          }
        }
      }
      {
        std::lock_guard<std::mutex> lk(d->stall_mu);
        --d->running;
        release_stalled(d);
      }
      w.d = nullptr;
      w.prof = nullptr;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--active_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  Dispatch* job_ = nullptr;
  unsigned active_ = 0;
  uint64_t generation_ = 0;
  unsigned char* arenas_ = nullptr;  // never freed, like the pool
};

Pool& pool() {
  // Never destroyed: workers block forever on the condition variable at process exit.
  static Pool* p = new Pool(worker_count());
  return *p;
}

// ---------------------------------------------------------------------------------------------
// Guarded buffers: each group of overlapping host buffers is copied into memory that ends right
// against a PROT_NONE page.

struct GuardedMemory {
  char* map = nullptr;
  size_t map_size = 0;
  struct Region {
    uintptr_t host;
    size_t size;
    char* dev;
    bool writable;
    char* slack_end;  // canary bytes [dev + size, slack_end) when the region had to be padded
  };
  std::vector<Region> regions;
  ~GuardedMemory() {
    if (map) munmap(map, map_size);
  }
};

size_t lowbit(uintptr_t v) { return v ? size_t(v & (~v + 1)) : size_t(1) << 20; }

constexpr unsigned char kCanary = 0xA7;

// aligned=false: data ends exactly at the guard page (exact out-of-bounds detection); its start
// may then be less aligned than the host copy. aligned=true: the start keeps the host alignment
// (up to 16 bytes) and the few bytes of padding before the guard page hold a canary.
bool bind_buffers(const LaunchRequest& q, Dispatch& d, GuardedMemory& gm, bool aligned, std::string& err) {
  const size_t ps = page_size();
  size_t n = q.buffers.size();
  // Group buffers whose host ranges overlap, so that aliasing bindings share one copy.
  std::vector<int> group(n, -1);
  struct G {
    uintptr_t lo, hi;
    size_t align;
    bool writable;
    std::vector<int> args;
  };
  std::vector<G> groups;
  for (size_t i = 0; i < n; ++i) {
    const HostBuffer& b = q.buffers[i];
    uintptr_t lo = b.host, hi = b.host + b.size;
    int found = -1;
    for (size_t k = 0; k < groups.size(); ++k)
      if (b.size && groups[k].hi > groups[k].lo && lo < groups[k].hi && groups[k].lo < hi) found = int(k);
    if (found < 0) {
      groups.push_back(G{lo, hi, b.align, b.writable, {}});
      found = int(groups.size() - 1);
    } else {
      G& g = groups[size_t(found)];
      g.lo = std::min(g.lo, lo);
      g.hi = std::max(g.hi, hi);
      g.align = std::max(g.align, b.align);
      g.writable = g.writable || b.writable;
    }
    groups[size_t(found)].args.push_back(int(i));
    group[i] = found;
  }
  // Merging can make earlier groups overlap; merge until stable.
  for (bool merged = true; merged;) {
    merged = false;
    for (size_t a = 0; a < groups.size() && !merged; ++a)
      for (size_t b = a + 1; b < groups.size() && !merged; ++b) {
        G &x = groups[a], &y = groups[b];
        if (x.hi > x.lo && y.hi > y.lo && x.lo < y.hi && y.lo < x.hi) {
          x.lo = std::min(x.lo, y.lo);
          x.hi = std::max(x.hi, y.hi);
          x.align = std::max(x.align, y.align);
          x.writable = x.writable || y.writable;
          x.args.insert(x.args.end(), y.args.begin(), y.args.end());
          groups.erase(groups.begin() + long(b));
          merged = true;
        }
      }
  }
  std::vector<size_t> offs;
  size_t total = 0;
  for (const G& g : groups) {
    offs.push_back(total);
    total += round_up(g.hi - g.lo + 16, ps) + ps;
  }
  if (total == 0) return true;
  void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    err = "cannot map guarded buffers";
    return false;
  }
  gm.map = static_cast<char*>(m);
  gm.map_size = total;
  d.bindings.assign(n, Binding{});
  d.guards.clear();
  d.misaligned = false;
  for (size_t k = 0; k < groups.size(); ++k) {
    const G& g = groups[k];
    size_t size = g.hi - g.lo;
    size_t data_pages = round_up(size + 16, ps);
    char* guard = gm.map + offs[k] + data_pages;
    mprotect(guard, ps, PROT_NONE);
    size_t host_align = std::min<size_t>(16, lowbit(g.lo));
    char* dev = guard - size;
    char* slack_end = dev + size;
    if (aligned) {
      uintptr_t want = g.lo % host_align;
      uintptr_t start = reinterpret_cast<uintptr_t>(dev);
      start -= (start % host_align + host_align - want) % host_align;
      dev = reinterpret_cast<char*>(start);
      std::memset(dev + size, kCanary, size_t(guard - (dev + size)));
    } else if (reinterpret_cast<uintptr_t>(dev) % host_align != g.lo % host_align) {
      d.misaligned = true;
    }
    if (size) std::memcpy(dev, reinterpret_cast<const void*>(g.lo), size);
    gm.regions.push_back({g.lo, size, dev, g.writable, slack_end == guard ? nullptr : guard});
    d.guards.push_back(Guard{reinterpret_cast<uintptr_t>(guard), reinterpret_cast<uintptr_t>(guard) + ps,
                             reinterpret_cast<uintptr_t>(dev + size), g.args, size});
    for (int a : g.args) {
      const HostBuffer& b = q.buffers[size_t(a)];
      d.bindings[size_t(a)] = Binding{dev + (b.host - g.lo), b.size};
      if (b.size == 0) d.bindings[size_t(a)].dev = guard;  // any access to an empty buffer faults
    }
  }
  d.buffers.clear();
  for (const Binding& b : d.bindings) d.buffers.push_back(b.dev);
  return true;
}

// One worker's profile state for dispatch `d` (buffers bound, request validated).
std::unique_ptr<WorkerProfile> make_profile(const LaunchRequest& q, const Dispatch& d) {
  auto p = std::make_unique<WorkerProfile>();
  p->line_bytes = q.line_bytes;
  p->line_shift = uint32_t(__builtin_ctz(q.line_bytes));
  for (size_t i = 0; i < q.profile.size() && i < d.bindings.size(); ++i) {
    const Binding& b = d.bindings[i];
    if (!q.profile[i].counted || b.size == 0) continue;
    BufferState s;
    s.binding = int(i);
    s.lo = reinterpret_cast<uintptr_t>(b.dev);
    s.size = b.size;
    s.offset = q.profile[i].line_offset % q.line_bytes;
    s.touched.assign((b.size + 63) / 64, 0);
    s.stamp.assign((b.size + s.offset + q.line_bytes - 1) / q.line_bytes + 1, 0);
    p->lo = std::min(p->lo, s.lo);
    p->hi = std::max(p->hi, s.lo + s.size);
    p->bufs.push_back(std::move(s));
  }
  return p;
}

// Lines of `line_bytes` holding at least one set bit of `touched` (bytes shifted by `offset`).
uint64_t lines_touched(const std::vector<uint64_t>& touched, size_t size, uint32_t offset, uint32_t line_bytes) {
  uint64_t lines = 0;
  size_t b = 0;
  while (b < size) {
    size_t w = b >> 6;
    uint64_t bits = touched[w] & (~uint64_t(0) << (b & 63));
    while (!bits && ++w < touched.size()) bits = touched[w];
    if (!bits) break;
    size_t hit = (w << 6) + size_t(__builtin_ctzll(bits));
    if (hit >= size) break;
    ++lines;
    b = ((hit + offset) / line_bytes + 1) * line_bytes - offset;  // first byte of the next line
  }
  return lines;
}

ProfileResult merge_profiles(const LaunchRequest& q, const Dispatch& d) {
  ProfileResult out;
  out.buffers.assign(q.buffers.size(), BufferTraffic{});
  std::vector<uint64_t> touched;
  for (size_t slot = 0; d.profiles.size() && slot < d.profiles[0]->bufs.size(); ++slot) {
    const BufferState& first = d.profiles[0]->bufs[slot];
    BufferTraffic& t = out.buffers[size_t(first.binding)];
    touched.assign(first.touched.size(), 0);
    for (const auto& p : d.profiles) {
      const BufferState& b = p->bufs[slot];
      t.load_bytes += b.t.load_bytes;
      t.store_bytes += b.t.store_bytes;
      t.atomic_bytes += b.t.atomic_bytes;
      t.accesses += b.t.accesses;
      t.lines_summed += b.t.lines_summed;
      t.transactions += b.t.transactions;
      for (size_t i = 0; i < touched.size(); ++i) touched[i] |= b.touched[i];
    }
    for (uint64_t word : touched) t.unique_bytes += uint64_t(__builtin_popcountll(word));
    t.lines = lines_touched(touched, first.size, first.offset, q.line_bytes);
  }
  for (const auto& p : d.profiles) {
    const ProfileResult& r = p->r;
    out.instructions += r.instructions;
    out.transactions += r.transactions;
    out.threadgroups += r.threadgroups;
    out.threads += r.threads;
    out.barriers += r.barriers;
    out.barriers_max = std::max(out.barriers_max, r.barriers_max);
    out.collectives += r.collectives;
    out.threadgroup_memory_max = std::max(out.threadgroup_memory_max, r.threadgroup_memory_max);
    out.threadgroup_load_bytes += r.threadgroup_load_bytes;
    out.threadgroup_store_bytes += r.threadgroup_store_bytes;
    out.threadgroup_atomic_bytes += r.threadgroup_atomic_bytes;
  }
  return out;
}

std::string args_text(const std::vector<int>& args) {
  std::string s;
  for (size_t i = 0; i < args.size(); ++i) s += (i ? ", " : "") + std::string("buffer(") + std::to_string(args[i]) + ")";
  return s;
}

std::string lane_text(const RawFault& f) {
  if (!f.have_lane) return "";
  char pos[300];
  format_position(pos, sizeof pos, f.lane);
  return std::string(" [") + pos + "]";
}

}  // namespace

// One worker per CPU, and at least two (unless BNB_MPS_EMU_THREADS says otherwise): threadgroups run
// side by side even on one CPU, so that one may stall after a device atomic while others run on
// (rt_device_atomic).
unsigned worker_count() {
  static const unsigned n = [] {
    unsigned v = std::max(2u, std::thread::hardware_concurrency());
    if (const char* e = std::getenv("BNB_MPS_EMU_THREADS")) v = unsigned(std::strtoul(e, nullptr, 10));
    return std::max(1u, std::min(v ? v : 1u, 64u));
  }();
  return n;
}

const bnb_emu_runtime* runtime_table() { return &g_table; }

LaunchResult launch(const LaunchRequest& q) {
  LaunchResult res;
  auto fail = [&](int kind, std::string msg) {
    res.kind = kind;
    res.message = "kernel '" + q.kernel + "': " + msg;
    return res;
  };
  uint64_t per_group = uint64_t(q.group_size[0]) * q.group_size[1] * q.group_size[2];
  if (per_group == 0) return fail(BNB_EMU_LIMIT_EXCEEDED, "threadgroup size must not be zero");
  if (per_group > kMaxThreadsPerGroup)
    return fail(BNB_EMU_LIMIT_EXCEEDED, "threadgroup of " + std::to_string(per_group) +
                                            " threads exceeds the Metal limit of 1024 threads per threadgroup");
  uint64_t groups = uint64_t(q.groups[0]) * q.groups[1] * q.groups[2];
  if (q.profiling) {
    if (q.line_bytes < 16 || (q.line_bytes & (q.line_bytes - 1)))
      return fail(BNB_EMU_KERNEL_ERROR, "profile line size must be a power of two >= 16");
    if (q.profile.size() != q.buffers.size())
      return fail(BNB_EMU_KERNEL_ERROR, "profile: one entry per buffer expected");
    if (q.buffers.size() > 255) return fail(BNB_EMU_KERNEL_ERROR, "profile: at most 255 buffers");
    res.profile.buffers.assign(q.buffers.size(), BufferTraffic{});
  }
  if (groups == 0) return res;

  for (bool aligned : {false, true}) {
    Dispatch d;
    d.req = &q;
    d.total_groups = groups;
    for (int k = 0; k < 3; ++k) {
      uint32_t rem = q.threads[k] % q.group_size[k];
      d.edge[k] = (q.threads[k] && rem) ? rem : 0;
    }
    GuardedMemory gm;
    std::string err;
    if (!bind_buffers(q, d, gm, aligned, err)) return fail(BNB_EMU_KERNEL_ERROR, err);
    bnb_emu_profile_window window{0, 0, 0, 0};
    if (q.profiling) {
      for (unsigned i = 0; i < pool().size(); ++i) d.profiles.push_back(make_profile(q, d));
      const WorkerProfile& p = *d.profiles[0];
      if (p.hi > p.lo) {
        window.buffers_lo = p.lo;
        window.buffers_size = p.hi - p.lo;
      }
      window.threadgroup_lo = pool().arenas();
      window.threadgroup_size = pool().size() * kMaxThreadgroupMemory;
    }
    if (q.coherence_check) {
      auto c = std::make_unique<Coherence>();
      c->version = q.metal_version;
      uintptr_t lo = UINTPTR_MAX, hi = 0;
      for (const Guard& g : d.guards) {
        if (!g.size) continue;
        auto r = std::make_unique<CoherenceRegion>();
        r->lo = g.data_end - g.size;
        r->size = g.size;
        r->args = g.args;
        lo = std::min(lo, r->lo);
        hi = std::max(hi, r->lo + r->size);
        c->regions.push_back(std::move(r));
      }
      if (hi > lo) {
        window.buffers_lo = lo;
        window.buffers_size = hi - lo;
      }
      d.coherence = std::move(c);
    }
    install_handlers();
    pool().run(&d, q.profiling || q.coherence_check ? &window : nullptr);
    if (d.have_fault) {
      RawFault& f = d.fault;
      res.kind = f.kind;
      std::string msg = f.message;
      if (f.kind == BNB_EMU_MEMORY_FAULT) {
        for (const Guard& g : d.guards)
          if (f.addr >= g.lo && f.addr < g.hi) {
            f.kind = res.kind = BNB_EMU_OUT_OF_BOUNDS;
            char m[400];
            std::snprintf(m, sizeof m, "out-of-bounds %s of %s at byte %zu past its end (%zu bytes bound)",
                          f.is_write == 1 ? "write" : f.is_write == 0 ? "read" : "access", args_text(g.args).c_str(),
                          size_t(f.addr - g.data_end), g.size);
            msg = m;
          }
        if (res.kind == BNB_EMU_MEMORY_FAULT) {
          bool stack = f.addr >= f.stack_guard_lo && f.addr < f.stack_guard_hi;
#if defined(SI_KERNEL)
          bool general_protection = f.si_code == SI_KERNEL;  // x86: misaligned SSE access, bad address
#else
          bool general_protection = false;
#endif
          if (general_protection && !aligned && d.misaligned) {
            res = LaunchResult{};
            continue;  // a vector access the exact-end placement misaligned: run again aligned
          }
          char m[300];
          std::snprintf(m, sizeof m, "invalid memory access at address 0x%zx%s", size_t(f.addr),
                        general_protection ? " (general protection: a misaligned vector access or a non-canonical address)" : "");
          msg = stack ? std::string("stack overflow (the fiber stack is ") + std::to_string(stack_bytes() / 1024) +
                            " KiB; set BNB_MPS_EMU_STACK_KB for more)"
                      : std::string(m);
          if (stack) res.kind = f.kind = BNB_EMU_STACK_OVERFLOW;
        }
        if (f.pc) {
          Dl_info info;
          if (dladdr(reinterpret_cast<void*>(f.pc), &info) && info.dli_fname) {
            res.object_path = info.dli_fname;
            res.pc_offset = f.pc - reinterpret_cast<uintptr_t>(info.dli_fbase);
          }
        }
      }
      res.where = where(f.file, f.line);
      res.message = "kernel '" + q.kernel + "': " + msg + (res.where.empty() ? "" : " at " + res.where) + lane_text(f);
      return res;
    }
    // Canaries of padded regions: an out-of-bounds write that the guard page could not catch.
    for (size_t k = 0; k < gm.regions.size(); ++k) {
      const auto& r = gm.regions[k];
      if (!r.slack_end) continue;
      for (char* p = r.dev + r.size; p < r.slack_end; ++p)
        if (static_cast<unsigned char>(*p) != kCanary)
          return fail(BNB_EMU_OUT_OF_BOUNDS, "out-of-bounds write of " + args_text(d.guards[k].args) + " at byte " +
                                                 std::to_string(p - (r.dev + r.size)) +
                                                 " past its end (found after the dispatch; thread unknown)");
    }
    for (const auto& r : gm.regions)
      if (r.writable && r.size) std::memcpy(reinterpret_cast<void*>(r.host), r.dev, r.size);
    if (q.profiling) res.profile = merge_profiles(q, d);
    return res;
  }
  return res;
}

}  // namespace bnb_emu
