// Everything that talks to the runtime: barriers, SIMD-group functions, simdgroup_matrix,
// atomics. Each SIMD-group function is a yield point: the lane deposits its operand, the runtime
// waits until no lane of the simdgroup can run, then a resolver (below, one per operation and
// type) computes every active lane's result in lane order.
#pragma once

#include "abi.h"
#include "math.h"

#if defined(__F16C__)
#include <immintrin.h>  // one instruction for 8 half -> float conversions (simdgroup_matrix rows)
#endif

namespace metal {
namespace emu {

// Set by bnb_emu_module_init when the runtime loads this module.
inline const bnb_emu_runtime* rt = nullptr;

// The calling simulated thread's header, at the top of its fiber stack (bnb_emu_fiber): found from
// the address of the current frame, without a call. Only kernel code running in a lane may ask.
inline bnb_emu_fiber& fiber() {
  const uintptr_t frame = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  return *reinterpret_cast<bnb_emu_fiber*>(((frame | (rt->stack_align - 1)) + 1) - sizeof(bnb_emu_fiber));
}
inline const bnb_emu_lane& lane() { return *fiber().lane; }

inline void threadgroup_touch(const volatile void* p, size_t n, int kind) {
#if BNB_EMU_RACE_CHECK
  rt->threadgroup_access(const_cast<const void*>(p), n, kind, nullptr, 0);
#else
  (void)p, (void)n, (void)kind;
#endif
}

// --- profiler hooks (modules built with BNB_EMU_PROFILE; see kernel.h) ---------------------------

#if BNB_EMU_PROFILE
// Reports an access the shim makes on the kernel's behalf in another form (recorded even while
// the lane is muted).
inline void profile_access(const volatile void* p, size_t n, int kind) {
  rt->profile_access(const_cast<const void*>(p), n, kind | BNB_EMU_PROFILE_FORCED);
}
// Hides the instrumented accesses of a scope (the shim's own way of emulating an operation) from
// the profiler. The scope must not contain a yield point.
struct profile_mute_scope {
  profile_mute_scope() { rt->profile_mute(1); }
  ~profile_mute_scope() { rt->profile_mute(0); }
  profile_mute_scope(const profile_mute_scope&) = delete;
  profile_mute_scope& operator=(const profile_mute_scope&) = delete;
};
#define BNB_EMU_PROFILE_MUTE ::metal::emu::profile_mute_scope bnb_emu_profile_mute_
#define BNB_EMU_PROFILE_ACCESS(p, n, kind) ::metal::emu::profile_access(p, n, kind)
#else
#define BNB_EMU_PROFILE_MUTE (void)0
#define BNB_EMU_PROFILE_ACCESS(p, n, kind) (void)0
#endif

constexpr uint32_t kSimdWidth = 32;

template <class Op, class Out, class In>
inline Out collective(const char* what, const In& in, const char* file, int line) {
  Out out{};
  rt->simd_collective(&Op::resolve, what, const_cast<In*>(&in), &out, file, line);
  return out;
}

#define BNB_EMU_FOR_ACTIVE(i) \
  for (uint32_t i = 0; i < kSimdWidth; ++i) \
    if (active & (1u << i))

struct op_add {
  template <class T>
  static T apply(const T& a, const T& b) { return T(a + b); }
  template <class T>
  static T identity() { return T(0); }
};
struct op_mul {
  template <class T>
  static T apply(const T& a, const T& b) { return T(a * b); }
  template <class T>
  static T identity() { return T(1); }
};
struct op_min {
  template <class T>
  static T apply(const T& a, const T& b) { return T(::metal::min(a, b)); }
};
struct op_max {
  template <class T>
  static T apply(const T& a, const T& b) { return T(::metal::max(a, b)); }
};
struct op_and {
  template <class T>
  static T apply(const T& a, const T& b) { return T(a & b); }
};
struct op_or {
  template <class T>
  static T apply(const T& a, const T& b) { return T(a | b); }
};
struct op_xor {
  template <class T>
  static T apply(const T& a, const T& b) { return T(a ^ b); }
};

// Reduction over the active lanes, in lane order; every active lane gets the result.
template <class T, class Op>
struct reduce {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    T acc{};
    bool first = true;
    BNB_EMU_FOR_ACTIVE(i) {
      const T& v = *static_cast<const T*>(o[i]);
      acc = first ? v : Op::apply(acc, v);
      first = false;
    }
    BNB_EMU_FOR_ACTIVE(i) *static_cast<T*>(r[i]) = acc;
  }
};

// Prefix scans over the active lanes in lane order.
template <class T, class Op, bool Inclusive>
struct scan {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    T acc = Op::template identity<T>();
    BNB_EMU_FOR_ACTIVE(i) {
      const T& v = *static_cast<const T*>(o[i]);
      if (Inclusive) {
        acc = Op::apply(acc, v);
        *static_cast<T*>(r[i]) = acc;
      } else {
        *static_cast<T*>(r[i]) = acc;
        acc = Op::apply(acc, v);
      }
    }
  }
};

template <class T>
struct shuffle_arg {
  T value;
  int32_t arg;
};
enum shuffle_kind { SHUF_INDEX, SHUF_DOWN, SHUF_UP, SHUF_ROT_DOWN, SHUF_ROT_UP, SHUF_XOR, SHUF_FIRST };

// Lane i reads lane src(i). Reading an inactive lane is undefined in Metal: zero here. Shifts
// past the end of the simdgroup keep the lane's own value (simd_shuffle_down/up).
template <class T, int Kind>
struct shuffle {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    uint32_t first = uint32_t(__builtin_ctz(active));
    BNB_EMU_FOR_ACTIVE(i) {
      const auto& me = *static_cast<const shuffle_arg<T>*>(o[i]);
      int64_t src;
      switch (Kind) {
        case SHUF_INDEX: src = me.arg; break;
        case SHUF_DOWN: src = int64_t(i) + me.arg; break;
        case SHUF_UP: src = int64_t(i) - me.arg; break;
        case SHUF_ROT_DOWN: src = (int64_t(i) + me.arg) % kSimdWidth; break;
        case SHUF_ROT_UP: src = ((int64_t(i) - me.arg) % kSimdWidth + kSimdWidth) % kSimdWidth; break;
        case SHUF_XOR: src = int64_t(i ^ uint32_t(me.arg)); break;
        default: src = first; break;
      }
      T out{};
      if ((Kind == SHUF_DOWN || Kind == SHUF_UP) && (src < 0 || src >= int64_t(kSimdWidth)))
        out = me.value;
      else if (src >= 0 && src < int64_t(kSimdWidth) && (active & (1u << src)))
        out = static_cast<const shuffle_arg<T>*>(o[src])->value;
      *static_cast<T*>(r[i]) = out;
    }
  }
};

struct vote_arg {
  bool value;
};
struct vote_result {
  uint64_t bits, active;
};
struct ballot {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    uint64_t bits = 0;
    BNB_EMU_FOR_ACTIVE(i) if (static_cast<const vote_arg*>(o[i])->value) bits |= 1ull << i;
    BNB_EMU_FOR_ACTIVE(i) *static_cast<vote_result*>(r[i]) = vote_result{bits, active};
  }
};
struct is_first {
  static void resolve(void* const*, void* const* r, uint32_t active) {
    uint32_t first = uint32_t(__builtin_ctz(active));
    BNB_EMU_FOR_ACTIVE(i) *static_cast<bool*>(r[i]) = i == first;
  }
};
struct rendezvous {
  static void resolve(void* const*, void* const*, uint32_t) {}
};
// A collective whose operand every active lane must pass identically (simdgroup_matrix load and
// store addresses): the result tells each lane whether they did.
template <class T>
struct uniform_check {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    const T* first = nullptr;
    bool ok = true;
    BNB_EMU_FOR_ACTIVE(i) {
      const T* v = static_cast<const T*>(o[i]);
      if (!first)
        first = v;
      else if (__builtin_memcmp(first, v, sizeof(T)) != 0)
        ok = false;
    }
    BNB_EMU_FOR_ACTIVE(i) *static_cast<bool*>(r[i]) = ok;
  }
};
#undef BNB_EMU_FOR_ACTIVE

}  // namespace emu

// --- barriers -------------------------------------------------------------------------------

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint(a) & uint(b)); }
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

inline void threadgroup_barrier(mem_flags flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::rt->barrier(uint(flags), file, line);
}
inline void simdgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  emu::collective<emu::rendezvous, char>("simdgroup_barrier", 0, file, line);
}

// --- SIMD-group functions -------------------------------------------------------------------

struct simd_vote {
  using vote_t = ulong;
  simd_vote() = default;
  explicit simd_vote(vote_t v) : bits_(v), active_(0xFFFFFFFFull) {}
  simd_vote(vote_t v, vote_t active) : bits_(v), active_(active) {}
  explicit operator vote_t() const { return bits_; }
  bool all() const { return (bits_ & active_) == active_; }
  bool any() const { return bits_ != 0; }

 private:
  vote_t bits_ = 0, active_ = 0;
};

#define BNB_EMU_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()
#define BNB_EMU_REDUCE(name, op)                                                                    \
  template <class T>                                                                                \
  inline T name(T x, BNB_EMU_SITE) {                                                                \
    return emu::collective<emu::reduce<T, emu::op>, T>(#name, x, file, line);                       \
  }
BNB_EMU_REDUCE(simd_sum, op_add)
BNB_EMU_REDUCE(simd_product, op_mul)
BNB_EMU_REDUCE(simd_min, op_min)
BNB_EMU_REDUCE(simd_max, op_max)
BNB_EMU_REDUCE(simd_and, op_and)
BNB_EMU_REDUCE(simd_or, op_or)
BNB_EMU_REDUCE(simd_xor, op_xor)
#undef BNB_EMU_REDUCE
#define BNB_EMU_SCAN(name, op, incl)                                                                \
  template <class T>                                                                                \
  inline T name(T x, BNB_EMU_SITE) {                                                                \
    return emu::collective<emu::scan<T, emu::op, incl>, T>(#name, x, file, line);                   \
  }
BNB_EMU_SCAN(simd_prefix_inclusive_sum, op_add, true)
BNB_EMU_SCAN(simd_prefix_exclusive_sum, op_add, false)
BNB_EMU_SCAN(simd_prefix_inclusive_product, op_mul, true)
BNB_EMU_SCAN(simd_prefix_exclusive_product, op_mul, false)
#undef BNB_EMU_SCAN
#define BNB_EMU_SHUFFLE(name, kind, argtype)                                                        \
  template <class T>                                                                                \
  inline T name(T x, argtype a, BNB_EMU_SITE) {                                                     \
    return emu::collective<emu::shuffle<T, emu::kind>, T>(#name, emu::shuffle_arg<T>{x, int32_t(a)}, file, line); \
  }
BNB_EMU_SHUFFLE(simd_shuffle, SHUF_INDEX, ushort)
BNB_EMU_SHUFFLE(simd_broadcast, SHUF_INDEX, ushort)
BNB_EMU_SHUFFLE(simd_shuffle_down, SHUF_DOWN, ushort)
BNB_EMU_SHUFFLE(simd_shuffle_up, SHUF_UP, ushort)
BNB_EMU_SHUFFLE(simd_shuffle_rotate_down, SHUF_ROT_DOWN, ushort)
BNB_EMU_SHUFFLE(simd_shuffle_rotate_up, SHUF_ROT_UP, ushort)
BNB_EMU_SHUFFLE(simd_shuffle_xor, SHUF_XOR, ushort)
#undef BNB_EMU_SHUFFLE
template <class T>
inline T simd_broadcast_first(T x, BNB_EMU_SITE) {
  return emu::collective<emu::shuffle<T, emu::SHUF_FIRST>, T>("simd_broadcast_first", emu::shuffle_arg<T>{x, 0},
                                                                file, line);
}
inline simd_vote simd_ballot(bool b, BNB_EMU_SITE) {
  auto r = emu::collective<emu::ballot, emu::vote_result>("simd_ballot", emu::vote_arg{b}, file, line);
  return simd_vote(r.bits, r.active);
}
inline simd_vote simd_active_threads_mask(BNB_EMU_SITE) {
  auto r = emu::collective<emu::ballot, emu::vote_result>("simd_active_threads_mask", emu::vote_arg{true}, file, line);
  return simd_vote(r.bits, r.active);
}
inline bool simd_any(bool b, BNB_EMU_SITE) {
  return emu::collective<emu::ballot, emu::vote_result>("simd_any", emu::vote_arg{b}, file, line).bits != 0;
}
inline bool simd_all(bool b, BNB_EMU_SITE) {
  auto r = emu::collective<emu::ballot, emu::vote_result>("simd_all", emu::vote_arg{b}, file, line);
  return (r.bits & r.active) == r.active;
}
inline bool simd_is_first(BNB_EMU_SITE) {
  return emu::collective<emu::is_first, bool>("simd_is_first", 0, file, line);
}

// --- simdgroup_matrix ---------------------------------------------------------------------------
// On the GPU each lane holds a share of a simdgroup_matrix (two elements of an 8x8). Here lane L's
// share is, in row-major order, elements E*L .. E*L + E - 1 (E = R*C/32, rounded up; in a
// simdgroup of n < 32 lanes, lane L also owns the shares of lanes L + n, L + 2n, ...): the model of
// the profiler (profile_matrix_share). Each lane keeps an R x C array, of which:
//   - after the default constructor, no element is written yet: the matrix is zero (`kZero`), and
//     its elements are written as zeros only where it is used before it is loaded (kernels declare
//     operands in their loops and load them right away);
//   - after simdgroup_load, make_filled_simdgroup_matrix or the diagonal constructor, every element
//     is valid (`kFull`): each lane read every element. A square matrix loaded with transpose is
//     kept as it lies in memory, rows copied whole, and read transposed (`transposed`);
//   - after simdgroup_multiply(_accumulate), only the lane's share is (`kShare`): the lane computed its
//     elements of the result, each accumulated in float in k order. That is all a later product
//     needs of an accumulator and all simdgroup_store writes (each lane its share). A product whose
//     left or right operand is such a result first completes it from the other lanes' shares (a
//     SIMD-group collective, `gather`).
// Load, store and multiply need nothing from other lanes, so (outside profiling builds) they are
// not yield points: a lane runs through a chain of them without a fiber switch, and the product is
// computed 2 elements per lane instead of 64. What the collectives used to check is checked by the
// runtime instead (rt->matrix_op): every lane of a simdgroup must run the same operations, at the
// same place, with the same arguments (address, stride, origin, transpose), in the same order: a
// lane's n-th operation since its simdgroup last synchronised is compared with the n-th one the
// first lane there logged, and at the next synchronisation (a SIMD-group function, a threadgroup
// barrier, the end of the threadgroup) every lane must have run as many. As Metal requires, what
// other lanes wrote is visible to a simdgroup_load, and a simdgroup_store's other shares are
// visible to a lane, only after a barrier (simdgroup_barrier or threadgroup_barrier).
// Profiling builds keep every operation a SIMD-group collective, as before: the profiler counts
// collectives and forms SIMD-group memory instructions between synchronisations.

namespace emu {
enum matrix_state : unsigned char { kZero, kFull, kShare };
}
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  // Mutable: a kZero operand is written as zeros where it is first used (emu::materialize), which
  // does not change its value.
  alignas(2 * sizeof(T)) mutable T m[Rows][Cols];  // a lane's two elements are one vec<T, 2> (thread_elements)
  mutable emu::matrix_state state = emu::kZero;
  bool transposed = false;  // element (i, j) is m[j][i] (square matrices only)
  simdgroup_matrix() {}
  explicit simdgroup_matrix(T diagonal) : m{}, state(emu::kFull) {
    for (int i = 0; i < Rows && i < Cols; ++i) m[i][i] = diagonal;
  }
  T& at(int i, int j) const { return transposed ? m[j][i] : m[i][j]; }
  // This lane's two elements of an 8x8 matrix in a simdgroup of 32 lanes (defined below).
  vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> r;
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < Cols; ++j) r.m[i][j] = value;
  r.state = emu::kFull;
  return r;
}

namespace emu {
struct matrix_access {
  const volatile void* ptr;
  ulong stride, col, row;
  ulong transpose;  // not bool: no padding bytes, the lanes' operands are compared bytewise
};
template <class T>
struct identity {
  using type = T;
};
inline void check_uniform(const char* what, const matrix_access& a, const char* file, int line) {
  if (!collective<uniform_check<matrix_access>, bool>(what, a, file, line))
    rt->fail(BNB_EMU_DIVERGENT_COLLECTIVE,
             "simdgroup_matrix operation with arguments that differ between the lanes of the simdgroup", file,
             line);
}
// A simdgroup_matrix operation of the calling lane (`access`: a load's or store's arguments).
// Returns the lane.
inline const bnb_emu_lane& matrix_op(const char* what, const matrix_access* access, const char* file, int line) {
#if BNB_EMU_PROFILE
  if (access)
    check_uniform(what, *access, file, line);
  else
    collective<rendezvous, char>(what, 0, file, line);
  return lane();
#else
  // The common case inline: another lane of the simdgroup already logged this operation.
  static_assert(sizeof(matrix_access) == 40 && sizeof(matrix_access) <= sizeof(bnb_emu_matrix_op::args), "");
  bnb_emu_fiber& f = fiber();
  const uint32_t n = f.matrix_ops;
  if (n < f.matrix_log->count) {
    const bnb_emu_matrix_op& op = f.matrix_log->ops[n];
    bool same = op.what == what && op.file == file && op.line == line && op.size == (access ? 40u : 0u);
    if (same && access) {
      uint64_t a[5], b[5];
      __builtin_memcpy(a, op.args, 40);
      __builtin_memcpy(b, access, 40);
      same = ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) | (a[4] ^ b[4])) == 0;
    }
    if (same) {
      f.matrix_ops = n + 1;
      return *f.lane;
    }
  }
  return *rt->matrix_op(what, access, access ? sizeof *access : 0, file, line);  // logs it, or compares in full
#endif
}

// The elements of an R x C matrix that lane `lane` of a simdgroup of `lanes` lanes owns: f(row,
// column) for each, in row-major order.
template <int R, int C, class F>
inline void for_share(uint32_t lane, uint32_t lanes, F f) {
  constexpr int E = (R * C + 31) / 32;
  for (uint32_t s = lane; s * E < uint32_t(R * C); s += lanes)
    for (int e = int(s) * E; e < int(s) * E + E && e < R * C; ++e) f(e / C, e % C);
}
template <int R, int C, class F>
inline void for_share(const bnb_emu_lane& l, F f) {
  for_share<R, C>(l.thread_index_in_simdgroup, l.lanes_in_simdgroup, f);
}

// Writes a kZero matrix's elements (as the zero-initialising constructor would have).
template <class T, int C, int R>
inline void materialize(const simdgroup_matrix<T, C, R>& x) {
  if (x.state != kZero) return;
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) x.m[i][j] = T();
  x.state = kFull;
}

// Eight floats of an 8-wide matrix in one vector: its row r as it lies in the array, or its column.
typedef float float8_t __attribute__((vector_size(32)));
template <class T>
inline float8_t row8(const simdgroup_matrix<T, 8, 8>& x, int r) {
  if constexpr (std::is_same<T, float>::value) {
    float8_t v;
    __builtin_memcpy(&v, x.m[r], sizeof v);
    return v;
#if defined(__F16C__)
  } else if constexpr (std::is_same<T, half>::value) {
    // vcvtph2ps: the instruction `float(h)` compiles to (bnb_mps.emulator.build.isa_flags), eight at a time.
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.m[r])));
    float8_t v;
    __builtin_memcpy(&v, &f, sizeof v);
    return v;
#endif
  } else {
    return float8_t{float(x.m[r][0]), float(x.m[r][1]), float(x.m[r][2]), float(x.m[r][3]),
                    float(x.m[r][4]), float(x.m[r][5]), float(x.m[r][6]), float(x.m[r][7])};
  }
}
template <class T>
inline float8_t column8(const simdgroup_matrix<T, 8, 8>& x, int c) {
  return float8_t{float(x.m[0][c]), float(x.m[1][c]), float(x.m[2][c]), float(x.m[3][c]),
                  float(x.m[4][c]), float(x.m[5][c]), float(x.m[6][c]), float(x.m[7][c])};
}

// This lane's elements of d = a * b (+ c), each accumulated in float in k order from c's element
// (or 0.0f), one fused multiply-add (a single rounding) per k, as Apple GPUs compute
// simdgroup_matrix products (on float FMA units); d may be a, b or c.
template <class TD, class TA, class TB, class TC, int M, int N, int K, bool Acc>
inline void multiply_share(const bnb_emu_lane& l, simdgroup_matrix<TD, N, M>& d, const simdgroup_matrix<TA, K, M>& a,
                           const simdgroup_matrix<TB, N, K>& b, const simdgroup_matrix<TC, N, M>* c) {
  if constexpr (Acc) materialize(*c);
  if constexpr (M == 8 && N == 8 && K == 8) {
    if (l.lanes_in_simdgroup == 32) {
      // The common case: two adjacent elements of row lane / 4. Each layout combination of the
      // operands gets its own loop (no test per element).
      const int i = int(l.thread_index_in_simdgroup / 4), j = 2 * int(l.thread_index_in_simdgroup % 4);
      float acc0 = 0.0f, acc1 = 0.0f;
      if constexpr (Acc) {
        acc0 = float(c->at(i, j));
        acc1 = float(c->at(i, j + 1));
      }
      // The operands as vectors of 8 (a row of memory, a's row i or b's columns j, j + 1 when b is
      // kept transposed, converted to float by one vector conversion), then one fused multiply-add
      // per k into each accumulator, in k order.
      auto products = [&](auto a_transposed, auto b_transposed) {
        const float8_t av = a_transposed ? column8(a, i) : row8(a, i);
        const float8_t b0 = b_transposed ? row8(b, j) : column8(b, j);
        const float8_t b1 = b_transposed ? row8(b, j + 1) : column8(b, j + 1);
        for (int k = 0; k < K; ++k) {
          acc0 = __builtin_fmaf(av[k], b0[k], acc0);
          acc1 = __builtin_fmaf(av[k], b1[k], acc1);
        }
      };
      using yes = std::true_type;
      using no = std::false_type;
      if (a.transposed)
        b.transposed ? products(yes{}, yes{}) : products(yes{}, no{});
      else
        b.transposed ? products(no{}, yes{}) : products(no{}, no{});
      d.transposed = false;
      d.m[i][j] = TD(acc0);
      d.m[i][j + 1] = TD(acc1);
      d.state = kShare;
      return;
    }
  }
  TD out[M][N];
  for_share<M, N>(l, [&](int i, int j) {
    float acc = 0.0f;
    if constexpr (Acc) acc = float(c->at(i, j));
    for (int k = 0; k < K; ++k) acc = __builtin_fmaf(float(a.at(i, k)), float(b.at(k, j)), acc);
    out[i][j] = TD(acc);
  });
  d.transposed = false;
  for_share<M, N>(l, [&](int i, int j) { d.m[i][j] = out[i][j]; });
  d.state = kShare;
}

// Completes every lane's matrix from the lanes' shares (operands and results: each lane's matrix;
// kShare matrices, never transposed).
template <class T, int C, int R>
struct gather {
  static void resolve(void* const* o, void* const* r, uint32_t active) {
    const uint32_t lanes = uint32_t(__builtin_popcount(active));  // lanes 0 .. lanes - 1: all that exist
    for (uint32_t owner = 0; owner < lanes; ++owner) {
      const auto* src = static_cast<const simdgroup_matrix<T, C, R>*>(o[owner]);
      for_share<R, C>(owner, lanes, [&](int i, int j) {
        for (uint32_t k = 0; k < lanes; ++k)
          if (k != owner) static_cast<simdgroup_matrix<T, C, R>*>(r[k])->m[i][j] = src->m[i][j];
      });
    }
    for (uint32_t k = 0; k < lanes; ++k) static_cast<simdgroup_matrix<T, C, R>*>(r[k])->state = kFull;
  }
};
// A product's left or right operand must be whole in every lane.
template <class T, int C, int R>
inline void complete(const simdgroup_matrix<T, C, R>& m, const char* what, const char* file, int line) {
  materialize(m);
  if (m.state == kFull) return;  // the same in every lane of the simdgroup: they ran the same operations
  auto* p = const_cast<simdgroup_matrix<T, C, R>*>(&m);
  rt->simd_collective(&gather<T, C, R>::resolve, what, p, p, file, line);
}

// What a simdgroup_load / simdgroup_store moves, for the profiler: every lane here reads the
// whole matrix, but the simdgroup moves each element once. Modelled as each lane moving its share
// of the elements in row-major order (lane i: elements i*E .. i*E + E - 1 of the R x C matrix,
// E = R*C/32; for 8x8, two adjacent elements of row i/4), as one access per contiguous run.
template <class T, int C, int R>
inline void profile_matrix_share(const volatile T* base, ulong elements_per_row, bool transpose, int kind) {
#if BNB_EMU_PROFILE
  constexpr int E = (R * C + 31) / 32;
  const int first = int(lane().thread_index_in_simdgroup) * E;
  for (int e = first; e < first + E && e < R * C; ++e) {
    const ulong r = ulong(e / C), c = ulong(e % C);
    const volatile T* p = transpose ? base + c * elements_per_row + r : base + r * elements_per_row + c;
    if (!transpose && e + 1 < first + E && e + 1 < R * C && (e + 1) % C != 0) {
      profile_access(p, 2 * sizeof(T), kind);  // two adjacent elements of one row
      ++e;
    } else {
      profile_access(p, sizeof(T), kind);
    }
  }
#else
  (void)base, (void)elements_per_row, (void)transpose, (void)kind;
#endif
}
}  // namespace emu

// thread_elements(): elements (i, j) and (i, j + 1) of the lane's 8x8 matrix, i = L / 4 and
// j = 2 (L % 4) for lane L of a simdgroup of 32: the share above. That is the emulator's layout;
// Apple documents none, so a kernel may use thread_elements only elementwise between matrices (the
// same element of each). Afterwards the matrix is the lane's share (kShare): what the lane writes
// there is its own until a product or store uses it (gathered from the lanes' shares, if needed).
template <class T, int Cols, int Rows>
inline vec<T, 2>& simdgroup_matrix<T, Cols, Rows>::thread_elements() const {
  static_assert(Rows == 8 && Cols == 8, "thread_elements: 8x8 matrices");
  const bnb_emu_lane& l = emu::lane();
  if (l.lanes_in_simdgroup != 32)
    emu::rt->fail(BNB_EMU_KERNEL_ERROR, "thread_elements in a simdgroup of fewer than 32 threads (not modelled)",
                  __FILE__, __LINE__);
  emu::materialize(*this);
  if (transposed) {  // (kFull) laid out as it reads
    T t[8][8];
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) t[i][j] = m[j][i];
    __builtin_memcpy(static_cast<void*>(m), static_cast<const void*>(t), sizeof t);
    const_cast<simdgroup_matrix*>(this)->transposed = false;
  }
  state = emu::kShare;
  const uint32_t lane = l.thread_index_in_simdgroup;
  return *reinterpret_cast<vec<T, 2>*>(&m[lane / 4][2 * (lane % 4)]);
}

template <class T, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const volatile typename emu::identity<T>::type* src,
                           ulong elements_per_row = C, vec<ulong, 2> origin = vec<ulong, 2>(0),
                           bool transpose = false, BNB_EMU_SITE) {
  const emu::matrix_access access{src, elements_per_row, origin.x, origin.y, ulong(transpose)};
  emu::matrix_op("simdgroup_load", &access, file, line);
  const T* base = const_cast<const T*>(src) + origin.y * elements_per_row + origin.x;
  {
    BNB_EMU_PROFILE_MUTE;
    if (transpose && R != C) {
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) {
          const T* p = base + ulong(j) * elements_per_row + ulong(i);
          emu::threadgroup_touch(p, sizeof(T), BNB_EMU_ACCESS_READ);
          d.m[i][j] = *p;
        }
      d.transposed = false;
    } else {
      // Rows of memory copied whole: the matrix's rows, or (transposed) its columns.
      for (int i = 0; i < R; ++i) {
        const T* row = base + ulong(i) * elements_per_row;
        emu::threadgroup_touch(row, C * sizeof(T), BNB_EMU_ACCESS_READ);
        __builtin_memcpy(static_cast<void*>(d.m[i]), static_cast<const void*>(row), C * sizeof(T));
      }
      d.transposed = transpose;
    }
  }
  d.state = emu::kFull;
  emu::profile_matrix_share<T, C, R>(base, elements_per_row, transpose, BNB_EMU_PROFILE_LOAD);
}
// Each lane stores its share (of a whole matrix or of a product's result).
template <class T, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, volatile typename emu::identity<T>::type* dst,
                            ulong elements_per_row = C, vec<ulong, 2> origin = vec<ulong, 2>(0),
                            bool transpose = false, BNB_EMU_SITE) {
  const emu::matrix_access access{dst, elements_per_row, origin.x, origin.y, ulong(transpose)};
  const bnb_emu_lane& l = emu::matrix_op("simdgroup_store", &access, file, line);
  T* base = const_cast<T*>(dst) + origin.y * elements_per_row + origin.x;
  emu::materialize(a);
  {
    BNB_EMU_PROFILE_MUTE;
    emu::for_share<R, C>(l, [&](int i, int j) {
      T* p = transpose ? base + ulong(j) * elements_per_row + ulong(i) : base + ulong(i) * elements_per_row + ulong(j);
      *p = a.at(i, j);
    });
  }
  emu::profile_matrix_share<T, C, R>(base, elements_per_row, transpose, BNB_EMU_PROFILE_STORE);
}
// d = a * b + c: this lane's elements of d, each accumulated in float in k order.
template <class TD, class TA, class TB, class TC, int M, int N, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, M>& d, const simdgroup_matrix<TA, K, M>& a,
                                          const simdgroup_matrix<TB, N, K>& b, const simdgroup_matrix<TC, N, M>& c,
                                          BNB_EMU_SITE) {
  const bnb_emu_lane& l = emu::matrix_op("simdgroup_multiply_accumulate", nullptr, file, line);
  emu::complete(a, "simdgroup_multiply_accumulate", file, line);
  emu::complete(b, "simdgroup_multiply_accumulate", file, line);
  emu::multiply_share<TD, TA, TB, TC, M, N, K, true>(l, d, a, b, &c);
}
template <class TD, class TA, class TB, int M, int N, int K>
inline void simdgroup_multiply(simdgroup_matrix<TD, N, M>& d, const simdgroup_matrix<TA, K, M>& a,
                               const simdgroup_matrix<TB, N, K>& b, BNB_EMU_SITE) {
  const bnb_emu_lane& l = emu::matrix_op("simdgroup_multiply", nullptr, file, line);
  emu::complete(a, "simdgroup_multiply", file, line);
  emu::complete(b, "simdgroup_multiply", file, line);
  emu::multiply_share<TD, TA, TB, TD, M, N, K, false>(l, d, a, b, nullptr);
}
#undef BNB_EMU_SITE

// --- atomics ---------------------------------------------------------------------------------

enum memory_order { memory_order_relaxed = 0, memory_order_acquire = 2, memory_order_release = 3,
                    memory_order_acq_rel = 4, memory_order_seq_cst = 5 };

template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

namespace emu {
// Callers of atomic_ptr hold BNB_EMU_PROFILE_MUTE: the profiler sees one access per atomic
// operation (of `kind`), not the loads and compare-exchange loop that emulate it.
template <class T>
inline T* atomic_ptr(const volatile atomic<T>* a, int kind = BNB_EMU_PROFILE_ATOMIC) {
  threadgroup_touch(a, sizeof(T), BNB_EMU_ACCESS_ATOMIC);
  BNB_EMU_PROFILE_ACCESS(a, sizeof(T), kind);
  (void)kind;
  return const_cast<T*>(&a->value);
}
// After an atomic that wrote: where `a` is device memory, the runtime may stall the threadgroup here
// while the dispatch's other threadgroups run (rt_device_atomic in runtime.cpp, docs/emulator.md).
inline void wrote(const volatile void* a) { rt->device_atomic(const_cast<const void*>(a)); }
// What an atomic operation did to its location, for the coherence check (a read, a store, or a
// read-modify-write that wrote); before `wrote`.
inline void atomic_event(const volatile void* a, int kind) { rt->coherence_atomic(const_cast<const void*>(a), kind); }

template <class T, class F>
inline T atomic_update(const volatile atomic<T>* a, F f) {
  BNB_EMU_PROFILE_MUTE;
  T* p = atomic_ptr(a);
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, f(old), true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  atomic_event(a, BNB_EMU_ATOMIC_RMW);
  wrote(a);
  return old;
}
}  // namespace emu

template <class T, class U>
inline void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) {
  BNB_EMU_PROFILE_MUTE;
  __atomic_store_n(emu::atomic_ptr(a, BNB_EMU_PROFILE_STORE), T(v), __ATOMIC_SEQ_CST);
  emu::atomic_event(a, BNB_EMU_ATOMIC_STORE);
  emu::wrote(a);
}
template <class T>
inline T atomic_load_explicit(const volatile atomic<T>* a, memory_order) {
  BNB_EMU_PROFILE_MUTE;
  const T v = __atomic_load_n(emu::atomic_ptr(a, BNB_EMU_PROFILE_LOAD), __ATOMIC_SEQ_CST);
  emu::atomic_event(a, BNB_EMU_ATOMIC_READ);
  return v;
}
template <class T, class U>
inline T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order) {
  BNB_EMU_PROFILE_MUTE;
  const T old = __atomic_exchange_n(emu::atomic_ptr(a), T(v), __ATOMIC_SEQ_CST);
  emu::atomic_event(a, BNB_EMU_ATOMIC_RMW);
  emu::wrote(a);
  return old;
}
namespace emu {
// A weak compare-exchange may fail although the value equals *expected: spuriously, as it may on a
// GPU (Metal's atomic_compare_exchange_weak_explicit), where x86's never does. The emulator makes
// half of them fail so, at random (a fixed xorshift sequence per worker thread), storing the value
// it found in *expected as a failure does: a kernel that takes a failed weak compare-exchange for
// "another thread changed it" fails its tests, and a retry loop gets through after two tries on
// average. (A failed try is not profiled: the profiler sees one atomic access per real try.)
inline bool spurious_failure() {
  static thread_local uint32_t state = 0x9e3779b9u;
  state ^= state << 13;
  state ^= state >> 17;
  state ^= state << 5;
  return (state >> 31) != 0u;
}
}  // namespace emu

template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired, memory_order,
                                                  memory_order) {
  BNB_EMU_PROFILE_MUTE;
  if (emu::spurious_failure()) {
    *expected = __atomic_load_n(const_cast<T*>(&a->value), __ATOMIC_SEQ_CST);
    emu::atomic_event(a, BNB_EMU_ATOMIC_READ);
    return false;
  }
  const bool swapped = __atomic_compare_exchange_n(emu::atomic_ptr(a), expected, T(desired), false,
                                                   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  emu::atomic_event(a, swapped ? BNB_EMU_ATOMIC_RMW : BNB_EMU_ATOMIC_READ);
  if (swapped) emu::wrote(a);
  return swapped;
}
template <class T, class U>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* a, T* expected, U desired, memory_order,
                                                    memory_order) {
  BNB_EMU_PROFILE_MUTE;
  const bool swapped = __atomic_compare_exchange_n(emu::atomic_ptr(a), expected, T(desired), false,
                                                   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  emu::atomic_event(a, swapped ? BNB_EMU_ATOMIC_RMW : BNB_EMU_ATOMIC_READ);
  if (swapped) emu::wrote(a);
  return swapped;
}
#define BNB_EMU_ATOMIC_RMW(name, expr)                                                              \
  template <class T, class U>                                                                       \
  inline T name(volatile atomic<T>* a, U operand, memory_order) {                                   \
    T v = T(operand);                                                                               \
    return emu::atomic_update(a, [v](T old) { return T(expr); });                                   \
  }
BNB_EMU_ATOMIC_RMW(atomic_fetch_add_explicit, old + v)
BNB_EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, old - v)
BNB_EMU_ATOMIC_RMW(atomic_fetch_and_explicit, old & v)
BNB_EMU_ATOMIC_RMW(atomic_fetch_or_explicit, old | v)
BNB_EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ v)
BNB_EMU_ATOMIC_RMW(atomic_fetch_min_explicit, v < old ? v : old)
BNB_EMU_ATOMIC_RMW(atomic_fetch_max_explicit, old < v ? v : old)
#undef BNB_EMU_ATOMIC_RMW
// Metal 3.2's fence (MSL section 6.15): with memory_order_release (acq_rel, seq_cst) and
// thread_scope_device it orders this thread's earlier device writes before its later atomic writes
// for every thread of the device; with memory_order_acquire (acq_rel, seq_cst), its earlier atomic
// reads before its later device reads. The coherence check models that (runtime.cpp, "Memory
// model"); the host fence only keeps the CPU's own order.
inline void atomic_thread_fence(mem_flags flags, memory_order order, thread_scope scope = thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  emu::rt->fence(uint(flags), int(order), int(scope));
}

}  // namespace metal
