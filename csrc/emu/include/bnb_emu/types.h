// MSL scalar and vector types for the emulator: half, bfloat, vec<T, N> with MSL sizes and
// alignments (float3 is 16 bytes) and swizzles, packed_* vectors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <type_traits>
#include <utility>

#if !defined(__FLT16_MAX__)
#error "the Metal emulator needs a compiler with _Float16 (g++ >= 12, clang >= 15 on x86-64; any on arm64)"
#endif

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {
namespace emu {

// --- bfloat: the upper 16 bits of a float; float -> bfloat rounds to nearest even -------------
inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN stays NaN (quiet)
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float bfloat_bits_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace emu
}  // namespace metal

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) : bits(::metal::emu::float_to_bfloat_bits(f)) {}
  template <class S, std::enable_if_t<std::is_arithmetic<S>::value || std::is_same<S, half>::value, int> = 0>
  explicit bfloat(S v) : bfloat(float(v)) {}
  operator float() const { return ::metal::emu::bfloat_bits_to_float(bits); }
  bfloat& operator+=(bfloat o) { return *this = bfloat(float(*this) + float(o)); }
  bfloat& operator-=(bfloat o) { return *this = bfloat(float(*this) - float(o)); }
  bfloat& operator*=(bfloat o) { return *this = bfloat(float(*this) * float(o)); }
  bfloat& operator/=(bfloat o) { return *this = bfloat(float(*this) / float(o)); }
  bfloat operator-() const { return bfloat(-float(*this)); }
  bfloat operator+() const { return *this; }
};

namespace metal {
namespace emu {
template <class S>
constexpr bool is_bf_partner = std::is_arithmetic<S>::value && !std::is_same<S, bool>::value;
template <class S>
using bf_result = std::conditional_t<std::is_integral<S>::value, bfloat, std::conditional_t<std::is_same<S, half>::value, float, S>>;
}  // namespace emu
}  // namespace metal

#define BNB_EMU_BFLOAT_OP(op)                                                                       \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }            \
  template <class S, std::enable_if_t<::metal::emu::is_bf_partner<S>, int> = 0>                     \
  inline ::metal::emu::bf_result<S> operator op(bfloat a, S b) {                                    \
    using R = ::metal::emu::bf_result<S>;                                                           \
    return R(float(a) op float(b));                                                                 \
  }                                                                                                 \
  template <class S, std::enable_if_t<::metal::emu::is_bf_partner<S>, int> = 0>                     \
  inline ::metal::emu::bf_result<S> operator op(S a, bfloat b) {                                    \
    using R = ::metal::emu::bf_result<S>;                                                           \
    return R(float(a) op float(b));                                                                 \
  }
BNB_EMU_BFLOAT_OP(+)
BNB_EMU_BFLOAT_OP(-)
BNB_EMU_BFLOAT_OP(*)
BNB_EMU_BFLOAT_OP(/)
#undef BNB_EMU_BFLOAT_OP
#define BNB_EMU_BFLOAT_CMP(op)                                                                      \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }                      \
  template <class S, std::enable_if_t<::metal::emu::is_bf_partner<S>, int> = 0>                     \
  inline bool operator op(bfloat a, S b) { return float(a) op float(b); }                           \
  template <class S, std::enable_if_t<::metal::emu::is_bf_partner<S>, int> = 0>                     \
  inline bool operator op(S a, bfloat b) { return float(a) op float(b); }
BNB_EMU_BFLOAT_CMP(==)
BNB_EMU_BFLOAT_CMP(!=)
BNB_EMU_BFLOAT_CMP(<)
BNB_EMU_BFLOAT_CMP(<=)
BNB_EMU_BFLOAT_CMP(>)
BNB_EMU_BFLOAT_CMP(>=)
#undef BNB_EMU_BFLOAT_CMP

namespace metal {
using ::bfloat;
using ::half;
using ::uchar;
using ::uint;
using ::ulong;
using ::ushort;

namespace emu {

// Scalars an MSL vector can hold.
template <class T>
constexpr bool is_scalar =
    std::is_arithmetic<T>::value || std::is_same<T, half>::value || std::is_same<T, bfloat>::value;

template <class T, int N>
struct vec;
template <class T, int N, int... I>
struct swizzle;
template <class T, int N>
struct packed_vec;

template <int N>
constexpr int storage_count = N == 3 ? 4 : N;

// vec_info<V>: whether V is vector-like (vec, swizzle, packed_vec), its element type and width.
template <class V>
struct vec_info {
  static constexpr bool value = false;
};
template <class T, int N>
struct vec_info<vec<T, N>> {
  static constexpr bool value = true;
  using elem = T;
  static constexpr int n = N;
};
template <class T, int N, int... I>
struct vec_info<swizzle<T, N, I...>> {
  static constexpr bool value = true;
  using elem = T;
  static constexpr int n = int(sizeof...(I));
};
template <class T, int N>
struct vec_info<packed_vec<T, N>> {
  static constexpr bool value = true;
  using elem = T;
  static constexpr int n = N;
};
template <class V>
constexpr bool is_vec = vec_info<std::remove_cv_t<std::remove_reference_t<V>>>::value;
template <class V>
using vec_of = vec<typename vec_info<V>::elem, vec_info<V>::n>;

// Component i of a vector-like value, or the scalar itself.
template <class T, int N>
struct vec;
template <class V>
inline auto component(const V& v, int i) {
  if constexpr (is_vec<V>) {
    if constexpr (std::is_same<V, vec_of<V>>::value)
      return v.d[i];
    else
      return vec_of<V>(v).d[i];
  } else {
    (void)i;
    return v;
  }
}

// An operand of a vector operation. Profiling builds copy a vector operand first, so that an
// operand read straight from device memory (`p[i] * 2.0f`) is one vector access, not one access
// per component; elsewhere this is the operand itself.
#if BNB_EMU_PROFILE
template <class A>
inline auto operand(const A& a) {
  if constexpr (is_vec<A>)
    return vec_of<A>(a);
  else
    return a;
}
#else
template <class A>
inline const A& operand(const A& a) {
  return a;
}
#endif

template <class A>
constexpr int components() {
  if constexpr (is_vec<A>)
    return vec_info<std::remove_cv_t<std::remove_reference_t<A>>>::n;
  else
    return 1;
}

// A multi-component swizzle: shares the storage of its vector.
template <class T, int N, int... I>
struct swizzle {
  static constexpr int M = int(sizeof...(I));
  using R = vec<T, M>;
  T d[storage_count<N>];
  operator R() const { return R(d[I]...); }
  swizzle& operator=(const R& v) {
    int k = 0;
    ((d[I] = v.d[k++]), ...);
    return *this;
  }
  swizzle& operator=(const swizzle& o) { return *this = R(o); }
  template <class S, std::enable_if_t<is_scalar<S>, int> = 0>
  swizzle& operator=(S s) {
    return *this = R(T(s));
  }
  template <class B>
  swizzle& operator+=(const B& b) { return *this = R(*this) + b; }
  template <class B>
  swizzle& operator-=(const B& b) { return *this = R(*this) - b; }
  template <class B>
  swizzle& operator*=(const B& b) { return *this = R(*this) * b; }
  template <class B>
  swizzle& operator/=(const B& b) { return *this = R(*this) / b; }
  T operator[](int i) const { return R(*this).d[i]; }
};

template <class T, int N>
struct vec_storage;

#include "swizzles.inc"

#if BNB_EMU_PROFILE
// Profiling builds copy a whole vector as one LLVM vector value, so that the compiler's load/store
// instrumentation sees `uchar4 x = *p` as one 4-byte access and `uint4` as one 16-byte access
// (as the GPU loads them), not as one access per component. 32-byte vectors (long4, ulong4) are
// two 16-byte halves: the instrumentation reports accesses of at most 16 bytes.
template <size_t S>
struct vec_bits {
  typedef unsigned char type __attribute__((vector_size(S)));
};
template <>
struct vec_bits<32> {
  struct type {
    vec_bits<16>::type lo, hi;
  };
};
#define BNB_EMU_VEC_BITS(count) typename ::metal::emu::vec_bits<sizeof(T) * (count)>::type bits;
#else
#define BNB_EMU_VEC_BITS(count)
#endif

template <class T>
struct alignas(sizeof(T) * 2) vec_storage<T, 2> {
  union {
    T d[2];
    BNB_EMU_VEC_BITS(2)
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
    BNB_EMU_SWIZZLES_2
  };
};
template <class T>
struct alignas(sizeof(T) * 4) vec_storage<T, 3> {
  union {
    T d[4];
    BNB_EMU_VEC_BITS(4)
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
    BNB_EMU_SWIZZLES_3
  };
};
template <class T>
struct alignas(sizeof(T) * 4) vec_storage<T, 4> {
  union {
    T d[4];
    BNB_EMU_VEC_BITS(4)
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
    BNB_EMU_SWIZZLES_4
  };
};

template <class T, int N>
struct vec : vec_storage<T, N> {
  static_assert(N >= 2 && N <= 4, "MSL vectors have 2, 3 or 4 components");
  using value_type = T;
  static constexpr int size = N;
  using vec_storage<T, N>::d;

  vec() : vec_storage<T, N>{} {}
#if BNB_EMU_PROFILE
  vec(const vec& o) : vec_storage<T, N>{} { this->bits = o.bits; }
  vec& operator=(const vec& o) {
    this->bits = o.bits;
    return *this;
  }
#else
  // A byte copy of the storage (the union's swizzle members make the implicit copy unavailable);
  // one vector move, where a zeroed temporary and a loop over the components were not always
  // optimised into one.
  vec(const vec& o) { __builtin_memcpy(static_cast<void*>(this), static_cast<const void*>(&o), sizeof(vec)); }
  vec& operator=(const vec& o) {
    __builtin_memcpy(static_cast<void*>(this), static_cast<const void*>(&o), sizeof(vec));
    return *this;
  }
#endif
  // Splat: float4 v = 1.0f;
  template <class S, std::enable_if_t<is_scalar<S>, int> = 0>
  vec(S s) : vec_storage<T, N>{} {
    for (int i = 0; i < N; ++i) d[i] = T(s);
  }
  // Components from scalars and vectors: float4(a.xy, 0, 1).
  template <class A, class B, class... Rest,
            std::enable_if_t<(components<A>() + components<B>() + (0 + ... + components<Rest>())) == N, int> = 0>
  vec(const A& a, const B& b, const Rest&... rest) : vec_storage<T, N>{} {
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, rest), ...);
  }
  // Conversions between element types are explicit in MSL: float4(h4).
  template <class V, std::enable_if_t<is_vec<V> && vec_info<V>::n == N &&
                                          !std::is_same<typename vec_info<V>::elem, T>::value, int> = 0>
  explicit vec(const V& v) : vec_storage<T, N>{} {
    vec_of<V> t(v);
    for (int i = 0; i < N; ++i) d[i] = T(t.d[i]);
  }
  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }

  template <class B>
  vec& operator+=(const B& b) { return *this = *this + b; }
  template <class B>
  vec& operator-=(const B& b) { return *this = *this - b; }
  template <class B>
  vec& operator*=(const B& b) { return *this = *this * b; }
  template <class B>
  vec& operator/=(const B& b) { return *this = *this / b; }
  template <class B>
  vec& operator%=(const B& b) { return *this = *this % b; }
  template <class B>
  vec& operator&=(const B& b) { return *this = *this & b; }
  template <class B>
  vec& operator|=(const B& b) { return *this = *this | b; }
  template <class B>
  vec& operator^=(const B& b) { return *this = *this ^ b; }
  template <class B>
  vec& operator<<=(const B& b) { return *this = *this << b; }
  template <class B>
  vec& operator>>=(const B& b) { return *this = *this >> b; }

 private:
  template <class A>
  void put(int& k, const A& a) {
    if constexpr (is_vec<A>) {
      vec_of<A> t(a);
      for (int i = 0; i < vec_info<A>::n; ++i) d[k++] = T(t.d[i]);
    } else {
      d[k++] = T(a);
    }
  }
};

// packed_float3 and friends: element alignment, no padding.
template <class T, int N>
struct packed_vec {
  union {
    T d[N];
    struct {
      T x, y, z, w;
    };
  };
  packed_vec() : d{} {}
  packed_vec(const vec<T, N>& v) {
    for (int i = 0; i < N; ++i) d[i] = v.d[i];
  }
  template <class A, class B, class... Rest>
  packed_vec(const A& a, const B& b, const Rest&... rest) : packed_vec(vec<T, N>(a, b, rest...)) {}
  operator vec<T, N>() const {
    vec<T, N> v;
    for (int i = 0; i < N; ++i) v.d[i] = d[i];
    return v;
  }
  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }
};
template <class T>
struct packed_vec<T, 2> {
  union {
    T d[2];
    struct {
      T x, y;
    };
  };
  packed_vec() : d{} {}
  packed_vec(const vec<T, 2>& v) : d{v.d[0], v.d[1]} {}
  packed_vec(const T& a, const T& b) : d{a, b} {}
  operator vec<T, 2>() const { return vec<T, 2>(d[0], d[1]); }
  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }
};
template <class T>
struct packed_vec<T, 3> {
  union {
    T d[3];
    struct {
      T x, y, z;
    };
  };
  packed_vec() : d{} {}
  packed_vec(const vec<T, 3>& v) : d{v.d[0], v.d[1], v.d[2]} {}
  template <class A, class B, class... Rest>
  packed_vec(const A& a, const B& b, const Rest&... rest) : packed_vec(vec<T, 3>(a, b, rest...)) {}
  operator vec<T, 3>() const { return vec<T, 3>(d[0], d[1], d[2]); }
  T& operator[](int i) { return d[i]; }
  const T& operator[](int i) const { return d[i]; }
};

// --- Operators on vectors (and vector-scalar mixes) ------------------------------------------

template <class A, class B>
constexpr bool same_width() {
  if constexpr (is_vec<A> && is_vec<B>)
    return vec_info<A>::n == vec_info<B>::n;
  else
    return true;
}
template <class A, class B>
constexpr bool same_elem() {
  if constexpr (is_vec<A> && is_vec<B>)
    return std::is_same<typename vec_info<A>::elem, typename vec_info<B>::elem>::value;
  else
    return true;
}
template <class A, class B, bool = (is_vec<A> || is_vec<B>)>
struct binary_vec {};
template <class A, class B>
struct binary_vec<A, B, true> {
  static constexpr bool va = is_vec<A>, vb = is_vec<B>;
  using elem = typename vec_info<std::conditional_t<va, A, B>>::elem;
  static constexpr int n = vec_info<std::conditional_t<va, A, B>>::n;
  static_assert(same_width<A, B>(), "vector operands must have the same width");
  static_assert(same_elem<A, B>(), "vector operands must have the same element type (convert explicitly)");
  using type = vec<elem, n>;
  using mask = vec<bool, n>;
};
template <class A, class B>
constexpr bool vec_operands = (is_vec<A> || is_vec<B>)&&(is_vec<A> || is_scalar<A>)&&(is_vec<B> || is_scalar<B>);

}  // namespace emu
}  // namespace metal

#define BNB_EMU_VEC_BINOP(op)                                                                       \
  template <class A, class B, std::enable_if_t<::metal::emu::vec_operands<A, B>, int> = 0>          \
  inline typename ::metal::emu::binary_vec<A, B>::type operator op(const A& a_, const B& b_) {      \
    using BV = ::metal::emu::binary_vec<A, B>;                                                      \
    const auto& a = ::metal::emu::operand(a_);                                                      \
    const auto& b = ::metal::emu::operand(b_);                                                      \
    using E = typename BV::elem;                                                                    \
    typename BV::type out;                                                                          \
    for (int i = 0; i < BV::n; ++i)                                                                 \
      out.d[i] = E(E(::metal::emu::component(a, i)) op E(::metal::emu::component(b, i)));           \
    return out;                                                                                     \
  }
#define BNB_EMU_VEC_CMPOP(op)                                                                       \
  template <class A, class B, std::enable_if_t<::metal::emu::vec_operands<A, B>, int> = 0>          \
  inline typename ::metal::emu::binary_vec<A, B>::mask operator op(const A& a_, const B& b_) {      \
    using BV = ::metal::emu::binary_vec<A, B>;                                                      \
    const auto& a = ::metal::emu::operand(a_);                                                      \
    const auto& b = ::metal::emu::operand(b_);                                                      \
    using E = typename BV::elem;                                                                    \
    typename BV::mask out;                                                                          \
    for (int i = 0; i < BV::n; ++i)                                                                 \
      out.d[i] = E(::metal::emu::component(a, i)) op E(::metal::emu::component(b, i));              \
    return out;                                                                                     \
  }
BNB_EMU_VEC_BINOP(+)
BNB_EMU_VEC_BINOP(-)
BNB_EMU_VEC_BINOP(*)
BNB_EMU_VEC_BINOP(/)
BNB_EMU_VEC_BINOP(%)
BNB_EMU_VEC_BINOP(&)
BNB_EMU_VEC_BINOP(|)
BNB_EMU_VEC_BINOP(^)
BNB_EMU_VEC_BINOP(<<)
BNB_EMU_VEC_BINOP(>>)
BNB_EMU_VEC_BINOP(&&)
BNB_EMU_VEC_BINOP(||)
BNB_EMU_VEC_CMPOP(==)
BNB_EMU_VEC_CMPOP(!=)
BNB_EMU_VEC_CMPOP(<)
BNB_EMU_VEC_CMPOP(<=)
BNB_EMU_VEC_CMPOP(>)
BNB_EMU_VEC_CMPOP(>=)
#undef BNB_EMU_VEC_BINOP
#undef BNB_EMU_VEC_CMPOP

#define BNB_EMU_VEC_UNOP(op)                                                                        \
  template <class A, std::enable_if_t<::metal::emu::is_vec<A>, int> = 0>                            \
  inline ::metal::emu::vec_of<A> operator op(const A& a) {                                          \
    ::metal::emu::vec_of<A> v(a), out;                                                              \
    using E = typename ::metal::emu::vec_info<A>::elem;                                             \
    for (int i = 0; i < ::metal::emu::vec_info<A>::n; ++i) out.d[i] = E(op v.d[i]);                 \
    return out;                                                                                     \
  }
BNB_EMU_VEC_UNOP(-)
BNB_EMU_VEC_UNOP(+)
BNB_EMU_VEC_UNOP(~)
BNB_EMU_VEC_UNOP(!)
#undef BNB_EMU_VEC_UNOP

namespace metal {
#define BNB_EMU_VEC_TYPES(T, name)        \
  typedef emu::vec<T, 2> name##2;         \
  typedef emu::vec<T, 3> name##3;         \
  typedef emu::vec<T, 4> name##4;         \
  typedef emu::packed_vec<T, 2> packed_##name##2; \
  typedef emu::packed_vec<T, 3> packed_##name##3; \
  typedef emu::packed_vec<T, 4> packed_##name##4;
BNB_EMU_VEC_TYPES(float, float)
BNB_EMU_VEC_TYPES(half, half)
BNB_EMU_VEC_TYPES(bfloat, bfloat)
BNB_EMU_VEC_TYPES(int, int)
BNB_EMU_VEC_TYPES(uint, uint)
BNB_EMU_VEC_TYPES(short, short)
BNB_EMU_VEC_TYPES(ushort, ushort)
BNB_EMU_VEC_TYPES(char, char)
BNB_EMU_VEC_TYPES(uchar, uchar)
BNB_EMU_VEC_TYPES(long, long)
BNB_EMU_VEC_TYPES(ulong, ulong)
BNB_EMU_VEC_TYPES(bool, bool)
#undef BNB_EMU_VEC_TYPES
template <class T, int N>
using vec = emu::vec<T, N>;
}  // namespace metal
