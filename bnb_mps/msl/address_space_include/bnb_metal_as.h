// The Metal standard library as the address-space check (bnb_mps.msl.address_space) sees it.
//
// The check compiles kernels with clang as C++ for OpenCL (-cl-std=clc++2021), where address
// spaces are distinct, checked qualifiers: Metal's `device`, `constant`, `threadgroup` and
// `thread` become OpenCL's `__global`, `__constant`, `__local` and `__private`. Passing a pointer
// or binding a reference across address spaces, casting between them, or writing through a
// `constant` pointer is then a compile error, as it is for the Metal compiler. (The emulator's
// C++ erases address spaces, so it cannot see these mistakes.)
//
// This header declares the part of the Metal standard library that the project's kernels use;
// most functions are declared, not defined (the check only parses, it never generates code), and
// scalar/vector maths is deliberately lenient about types: this header exists to check address
// spaces, not overload resolution. Functions whose Metal signatures name address spaces
// (simdgroup_load/store, atomics, frexp/modf/sincos) are declared with exactly those.
// A kernel that uses something missing here gets a clear "not declared by the check's Metal
// headers" finding: add the declaration below.
#pragma once
#pragma OPENCL EXTENSION cl_khr_fp16 : enable

// --- keywords ------------------------------------------------------------------------------------
#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private
// `kernel` and `[[kernel]]` both vanish (an empty [[]] is valid): kernels are checked as ordinary
// functions, because OpenCL's own kernel rules (no templates, no references) are not Metal's.
#define kernel
#define METAL_FUNC inline
// OpenCL keywords that are ordinary identifiers in Metal (a variable named `local` is fine there).
#define local bnb_as_identifier_local
#define global bnb_as_identifier_global
#define generic bnb_as_identifier_generic
#define read_only bnb_as_identifier_read_only
#define write_only bnb_as_identifier_write_only
#define read_write bnb_as_identifier_read_write
#define pipe bnb_as_identifier_pipe
#ifndef __METAL_VERSION__  // (-D__METAL_VERSION__=320 checks the Metal 3.2 spellings)
#define __METAL_VERSION__ 310
#endif
// coherent(device) / coherent(system) (Metal 3.2): a qualifier of the pointee, checked as `volatile`
// is (a coherent pointer does not convert to a plain one); undefined below 3.2, where Metal has none.
#if __METAL_VERSION__ >= 320
#define coherent(scope) volatile
#endif
#define __HAVE_BFLOAT__ 1
#define __METAL_BNB_ADDRESS_SPACE_CHECK__ 1

// --- scalar and vector types ---------------------------------------------------------------------
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef ulong size_t;
typedef long ptrdiff_t;
// Metal's bfloat: a 16-bit float type distinct from half (OpenCL's builtin half).
typedef _Float16 bfloat;

namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}  // namespace metal
using metal::vec;

#define BNB_AS_VECTORS(T) \
  typedef vec<T, 2> T##2; \
  typedef vec<T, 3> T##3; \
  typedef vec<T, 4> T##4;
BNB_AS_VECTORS(char)
BNB_AS_VECTORS(uchar)
BNB_AS_VECTORS(short)
BNB_AS_VECTORS(ushort)
BNB_AS_VECTORS(int)
BNB_AS_VECTORS(uint)
BNB_AS_VECTORS(long)
BNB_AS_VECTORS(ulong)
BNB_AS_VECTORS(half)
BNB_AS_VECTORS(bfloat)
BNB_AS_VECTORS(float)
#undef BNB_AS_VECTORS
// Packed vectors: modelled as plain vectors (their sizeof differs for 3 components; the check does
// not evaluate layouts).
#define BNB_AS_PACKED(T)                  \
  typedef vec<T, 2> packed_##T##2;        \
  typedef vec<T, 3> packed_##T##3;        \
  typedef vec<T, 4> packed_##T##4;
BNB_AS_PACKED(char)
BNB_AS_PACKED(uchar)
BNB_AS_PACKED(short)
BNB_AS_PACKED(ushort)
BNB_AS_PACKED(int)
BNB_AS_PACKED(uint)
BNB_AS_PACKED(half)
BNB_AS_PACKED(bfloat)
BNB_AS_PACKED(float)
#undef BNB_AS_PACKED

namespace metal {
namespace bnb_as {

// Component count and element type of a scalar (1) or vector type.
template <class V>
struct vinfo {
  static constexpr int n = 1;
  typedef V elem;
};
#define BNB_AS_VINFO(T)                  \
  template <>                            \
  struct vinfo<vec<T, 2>> {              \
    static constexpr int n = 2;          \
    typedef T elem;                      \
  };                                     \
  template <>                            \
  struct vinfo<vec<T, 3>> {              \
    static constexpr int n = 3;          \
    typedef T elem;                      \
  };                                     \
  template <>                            \
  struct vinfo<vec<T, 4>> {              \
    static constexpr int n = 4;          \
    typedef T elem;                      \
  };
BNB_AS_VINFO(char)
BNB_AS_VINFO(uchar)
BNB_AS_VINFO(short)
BNB_AS_VINFO(ushort)
BNB_AS_VINFO(int)
BNB_AS_VINFO(uint)
BNB_AS_VINFO(long)
BNB_AS_VINFO(ulong)
BNB_AS_VINFO(half)
BNB_AS_VINFO(bfloat)
BNB_AS_VINFO(float)
#undef BNB_AS_VINFO

template <class V, class A>
inline void put(thread V& r, thread int& i, A a) {
  if constexpr (vinfo<A>::n == 1) {
    r[i++] = (typename vinfo<V>::elem)a;
  } else {
    for (int k = 0; k < vinfo<A>::n; ++k) r[i++] = (typename vinfo<V>::elem)a[k];
  }
}

// Metal's vector constructors, `float4(a, b, c, d)`, `float4(x)`, `uchar4(h4)`: the check's
// pre-pass spells them `::metal::bnb_as::make_vec<float4>(...)` (clang's vectors have no
// multi-argument constructors).
template <class V, class A>
inline V make_vec(A a) {
  static_assert(vinfo<V>::n > 1, "make_vec: not a vector type");
  if constexpr (vinfo<A>::n == 1) {
    return (V)((typename vinfo<V>::elem)a);
  } else {
    static_assert(vinfo<A>::n == vinfo<V>::n, "vector conversion between different lengths");
    return __builtin_convertvector(a, V);
  }
}
template <class V, class A, class B, class... C>
inline V make_vec(A a, B b, C... c) {
  static_assert(vinfo<A>::n + vinfo<B>::n + (0 + ... + vinfo<C>::n) == vinfo<V>::n,
                "vector constructor: the components do not add up to the vector's length");
  V r;
  int i = 0;
  put(r, i, a);
  put(r, i, b);
  (put(r, i, c), ...);
  return r;
}

// Result type of a lenient binary maths function: the vector operand's type, else the usual
// arithmetic conversions.
template <class A, class B, bool AV = (vinfo<A>::n > 1), bool BV = (vinfo<B>::n > 1)>
struct common {
  typedef decltype(true ? A() : B()) type;
};
template <class A, class B, bool BV>
struct common<A, B, true, BV> {
  typedef A type;
};
template <class A, class B>
struct common<A, B, false, true> {
  typedef B type;
};
template <class A, class B>
using common_t = typename common<A, B>::type;

}  // namespace bnb_as

// --- type traits ---------------------------------------------------------------------------------
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  typedef T value_type;
  constexpr operator T() const { return v; }
};
typedef integral_constant<bool, true> true_type;
typedef integral_constant<bool, false> false_type;
template <class A, class B>
struct is_same : false_type {};
template <class A>
struct is_same<A, A> : true_type {};
template <class A, class B>
constexpr bool is_same_v = is_same<A, B>::value;
template <bool C, class T = void>
struct enable_if {};
template <class T>
struct enable_if<true, T> {
  typedef T type;
};
template <bool C, class T = void>
using enable_if_t = typename enable_if<C, T>::type;
template <bool C, class A, class B>
struct conditional {
  typedef A type;
};
template <class A, class B>
struct conditional<false, A, B> {
  typedef B type;
};
template <bool C, class A, class B>
using conditional_t = typename conditional<C, A, B>::type;
template <class T>
struct remove_const {
  typedef T type;
};
template <class T>
struct remove_const<const T> {
  typedef T type;
};
template <class T>
struct remove_volatile {
  typedef T type;
};
template <class T>
struct remove_volatile<volatile T> {
  typedef T type;
};
template <class T>
struct remove_cv {
  typedef typename remove_volatile<typename remove_const<T>::type>::type type;
};
template <class T>
using remove_cv_t = typename remove_cv<T>::type;
template <class T>
struct remove_reference {
  typedef T type;
};
template <class T>
struct remove_reference<T&> {
  typedef T type;
};
template <class T>
using remove_reference_t = typename remove_reference<T>::type;
template <class T>
struct is_floating_point
    : integral_constant<bool, is_same<T, float>::value || is_same<T, half>::value || is_same<T, bfloat>::value> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_integral
    : integral_constant<bool, is_same<T, bool>::value || is_same<T, char>::value || is_same<T, uchar>::value ||
                                  is_same<T, short>::value || is_same<T, ushort>::value || is_same<T, int>::value ||
                                  is_same<T, uint>::value || is_same<T, long>::value || is_same<T, ulong>::value> {};
template <class T>
constexpr bool is_integral_v = is_integral<T>::value;
template <class T>
struct is_signed : integral_constant<bool, (T(-1) < T(0))> {};
template <class T>
struct is_unsigned : integral_constant<bool, !(T(-1) < T(0))> {};
template <class T>
struct is_scalar : integral_constant<bool, is_integral<T>::value || is_floating_point<T>::value> {};
template <class T>
struct is_vector : integral_constant<bool, (bnb_as::vinfo<T>::n > 1)> {};
template <class T>
constexpr bool is_vector_v = is_vector<T>::value;
template <class T>
struct make_unsigned;
template <>
struct make_unsigned<char> {
  typedef uchar type;
};
template <>
struct make_unsigned<uchar> {
  typedef uchar type;
};
template <>
struct make_unsigned<short> {
  typedef ushort type;
};
template <>
struct make_unsigned<ushort> {
  typedef ushort type;
};
template <>
struct make_unsigned<int> {
  typedef uint type;
};
template <>
struct make_unsigned<uint> {
  typedef uint type;
};
template <>
struct make_unsigned<long> {
  typedef ulong type;
};
template <>
struct make_unsigned<ulong> {
  typedef ulong type;
};
template <class T>
struct make_signed;
template <>
struct make_signed<char> {
  typedef char type;
};
template <>
struct make_signed<uchar> {
  typedef char type;
};
template <>
struct make_signed<short> {
  typedef short type;
};
template <>
struct make_signed<ushort> {
  typedef short type;
};
template <>
struct make_signed<int> {
  typedef int type;
};
template <>
struct make_signed<uint> {
  typedef int type;
};
template <>
struct make_signed<long> {
  typedef long type;
};
template <>
struct make_signed<ulong> {
  typedef long type;
};

// --- numeric limits ------------------------------------------------------------------------------
template <class T>
struct numeric_limits;
#define BNB_AS_LIMITS(T, MIN, MAX, LOWEST, EPS, INF, NANV, SIGNED, DIGITS) \
  template <>                                                           \
  struct numeric_limits<T> {                                            \
    static constexpr bool is_specialized = true;                        \
    static constexpr bool is_signed = SIGNED;                           \
    static constexpr int digits = DIGITS;                               \
    static constexpr T min() { return MIN; }                            \
    static constexpr T max() { return MAX; }                            \
    static constexpr T lowest() { return LOWEST; }                      \
    static constexpr T epsilon() { return EPS; }                        \
    static constexpr T infinity() { return INF; }                       \
    static constexpr T quiet_NaN() { return NANV; }                     \
  };
BNB_AS_LIMITS(float, __FLT_MIN__, __FLT_MAX__, -__FLT_MAX__, __FLT_EPSILON__, __builtin_inff(), __builtin_nanf(""),
              true, 24)
BNB_AS_LIMITS(half, (half)6.103515625e-05f, (half)65504.0f, (half)-65504.0f, (half)0.0009765625f,
              (half)__builtin_inff(), (half)__builtin_nanf(""), true, 11)
BNB_AS_LIMITS(bfloat, (bfloat)1.17549435e-38f, (bfloat)3.38953139e38f, (bfloat)-3.38953139e38f, (bfloat)0.0078125f,
              (bfloat)__builtin_inff(), (bfloat)__builtin_nanf(""), true, 8)
BNB_AS_LIMITS(char, (char)-128, (char)127, (char)-128, 0, 0, 0, true, 7)
BNB_AS_LIMITS(uchar, 0, 255, 0, 0, 0, 0, false, 8)
BNB_AS_LIMITS(short, -32768, 32767, -32768, 0, 0, 0, true, 15)
BNB_AS_LIMITS(ushort, 0, 65535, 0, 0, 0, 0, false, 16)
BNB_AS_LIMITS(int, -2147483647 - 1, 2147483647, -2147483647 - 1, 0, 0, 0, true, 31)
BNB_AS_LIMITS(uint, 0u, 4294967295u, 0u, 0u, 0u, 0u, false, 32)
BNB_AS_LIMITS(long, -9223372036854775807l - 1, 9223372036854775807l, -9223372036854775807l - 1, 0, 0, 0, true, 63)
BNB_AS_LIMITS(ulong, 0ul, 18446744073709551615ul, 0ul, 0ul, 0ul, 0ul, false, 64)
#undef BNB_AS_LIMITS

// --- reinterpretation ----------------------------------------------------------------------------
template <class To, class From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination must have the same size");
  return __builtin_bit_cast(To, x);
}

// --- maths (lenient about types; see the top of this file) ---------------------------------------
#define BNB_AS_UNARY(name) \
  template <class T>       \
  T name(T x);
#define BNB_AS_BINARY(name) \
  template <class A, class B> \
  bnb_as::common_t<A, B> name(A a, B b);
#define BNB_AS_TERNARY(name)       \
  template <class A, class B, class C> \
  bnb_as::common_t<bnb_as::common_t<A, B>, C> name(A a, B b, C c);
#define BNB_AS_MATH_FUNCTIONS                                                                        \
  BNB_AS_UNARY(acos) BNB_AS_UNARY(acosh) BNB_AS_UNARY(asin) BNB_AS_UNARY(asinh) BNB_AS_UNARY(atan) \
  BNB_AS_UNARY(atanh) BNB_AS_UNARY(cbrt) BNB_AS_UNARY(ceil) BNB_AS_UNARY(cos) BNB_AS_UNARY(cosh)   \
  BNB_AS_UNARY(cospi) BNB_AS_UNARY(exp) BNB_AS_UNARY(exp10) BNB_AS_UNARY(exp2) BNB_AS_UNARY(fabs)  \
  BNB_AS_UNARY(floor) BNB_AS_UNARY(fract) BNB_AS_UNARY(log) BNB_AS_UNARY(log10) BNB_AS_UNARY(log2) \
  BNB_AS_UNARY(rint) BNB_AS_UNARY(round) BNB_AS_UNARY(rsqrt) BNB_AS_UNARY(saturate)               \
  BNB_AS_UNARY(sin) BNB_AS_UNARY(sinh) BNB_AS_UNARY(sinpi) BNB_AS_UNARY(sqrt) BNB_AS_UNARY(tan)    \
  BNB_AS_UNARY(tanh) BNB_AS_UNARY(tanpi) BNB_AS_UNARY(trunc) BNB_AS_UNARY(normalize)              \
  BNB_AS_BINARY(atan2) BNB_AS_BINARY(copysign) BNB_AS_BINARY(divide) BNB_AS_BINARY(fdim)           \
  BNB_AS_BINARY(fmax) BNB_AS_BINARY(fmin) BNB_AS_BINARY(fmod) BNB_AS_BINARY(max) BNB_AS_BINARY(min) \
  BNB_AS_BINARY(pow) BNB_AS_BINARY(powr) BNB_AS_BINARY(nextafter) BNB_AS_TERNARY(clamp)           \
  BNB_AS_TERNARY(fma) BNB_AS_TERNARY(mix) BNB_AS_TERNARY(max3) BNB_AS_TERNARY(min3)               \
  BNB_AS_TERNARY(median3) BNB_AS_TERNARY(smoothstep) BNB_AS_BINARY(step)                           \
  template <class T> auto length(T x) -> typename bnb_as::vinfo<T>::elem;                            \
  template <class A, class B> auto distance(A a, B b) -> typename bnb_as::vinfo<A>::elem;           \
  template <class T> T ldexp(T x, int k);                                                           \
  template <class T> T frexp(T x, thread int& exponent);                                            \
  template <class T> T modf(T x, thread T& intval);                                                 \
  template <class T> T sincos(T x, thread T& cosval);
BNB_AS_MATH_FUNCTIONS
namespace precise {
BNB_AS_MATH_FUNCTIONS
}
namespace fast {
BNB_AS_MATH_FUNCTIONS
}
#undef BNB_AS_MATH_FUNCTIONS

BNB_AS_UNARY(abs)
BNB_AS_UNARY(sign)
BNB_AS_UNARY(popcount)
BNB_AS_UNARY(clz)
BNB_AS_UNARY(ctz)
BNB_AS_UNARY(reverse_bits)
BNB_AS_BINARY(absdiff)
BNB_AS_BINARY(addsat)
BNB_AS_BINARY(subsat)
BNB_AS_BINARY(hadd)
BNB_AS_BINARY(rhadd)
BNB_AS_BINARY(mulhi)
BNB_AS_BINARY(mul24)
BNB_AS_BINARY(rotate)
BNB_AS_TERNARY(mad24)
template <class T>
T extract_bits(T x, uint offset, uint bits);
template <class T>
T insert_bits(T base, T insert, uint offset, uint bits);
template <class A, class B>
auto dot(A a, B b) -> typename bnb_as::vinfo<A>::elem;
template <class T>
T cross(T a, T b);

// Relational functions: bool for scalars (vector results are not modelled).
template <class T>
bool isnan(T x);
template <class T>
bool isinf(T x);
template <class T>
bool isfinite(T x);
template <class T>
bool isnormal(T x);
template <class T>
bool signbit(T x);
template <class A, class B>
bool isordered(A a, B b);
template <class A, class B>
bool isunordered(A a, B b);
template <class T>
bool all(T x);
template <class T>
bool any(T x);
template <class A, class B, class C>
A select(A a, B b, C c);
#undef BNB_AS_UNARY
#undef BNB_AS_BINARY
#undef BNB_AS_TERNARY

// --- synchronisation -----------------------------------------------------------------------------
enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint(a) & uint(b)); }
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
void atomic_thread_fence(mem_flags flags, memory_order order, thread_scope scope = thread_scope_device);

// --- SIMD-group functions ------------------------------------------------------------------------
#define BNB_AS_SIMD1(name) \
  template <class T>       \
  T name(T x);
#define BNB_AS_SIMD2(name) \
  template <class T>       \
  T name(T x, ushort lane);
BNB_AS_SIMD1(simd_sum)
BNB_AS_SIMD1(simd_product)
BNB_AS_SIMD1(simd_min)
BNB_AS_SIMD1(simd_max)
BNB_AS_SIMD1(simd_and)
BNB_AS_SIMD1(simd_or)
BNB_AS_SIMD1(simd_xor)
BNB_AS_SIMD1(simd_prefix_inclusive_sum)
BNB_AS_SIMD1(simd_prefix_exclusive_sum)
BNB_AS_SIMD1(simd_prefix_inclusive_product)
BNB_AS_SIMD1(simd_prefix_exclusive_product)
BNB_AS_SIMD1(simd_broadcast_first)
BNB_AS_SIMD2(simd_shuffle)
BNB_AS_SIMD2(simd_shuffle_up)
BNB_AS_SIMD2(simd_shuffle_down)
BNB_AS_SIMD2(simd_shuffle_xor)
BNB_AS_SIMD2(simd_shuffle_rotate_up)
BNB_AS_SIMD2(simd_shuffle_rotate_down)
BNB_AS_SIMD2(simd_broadcast)
BNB_AS_SIMD1(quad_sum)
BNB_AS_SIMD1(quad_min)
BNB_AS_SIMD1(quad_max)
BNB_AS_SIMD1(quad_broadcast_first)
BNB_AS_SIMD2(quad_shuffle)
BNB_AS_SIMD2(quad_shuffle_up)
BNB_AS_SIMD2(quad_shuffle_down)
BNB_AS_SIMD2(quad_shuffle_xor)
BNB_AS_SIMD2(quad_broadcast)
#undef BNB_AS_SIMD1
#undef BNB_AS_SIMD2
struct simd_vote {
  typedef ulong vote_t;
  explicit constexpr simd_vote(vote_t v = 0) : v(v) {}
  explicit constexpr operator vote_t() const { return v; }
  bool all() const;
  bool any() const;
  vote_t v;
};
simd_vote simd_ballot(bool predicate);
simd_vote simd_active_threads_mask();
bool simd_any(bool predicate);
bool simd_all(bool predicate);
bool simd_is_first();

// --- simdgroup matrices ----------------------------------------------------------------------------
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  simdgroup_matrix();
  explicit simdgroup_matrix(T diagonal);
  thread vec<T, 2>& thread_elements();
  const thread vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value);
// Metal loads and stores simdgroup matrices from and to device and threadgroup memory only.
template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const device T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const threadgroup T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(const thread simdgroup_matrix<T, Cols, Rows>& a, device T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(const thread simdgroup_matrix<T, Cols, Rows>& a, threadgroup T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class TD, class TA, class TB, class TC, int M, int N, int K>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, N, M>& d, const thread simdgroup_matrix<TA, K, M>& a,
                                   const thread simdgroup_matrix<TB, N, K>& b,
                                   const thread simdgroup_matrix<TC, N, M>& c);
template <class TD, class TA, class TB, int M, int N, int K>
void simdgroup_multiply(thread simdgroup_matrix<TD, N, M>& d, const thread simdgroup_matrix<TA, K, M>& a,
                        const thread simdgroup_matrix<TB, N, K>& b);

// --- atomics: objects in device or threadgroup memory only ------------------------------------------
// C++ for OpenCL predeclares atomic_int, atomic_uint, atomic_float, atomic_long and atomic_ulong
// at global scope, with Metal's names: the atomic functions take those (and nothing else).
namespace bnb_as {
template <class A>
struct atomic_value;
template <>
struct atomic_value<::atomic_int> {
  typedef int type;
};
template <>
struct atomic_value<::atomic_uint> {
  typedef uint type;
};
template <>
struct atomic_value<::atomic_float> {
  typedef float type;
};
template <>
struct atomic_value<::atomic_long> {
  typedef long type;
};
template <>
struct atomic_value<::atomic_ulong> {
  typedef ulong type;
};
template <class A>
using atomic_value_t = typename atomic_value<typename remove_cv<A>::type>::type;
}  // namespace bnb_as

#define BNB_AS_ATOMICS(AS, CV)                                                                          \
  template <class A, class U>                                                                          \
  void atomic_store_explicit(CV AS A* object, U desired, memory_order order);                          \
  template <class A>                                                                                   \
  bnb_as::atomic_value_t<A> atomic_load_explicit(const CV AS A* object, memory_order order);           \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_exchange_explicit(CV AS A* object, U desired, memory_order order);  \
  template <class A, class U>                                                                          \
  bool atomic_compare_exchange_weak_explicit(CV AS A* object, thread bnb_as::atomic_value_t<A>* expected, \
                                             U desired, memory_order success, memory_order failure);   \
  template <class A, class U>                                                                          \
  bool atomic_compare_exchange_strong_explicit(CV AS A* object, thread bnb_as::atomic_value_t<A>* expected, \
                                               U desired, memory_order success, memory_order failure); \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_add_explicit(CV AS A* object, U operand, memory_order order);  \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_sub_explicit(CV AS A* object, U operand, memory_order order);  \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_and_explicit(CV AS A* object, U operand, memory_order order);  \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_or_explicit(CV AS A* object, U operand, memory_order order);   \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_xor_explicit(CV AS A* object, U operand, memory_order order);  \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_min_explicit(CV AS A* object, U operand, memory_order order);  \
  template <class A, class U>                                                                          \
  bnb_as::atomic_value_t<A> atomic_fetch_max_explicit(CV AS A* object, U operand, memory_order order);
BNB_AS_ATOMICS(device, volatile)
BNB_AS_ATOMICS(threadgroup, volatile)
#undef BNB_AS_ATOMICS

// --- threadgroup storage -----------------------------------------------------------------------------
namespace bnb_as {
// `threadgroup T name[N];` inside a function is rewritten by the pre-pass to a reference bound to
// this (OpenCL only allows __local variables in OpenCL kernels, which Metal kernels are not here).
template <class T>
threadgroup T& threadgroup_variable();
}  // namespace bnb_as

}  // namespace metal

// --- constants ---------------------------------------------------------------------------------------
#define MAXFLOAT __FLT_MAX__
#define HUGE_VALF __builtin_inff()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
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
#define CHAR_BIT 8
#define SCHAR_MAX 127
#define SCHAR_MIN (-128)
#define UCHAR_MAX 255
#define SHRT_MAX 32767
#define SHRT_MIN (-32768)
#define USHRT_MAX 65535
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define LONG_MAX 9223372036854775807l
#define LONG_MIN (-9223372036854775807l - 1)
#define ULONG_MAX 18446744073709551615ul
