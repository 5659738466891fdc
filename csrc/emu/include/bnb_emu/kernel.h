// How kernel text compiles unchanged: parameter attributes become default arguments that read
// the current dispatch ([[buffer(i)]] the binding, [[thread_position_in_grid]] the lane's
// position, ...), so that the runtime calls every kernel as `name()`. Threadgroup declarations
// (rewritten by the pre-pass) become references to per-threadgroup storage. Kernels register
// themselves by name.
#pragma once

#include "sync.h"

namespace metal {
namespace emu {

// `x[[buffer(0)]]` expands to `x [[maybe_unused]] = buffer_binding{0, ...}[no_index[0]]`: the
// attribute's two closing brackets close two subscripts.
struct no_index_t {};
struct no_index_maker {
  constexpr no_index_t operator[](int) const { return {}; }
};
inline constexpr no_index_maker no_index{};

// Converts to whatever the parameter is: `device T*` or `constant T&`. A `coherent(device)`
// parameter is a volatile pointer here (prelude.h): taking one tells the coherence check that the
// buffer is coherent in this dispatch.
struct buffer_value {
  void* p;
  template <class T>
  operator T*() const {
    if constexpr (std::is_volatile<T>::value) rt->coherent_buffer(p);
    return static_cast<T*>(p);
  }
  template <class T, std::enable_if_t<!std::is_pointer<T>::value, int> = 0>
  operator T&() const {
    return *static_cast<T*>(p);
  }
};
struct buffer_binding {
  uint32_t index;
  const char* file;
  int line;
  __attribute__((always_inline)) buffer_value operator[](no_index_t) const {
    const bnb_emu_dispatch* d = rt->dispatch;
    if (index < d->buffer_count) return buffer_value{d->buffers[index]};
    return buffer_value{rt->buffer(index, file, line)};  // reports the unbound buffer
  }
};

// A position attribute: converts to uint/ushort and their 2- and 3-component vectors.
struct position_value {
  uint32_t v[3];
  operator uint() const { return v[0]; }
  operator ushort() const { return ushort(v[0]); }
  operator vec<uint, 2>() const { return vec<uint, 2>(v[0], v[1]); }
  operator vec<uint, 3>() const { return vec<uint, 3>(v[0], v[1], v[2]); }
  operator vec<ushort, 2>() const { return vec<ushort, 2>(ushort(v[0]), ushort(v[1])); }
  operator vec<ushort, 3>() const { return vec<ushort, 3>(ushort(v[0]), ushort(v[1]), ushort(v[2])); }
};
struct position_binding {
  position_value value;
  position_value operator[](no_index_t) const { return value; }
};
inline position_binding attribute(const uint32_t (&v)[3]) { return {{{v[0], v[1], v[2]}}}; }
inline position_binding attribute(uint32_t v) { return {{{v, 0, 0}}}; }

// --- threadgroup storage -----------------------------------------------------------------------

#if BNB_EMU_RACE_CHECK
// Race-checking build: threadgroup arrays are wrappers whose element access reports a read to
// the race checker (writes are found by comparing threadgroup memory after every lane's turn)
// and checks the subscript.
template <class E, size_t N>
struct tg_array;
template <class T>
struct tg_wrap {
  using type = T;
};
template <class T, size_t N>
struct tg_wrap<T[N]> {
  using type = tg_array<typename tg_wrap<T>::type, N>;
};
template <class T>
struct is_tg_array : std::false_type {};
template <class E, size_t N>
struct is_tg_array<tg_array<E, N>> : std::true_type {};
template <class E, size_t N>
struct tg_array {
  E data[N];
  template <class I>
  E& operator[](I i) {
    check_index(i);
    if constexpr (!is_tg_array<E>::value) threadgroup_touch(&data[i], sizeof(E), BNB_EMU_ACCESS_READ);
    return data[i];
  }
  template <class I>
  const E& operator[](I i) const {
    check_index(i);
    if constexpr (!is_tg_array<E>::value) threadgroup_touch(&data[i], sizeof(E), BNB_EMU_ACCESS_READ);
    return data[i];
  }
  // Subscripts past either end would silently use a neighbouring threadgroup allocation.
  template <class I>
  static void check_index(I i) {
    const long long index = static_cast<long long>(i);
    if (index < 0 || static_cast<unsigned long long>(index) >= N) {
      char msg[120];
      std::snprintf(msg, sizeof msg, "threadgroup array subscript %lld is out of bounds [0, %zu)", index, N);
      rt->fail(BNB_EMU_OUT_OF_BOUNDS, msg, nullptr, 0);
    }
  }
  operator E*() { return data; }
  operator const E*() const { return data; }
};
template <class T>
using tg_type = typename tg_wrap<T>::type;
#else
template <class T>
using tg_type = T;
#endif

template <class T>
inline T& threadgroup_storage(const void* site, const char* name, const char* file, int line) {
  return *static_cast<T*>(rt->threadgroup_alloc(site, sizeof(T), alignof(T), name, file, line));
}

// --- kernel registry (one per module) --------------------------------------------------------

struct kernel_registration {
  bnb_emu_kernel_entry entry;
  kernel_registration* next;
  static kernel_registration*& head() {
    static kernel_registration* h = nullptr;
    return h;
  }
  kernel_registration(const char* name, bnb_emu_kernel_fn fn) : entry{name, fn}, next(head()) { head() = this; }
};

}  // namespace emu
}  // namespace metal

#define BNB_EMU_CAT2(a, b) a##b
#define BNB_EMU_CAT(a, b) BNB_EMU_CAT2(a, b)

// Written by the pre-pass in place of `threadgroup T name dims;` inside a kernel.
#define BNB_EMU_THREADGROUP(name, dims, ...)                                                        \
  static char bnb_emu_tg_site_##name;                                                               \
  ::metal::emu::tg_type<__VA_ARGS__ dims>& name =                                                   \
      ::metal::emu::threadgroup_storage<::metal::emu::tg_type<__VA_ARGS__ dims>>(&bnb_emu_tg_site_##name, #name, \
                                                                                 __FILE__, __LINE__)

// Appended by the pre-pass for every non-template kernel.
#define BNB_EMU_REGISTER_KERNEL(name)                                                               \
  static ::metal::emu::kernel_registration BNB_EMU_CAT(bnb_emu_kernel_, __COUNTER__)(#name, [] { name(); });

// Template kernels: the project's one registration macro. On Metal the kernel headers define it as
//   #define BNB_KERNEL_INSTANTIATE(host, fn, ...) \
//     template [[host_name(host)]] [[kernel]] decltype(fn<__VA_ARGS__>) fn<__VA_ARGS__>;
// (inside #ifndef BNB_KERNEL_INSTANTIATE); here it registers fn<...> under the name `host`.
#define BNB_KERNEL_INSTANTIATE(host, fn, ...)                                                       \
  static ::metal::emu::kernel_registration BNB_EMU_CAT(bnb_emu_kernel_, __COUNTER__)(host, [] { fn<__VA_ARGS__>(); });
// The same, written by the pre-pass for explicit instantiations spelled out in Metal syntax.
#define BNB_EMU_REGISTER_INSTANCE(host, ...)                                                        \
  static ::metal::emu::kernel_registration BNB_EMU_CAT(bnb_emu_kernel_, __COUNTER__)(host, [] { __VA_ARGS__(); });

#if BNB_EMU_PROFILE
// Profiling builds (bnb_mps.emulator's Library.profile) are compiled by clang with
// -fsanitize-coverage=trace-loads,trace-stores: the compiler calls these before every load and
// store of 1, 2, 4, 8 or 16 bytes that survives optimisation, with its address. They forward to
// the runtime, which keeps those that fall into a bound buffer or threadgroup memory and
// attributes them to the running lane. Not instrumented themselves (no_sanitize), or every call
// would recurse. Addresses outside the profile window (the stack, the runtime's data) are dropped
// here, without a call.
namespace metal {
namespace emu {
__attribute__((no_sanitize("coverage"))) inline void profile_trace(const void* p, size_t size, int kind) {
  if (!rt) return;  // static initialisers run before the runtime is known
  const volatile bnb_emu_profile_window* w = rt->profile_window;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a - w->buffers_lo >= w->buffers_size && a - w->threadgroup_lo >= w->threadgroup_size) return;
  rt->profile_access(p, size, kind);
}
}  // namespace emu
}  // namespace metal
#define BNB_EMU_TRACE(name, type, size, kind)                                                       \
  extern "C" __attribute__((visibility("hidden"), no_sanitize("coverage"))) void __sanitizer_cov_##name(type* p) { \
    ::metal::emu::profile_trace(p, size, kind);                                                     \
  }
BNB_EMU_TRACE(load1, uint8_t, 1, BNB_EMU_PROFILE_LOAD)
BNB_EMU_TRACE(load2, uint16_t, 2, BNB_EMU_PROFILE_LOAD)
BNB_EMU_TRACE(load4, uint32_t, 4, BNB_EMU_PROFILE_LOAD)
BNB_EMU_TRACE(load8, uint64_t, 8, BNB_EMU_PROFILE_LOAD)
BNB_EMU_TRACE(load16, __int128, 16, BNB_EMU_PROFILE_LOAD)
BNB_EMU_TRACE(store1, uint8_t, 1, BNB_EMU_PROFILE_STORE)
BNB_EMU_TRACE(store2, uint16_t, 2, BNB_EMU_PROFILE_STORE)
BNB_EMU_TRACE(store4, uint32_t, 4, BNB_EMU_PROFILE_STORE)
BNB_EMU_TRACE(store8, uint64_t, 8, BNB_EMU_PROFILE_STORE)
BNB_EMU_TRACE(store16, __int128, 16, BNB_EMU_PROFILE_STORE)
#undef BNB_EMU_TRACE
#endif

extern "C" __attribute__((visibility("default"))) uint32_t bnb_emu_module_init(const bnb_emu_runtime* r,
                                                                                bnb_emu_add_kernel add, void* ctx) {
  ::metal::emu::rt = r;
  for (auto* k = ::metal::emu::kernel_registration::head(); k; k = k->next) add(ctx, &k->entry);
  return BNB_EMU_ABI_VERSION;
}
