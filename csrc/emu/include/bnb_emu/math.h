// The metal:: functions kernels use: math (also as metal::precise:: and metal::fast::, both
// computed with IEEE single precision here), common, integer, relational, geometric, as_type.
#pragma once

#include "types.h"

namespace metal {
namespace emu {

// Element-wise application of f over vector-like and scalar arguments (scalars broadcast).
template <class... A>
constexpr int width() {
  int n = 1;
  ((n = components<A>() > n ? components<A>() : n), ...);
  return n;
}
template <class A, class... Rest>
struct first_vec {
  using type = std::conditional_t<is_vec<A>, A, typename first_vec<Rest...>::type>;
};
template <class A>
struct first_vec<A> {
  using type = A;
};
template <class... A>
using first_elem = typename vec_info<std::remove_cv_t<typename first_vec<A...>::type>>::elem;

template <class F, class... A>
inline auto vmap_operands(F f, const A&... a) {
  using E = first_elem<A...>;
  constexpr int n = width<A...>();
  using R = decltype(f(E(component(a, 0))...));
  vec<R, n> out;
  for (int i = 0; i < n; ++i) out.d[i] = f(E(component(a, i))...);
  return out;
}
template <class F, class... A>
inline auto vmap(F f, const A&... a) {
  return vmap_operands(f, operand(a)...);
}
template <class... A>
constexpr bool any_vec = (is_vec<A> || ...) && ((is_vec<A> || is_scalar<A>)&&...);

template <class T>
inline T bits_cast_f(float f) {
  return T(f);
}

}  // namespace emu

// --- float math ------------------------------------------------------------------------------

#define BNB_EMU_FN1(name, expr)                                                                     \
  inline float name(float x) { return expr; }                                                       \
  inline half name(half h) { return half(name(float(h))); }                                         \
  template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>                                     \
  inline auto name(const V& v) {                                                                    \
    return emu::vmap([](auto e) { return name(e); }, v);                                            \
  }
#define BNB_EMU_FN2(name, expr)                                                                     \
  inline float name(float x, float y) { return expr; }                                              \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }                       \
  template <class A, class B, std::enable_if_t<emu::any_vec<A, B>, int> = 0>                        \
  inline auto name(const A& a, const B& b) {                                                        \
    return emu::vmap([](auto x, auto y) { return name(x, y); }, a, b);                              \
  }
#define BNB_EMU_FN3(name, expr)                                                                     \
  inline float name(float x, float y, float z) { return expr; }                                     \
  inline half name(half x, half y, half z) { return half(name(float(x), float(y), float(z))); }     \
  template <class A, class B, class C, std::enable_if_t<emu::any_vec<A, B, C>, int> = 0>            \
  inline auto name(const A& a, const B& b, const C& c) {                                            \
    return emu::vmap([](auto x, auto y, auto z) { return name(x, y, z); }, a, b, c);                \
  }

BNB_EMU_FN1(acos, __builtin_acosf(x))
BNB_EMU_FN1(acosh, __builtin_acoshf(x))
BNB_EMU_FN1(asin, __builtin_asinf(x))
BNB_EMU_FN1(asinh, __builtin_asinhf(x))
BNB_EMU_FN1(atan, __builtin_atanf(x))
BNB_EMU_FN1(atanh, __builtin_atanhf(x))
BNB_EMU_FN1(cbrt, __builtin_cbrtf(x))
BNB_EMU_FN1(ceil, __builtin_ceilf(x))
BNB_EMU_FN1(cos, __builtin_cosf(x))
BNB_EMU_FN1(cosh, __builtin_coshf(x))
BNB_EMU_FN1(cospi, __builtin_cosf(x * 3.14159265358979323846f))
BNB_EMU_FN1(exp, __builtin_expf(x))
BNB_EMU_FN1(exp2, __builtin_exp2f(x))
BNB_EMU_FN1(exp10, __builtin_powf(10.0f, x))
BNB_EMU_FN1(fabs, __builtin_fabsf(x))
BNB_EMU_FN1(floor, __builtin_floorf(x))
BNB_EMU_FN1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
BNB_EMU_FN1(log, __builtin_logf(x))
BNB_EMU_FN1(log2, __builtin_log2f(x))
BNB_EMU_FN1(log10, __builtin_log10f(x))
BNB_EMU_FN1(rint, __builtin_rintf(x))
BNB_EMU_FN1(round, __builtin_roundf(x))
BNB_EMU_FN1(rsqrt, 1.0f / __builtin_sqrtf(x))
BNB_EMU_FN1(sin, __builtin_sinf(x))
BNB_EMU_FN1(sinh, __builtin_sinhf(x))
BNB_EMU_FN1(sinpi, __builtin_sinf(x * 3.14159265358979323846f))
BNB_EMU_FN1(sqrt, __builtin_sqrtf(x))
BNB_EMU_FN1(tan, __builtin_tanf(x))
BNB_EMU_FN1(tanh, __builtin_tanhf(x))
BNB_EMU_FN1(tanpi, __builtin_tanf(x * 3.14159265358979323846f))
BNB_EMU_FN1(trunc, __builtin_truncf(x))
BNB_EMU_FN1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
BNB_EMU_FN1(sign, x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x == x ? x : 0.0f)
BNB_EMU_FN1(erf, __builtin_erff(x))

BNB_EMU_FN2(atan2, __builtin_atan2f(x, y))
BNB_EMU_FN2(copysign, __builtin_copysignf(x, y))
BNB_EMU_FN2(divide, x / y)
BNB_EMU_FN2(fdim, __builtin_fdimf(x, y))
BNB_EMU_FN2(fmax, __builtin_fmaxf(x, y))
BNB_EMU_FN2(fmin, __builtin_fminf(x, y))
BNB_EMU_FN2(fmod, __builtin_fmodf(x, y))
BNB_EMU_FN2(hypot, __builtin_hypotf(x, y))
BNB_EMU_FN2(nextafter, __builtin_nextafterf(x, y))
BNB_EMU_FN2(pow, __builtin_powf(x, y))
BNB_EMU_FN2(powr, __builtin_powf(x, y))
BNB_EMU_FN2(step, y < x ? 0.0f : 1.0f)

BNB_EMU_FN3(fma, __builtin_fmaf(x, y, z))
BNB_EMU_FN3(mix, x + (y - x) * z)
BNB_EMU_FN3(smoothstep, ([](float e0, float e1, float v) {
              float t = __builtin_fminf(__builtin_fmaxf((v - e0) / (e1 - e0), 0.0f), 1.0f);
              return t * t * (3.0f - 2.0f * t);
            })(x, y, z))
#undef BNB_EMU_FN1
#undef BNB_EMU_FN2
#undef BNB_EMU_FN3

inline float ldexp(float x, int k) { return __builtin_ldexpf(x, k); }
inline half ldexp(half x, int k) { return half(__builtin_ldexpf(float(x), k)); }
inline float frexp(float x, int& e) { return __builtin_frexpf(x, &e); }
inline half frexp(half x, int& e) { return half(__builtin_frexpf(float(x), &e)); }
inline float modf(float x, float& i) { return __builtin_modff(x, &i); }
inline float sincos(float x, float& c) {
  c = __builtin_cosf(x);
  return __builtin_sinf(x);
}

// --- min / max / clamp / abs: floats (fmin/fmax semantics) and integers ------------------------

#define BNB_EMU_MINMAX(T)                                                                           \
  inline T min(T a, T b) { return b < a ? b : a; }                                                  \
  inline T max(T a, T b) { return a < b ? b : a; }                                                  \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
BNB_EMU_MINMAX(char)
BNB_EMU_MINMAX(signed char)
BNB_EMU_MINMAX(uchar)
BNB_EMU_MINMAX(short)
BNB_EMU_MINMAX(ushort)
BNB_EMU_MINMAX(int)
BNB_EMU_MINMAX(uint)
BNB_EMU_MINMAX(long)
BNB_EMU_MINMAX(ulong)
#undef BNB_EMU_MINMAX
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float clamp(float x, float lo, float hi) { return __builtin_fminf(__builtin_fmaxf(x, lo), hi); }
inline half min(half a, half b) { return half(__builtin_fminf(float(a), float(b))); }
inline half max(half a, half b) { return half(__builtin_fmaxf(float(a), float(b))); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }
inline bfloat min(bfloat a, bfloat b) { return bfloat(__builtin_fminf(float(a), float(b))); }
inline bfloat max(bfloat a, bfloat b) { return bfloat(__builtin_fmaxf(float(a), float(b))); }
template <class A, class B, std::enable_if_t<emu::any_vec<A, B>, int> = 0>
inline auto min(const A& a, const B& b) {
  return emu::vmap([](auto x, auto y) { return min(x, y); }, a, b);
}
template <class A, class B, std::enable_if_t<emu::any_vec<A, B>, int> = 0>
inline auto max(const A& a, const B& b) {
  return emu::vmap([](auto x, auto y) { return max(x, y); }, a, b);
}
template <class A, class B, class C, std::enable_if_t<emu::any_vec<A, B, C>, int> = 0>
inline auto clamp(const A& a, const B& b, const C& c) {
  return emu::vmap([](auto x, auto y, auto z) { return clamp(x, y, z); }, a, b, c);
}

inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half(__builtin_fabsf(float(x))); }
inline int abs(int x) { return x < 0 ? int(0u - uint(x)) : x; }
inline long abs(long x) { return x < 0 ? long(0ul - ulong(x)) : x; }
inline short abs(short x) { return short(x < 0 ? -x : x); }
inline char abs(char x) { return char(x < 0 ? -x : x); }
inline uint abs(uint x) { return x; }
inline ulong abs(ulong x) { return x; }
inline ushort abs(ushort x) { return x; }
inline uchar abs(uchar x) { return x; }
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline auto abs(const V& v) {
  return emu::vmap([](auto e) { return abs(e); }, v);
}

// --- integer functions -----------------------------------------------------------------------

namespace emu {
template <class T>
using uint_of = std::make_unsigned_t<T>;
template <class T>
constexpr int bits_of = int(sizeof(T) * 8);
template <class T>
using int_only = std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value, int>;
}  // namespace emu

template <class T, emu::int_only<T> = 0>
inline T popcount(T x) {
  return T(__builtin_popcountll((unsigned long long)(emu::uint_of<T>)x));
}
template <class T, emu::int_only<T> = 0>
inline T clz(T x) {
  auto u = (unsigned long long)(emu::uint_of<T>)x;
  return T(u == 0 ? emu::bits_of<T> : __builtin_clzll(u) - (64 - emu::bits_of<T>));
}
template <class T, emu::int_only<T> = 0>
inline T ctz(T x) {
  auto u = (unsigned long long)(emu::uint_of<T>)x;
  return T(u == 0 ? emu::bits_of<T> : __builtin_ctzll(u));
}
template <class T, emu::int_only<T> = 0>
inline T reverse_bits(T x) {
  emu::uint_of<T> u = emu::uint_of<T>(x), r = 0;
  for (int i = 0; i < emu::bits_of<T>; ++i) r = emu::uint_of<T>((r << 1) | ((u >> i) & 1u));
  return T(r);
}
template <class T, emu::int_only<T> = 0>
inline T rotate(T v, T i) {
  using U = emu::uint_of<T>;
  constexpr int n = emu::bits_of<T>;
  int s = int(U(i) % n);
  U u = U(v);
  return T(s == 0 ? u : U((u << s) | (u >> (n - s))));
}
template <class T, emu::int_only<T> = 0>
inline T extract_bits(T x, uint offset, uint bits) {
  using U = emu::uint_of<T>;
  constexpr uint n = uint(emu::bits_of<T>);
  if (bits == 0) return T(0);
  U u = U(U(x) << (n - offset - bits));
  if (std::is_signed<T>::value) return T(T(u) >> (n - bits));
  return T(u >> (n - bits));
}
template <class T, emu::int_only<T> = 0>
inline T insert_bits(T base, T insert, uint offset, uint bits) {
  using U = emu::uint_of<T>;
  constexpr uint n = uint(emu::bits_of<T>);
  if (bits == 0) return base;
  U mask = U((bits >= n ? ~U(0) : U((U(1) << bits) - 1)) << offset);
  return T((U(base) & U(~mask)) | ((U(insert) << offset) & mask));
}
template <class T, emu::int_only<T> = 0>
inline emu::uint_of<T> absdiff(T a, T b) {
  return a > b ? emu::uint_of<T>(emu::uint_of<T>(a) - emu::uint_of<T>(b))
               : emu::uint_of<T>(emu::uint_of<T>(b) - emu::uint_of<T>(a));
}
template <class T, emu::int_only<T> = 0>
inline T addsat(T a, T b) {
  T r;
  if (__builtin_add_overflow(a, b, &r)) return b > 0 ? std::numeric_limits<T>::max() : std::numeric_limits<T>::min();
  return r;
}
template <class T, emu::int_only<T> = 0>
inline T subsat(T a, T b) {
  T r;
  if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? std::numeric_limits<T>::max() : std::numeric_limits<T>::min();
  return r;
}
template <class T, emu::int_only<T> = 0>
inline T hadd(T a, T b) {
  return T((a >> 1) + (b >> 1) + (a & b & 1));
}
template <class T, emu::int_only<T> = 0>
inline T rhadd(T a, T b) {
  return T((a >> 1) + (b >> 1) + ((a | b) & 1));
}
template <class T, emu::int_only<T> = 0>
inline T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 8) {
    using W = std::conditional_t<std::is_signed<T>::value, __int128, unsigned __int128>;
    return T((W(a) * W(b)) >> 64);
  } else {
    using W = std::conditional_t<std::is_signed<T>::value, long long, unsigned long long>;
    return T((W(a) * W(b)) >> emu::bits_of<T>);
  }
}
template <class T, emu::int_only<T> = 0>
inline T mul24(T a, T b) {
  return T(a * b);
}
template <class T, emu::int_only<T> = 0>
inline T mad24(T a, T b, T c) {
  return T(a * b + c);
}

#define BNB_EMU_INT_VEC1(name)                                                                      \
  template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>                                     \
  inline auto name(const V& v) {                                                                    \
    return emu::vmap([](auto e) { return name(e); }, v);                                            \
  }
#define BNB_EMU_INT_VEC2(name)                                                                      \
  template <class A, class B, std::enable_if_t<emu::any_vec<A, B>, int> = 0>                        \
  inline auto name(const A& a, const B& b) {                                                        \
    return emu::vmap([](auto x, auto y) { return name(x, y); }, a, b);                              \
  }
BNB_EMU_INT_VEC1(popcount)
BNB_EMU_INT_VEC1(clz)
BNB_EMU_INT_VEC1(ctz)
BNB_EMU_INT_VEC1(reverse_bits)
BNB_EMU_INT_VEC2(rotate)
BNB_EMU_INT_VEC2(absdiff)
BNB_EMU_INT_VEC2(addsat)
BNB_EMU_INT_VEC2(subsat)
BNB_EMU_INT_VEC2(hadd)
BNB_EMU_INT_VEC2(rhadd)
BNB_EMU_INT_VEC2(mulhi)
#undef BNB_EMU_INT_VEC1
#undef BNB_EMU_INT_VEC2

// --- relational ------------------------------------------------------------------------------

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool isnormal(float x) { return __builtin_isnormal(x); }
inline bool isnormal(half x) { return __builtin_isnormal(float(x)); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(half x) { return __builtin_signbit(float(x)); }
inline bool isordered(float x, float y) { return x == x && y == y; }
inline bool isunordered(float x, float y) { return !(x == x && y == y); }
#define BNB_EMU_REL_VEC1(name)                                                                      \
  template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>                                     \
  inline auto name(const V& v) {                                                                    \
    return emu::vmap([](auto e) { return name(e); }, v);                                            \
  }
BNB_EMU_REL_VEC1(isnan)
BNB_EMU_REL_VEC1(isinf)
BNB_EMU_REL_VEC1(isfinite)
BNB_EMU_REL_VEC1(isnormal)
BNB_EMU_REL_VEC1(signbit)
#undef BNB_EMU_REL_VEC1

inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline bool all(const V& v) {
  emu::vec_of<V> t(v);
  for (int i = 0; i < emu::vec_info<V>::n; ++i)
    if (!t.d[i]) return false;
  return true;
}
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline bool any(const V& v) {
  emu::vec_of<V> t(v);
  for (int i = 0; i < emu::vec_info<V>::n; ++i)
    if (t.d[i]) return true;
  return false;
}

// select(a, b, c): c ? b : a, per component.
template <class T, std::enable_if_t<emu::is_scalar<T>, int> = 0>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class A, class B, class C, std::enable_if_t<emu::is_vec<A> || emu::is_vec<B>, int> = 0>
inline auto select(const A& a_, const B& b_, const C& c_) {
  const auto& a = emu::operand(a_);
  const auto& b = emu::operand(b_);
  const auto& c = emu::operand(c_);
  using E = emu::first_elem<A, B>;
  constexpr int n = emu::width<A, B>();
  vec<E, n> out;
  for (int i = 0; i < n; ++i) out.d[i] = emu::component(c, i) ? E(emu::component(b, i)) : E(emu::component(a, i));
  return out;
}

// --- geometric -------------------------------------------------------------------------------

template <class A, class B, std::enable_if_t<emu::is_vec<A> && emu::is_vec<B>, int> = 0>
inline auto dot(const A& a, const B& b) {
  using E = typename emu::vec_info<A>::elem;
  emu::vec_of<A> x(a), y(b);
  E s = E(x.d[0] * y.d[0]);
  for (int i = 1; i < emu::vec_info<A>::n; ++i) s = E(s + E(x.d[i] * y.d[i]));
  return s;
}
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline auto length_squared(const V& v) {
  return dot(v, v);
}
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline auto length(const V& v) {
  return sqrt(dot(v, v));
}
template <class A, class B, std::enable_if_t<emu::is_vec<A> && emu::is_vec<B>, int> = 0>
inline auto distance(const A& a, const B& b) {
  return length(emu::vec_of<A>(a) - emu::vec_of<B>(b));
}
template <class V, std::enable_if_t<emu::is_vec<V>, int> = 0>
inline auto normalize(const V& v) {
  return emu::vec_of<V>(v) * rsqrt(dot(v, v));
}
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// --- as_type: reinterpret the bits (sizes must match, as in MSL) ------------------------------

template <class To, class From>
inline To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination must have the same size");
  To to;
  __builtin_memcpy(static_cast<void*>(&to), static_cast<const void*>(&from), sizeof(To));
  return to;
}

// --- metal::precise / metal::fast: same functions, IEEE single precision here ----------------

#define BNB_EMU_MATH_NAMES                                                                          \
  using ::metal::acos;                                                                              \
  using ::metal::acosh;                                                                             \
  using ::metal::asin;                                                                              \
  using ::metal::asinh;                                                                             \
  using ::metal::atan;                                                                              \
  using ::metal::atan2;                                                                             \
  using ::metal::atanh;                                                                             \
  using ::metal::cbrt;                                                                              \
  using ::metal::ceil;                                                                              \
  using ::metal::clamp;                                                                             \
  using ::metal::copysign;                                                                          \
  using ::metal::cos;                                                                               \
  using ::metal::cosh;                                                                              \
  using ::metal::cospi;                                                                             \
  using ::metal::divide;                                                                            \
  using ::metal::exp;                                                                               \
  using ::metal::exp10;                                                                             \
  using ::metal::exp2;                                                                              \
  using ::metal::fabs;                                                                              \
  using ::metal::fdim;                                                                              \
  using ::metal::floor;                                                                             \
  using ::metal::fma;                                                                               \
  using ::metal::fmax;                                                                              \
  using ::metal::fmin;                                                                              \
  using ::metal::fmod;                                                                              \
  using ::metal::fract;                                                                             \
  using ::metal::frexp;                                                                             \
  using ::metal::ldexp;                                                                             \
  using ::metal::log;                                                                               \
  using ::metal::log10;                                                                             \
  using ::metal::log2;                                                                              \
  using ::metal::max;                                                                               \
  using ::metal::min;                                                                               \
  using ::metal::normalize;                                                                         \
  using ::metal::pow;                                                                               \
  using ::metal::powr;                                                                              \
  using ::metal::rint;                                                                              \
  using ::metal::round;                                                                             \
  using ::metal::rsqrt;                                                                             \
  using ::metal::saturate;                                                                          \
  using ::metal::sin;                                                                               \
  using ::metal::sincos;                                                                            \
  using ::metal::sinh;                                                                              \
  using ::metal::sinpi;                                                                             \
  using ::metal::sqrt;                                                                              \
  using ::metal::tan;                                                                               \
  using ::metal::tanh;                                                                              \
  using ::metal::tanpi;                                                                             \
  using ::metal::trunc;                                                                             \
  using ::metal::length;                                                                            \
  using ::metal::distance;
namespace precise {
BNB_EMU_MATH_NAMES
}
namespace fast {
BNB_EMU_MATH_NAMES
}
#undef BNB_EMU_MATH_NAMES

// --- numeric limits and constants --------------------------------------------------------------

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half denorm_min() { return half(5.9604644775390625e-08f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr int digits = 8;
  static bfloat max() { return as_type<bfloat>(uint16_t(0x7F7F)); }
  static bfloat lowest() { return as_type<bfloat>(uint16_t(0xFF7F)); }
  static bfloat min() { return as_type<bfloat>(uint16_t(0x0080)); }
  static bfloat epsilon() { return as_type<bfloat>(uint16_t(0x3C00)); }
  static bfloat infinity() { return as_type<bfloat>(uint16_t(0x7F80)); }
  static bfloat quiet_NaN() { return as_type<bfloat>(uint16_t(0x7FC0)); }
};

using std::conditional;
using std::enable_if;
using std::enable_if_t;
using std::integral_constant;
using std::is_floating_point;
using std::is_integral;
using std::is_same;
using std::is_signed;
using std::is_unsigned;
using std::make_signed;
using std::make_unsigned;
using std::remove_const;
using std::remove_cv;
using std::remove_reference;
template <class A, class B>
constexpr bool is_same_v = std::is_same<A, B>::value;
template <class T>
constexpr bool is_integral_v = std::is_integral<T>::value;
template <class T>
constexpr bool is_floating_point_v = std::is_floating_point<T>::value || std::is_same<T, half>::value || std::is_same<T, bfloat>::value;

}  // namespace metal

#ifndef MAXFLOAT
#define MAXFLOAT 0x1.fffffep+127f
#endif
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
#ifndef HUGE_VALF
#define HUGE_VALF __builtin_inff()
#endif
#ifndef FLT_MAX
#define FLT_MAX 0x1.fffffep+127f
#endif
#ifndef FLT_MIN
#define FLT_MIN 0x1p-126f
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 0x1p-23f
#endif
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_LOG2E_F 1.44269504088896340736f
#define M_SQRT2_F 1.41421356237309504880f
#define M_1_SQRT2_F 0.707106781186547524401f
#ifndef INT_MAX
#define INT_MAX 2147483647
#endif
#ifndef INT_MIN
#define INT_MIN (-2147483647 - 1)
#endif
#ifndef UINT_MAX
#define UINT_MAX 4294967295u
#endif
#ifndef CHAR_BIT
#define CHAR_BIT 8
#endif
