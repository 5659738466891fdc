// Optimizer updates (docs/semantics.md section 5): the 8-bit blockwise state kernel and the 32-bit state
// kernel, one template each over the parameter dtype T and the optimizer OPT.
//
// Both are memory-bound: each lane takes a contiguous run of 8 elements (vector loads and stores
// where the op layer says a buffer is aligned, scalar ones otherwise and at the tail), and the
// grid is capped, so a threadgroup loops over its share of the tensor.
//   - 8-bit: one simdgroup per 256-element state block, 8 simdgroups per threadgroup. The codes
//     and thresholds of qmap1 / qmap2 live in threadgroup memory, built once per threadgroup;
//     a block's new absmax is one simd_max (the block is exactly one simdgroup); the parameter,
//     the codes and the absmax are written in the same pass.
//   - 32-bit: a threadgroup of 256 lanes covers 2048 consecutive elements per iteration. With
//     update-norm clipping the op layer launches the NORM instantiation first (per-threadgroup
//     partial sums of u^2, in a fixed order) and then the update, which adds the partials up.
#pragma once

#include "bnb_common.h"
#include "quantize_8bit.h"

// OPT: what the update computes. bitsandbytes' "lamb" runs as ADAM and "lars" as MOMENTUM (both
// with the update-norm clipping of the 32-bit op).
#define BNB_OPTIM_ADAM 0u
#define BNB_OPTIM_ADEMAMIX 1u
#define BNB_OPTIM_MOMENTUM 2u
#define BNB_OPTIM_RMSPROP 3u
#define BNB_OPTIM_ADAGRAD 4u
#define BNB_OPTIM_LION 5u

// Bits of the `flags` argument. VEC_*: the buffer may be accessed with vector loads and stores
// (its start is aligned to one vector: 4 elements of its type); the op layer decides from the
// tensors' byte offsets. M2 is the second half of state1 (AdEMAMix), which starts n elements in.
#define BNB_OPTIM_VEC_G 1u
#define BNB_OPTIM_VEC_P 2u
#define BNB_OPTIM_VEC_S1 4u
#define BNB_OPTIM_VEC_S2 8u
#define BNB_OPTIM_VEC_M2 16u
#define BNB_OPTIM_FIRST_STEP 32u  // step == 1 (momentum takes m = g')
#define BNB_OPTIM_SKIP_ZEROS 64u
#define BNB_OPTIM_CLIP 128u  // 32-bit update: scale the step by the update-norm clipping factor

#define BNB_OPTIM_THREADS 256u  // threads per threadgroup, both kernels
#define BNB_OPTIM_PER_LANE 8u  // consecutive elements per lane
#define BNB_OPTIM_BLOCK 256u  // 8-bit state block (one simdgroup)
#define BNB_OPTIM_SIMDS 8  // simdgroups per threadgroup (a plain literal: threadgroup array size)

// Hyperparameters, as float32 (bc1, bc2 and decay are computed by the op layer in float32:
// bc1 = 1 - beta1^step, bc2 = sqrt(1 - beta2^step), decay = 1 - lr * weight_decay).
struct bnb_optim_hyper {
    float beta1;
    float beta2;
    float beta3;
    float alpha;
    float eps;
    float bc1;
    float bc2;
    float decay;
    float weight_decay;
    float gnorm_scale;
    bool first_step;
};

// Finite (not NaN, not +-inf), on the bit pattern.
inline bool bnb_is_finite(float x) {
    return (as_type<uint>(x) & 0x7f800000u) != 0x7f800000u;
}

// x > 0 for a non-NaN x (false for +-0 and NaN), on the bit pattern.
inline bool bnb_is_positive(float x) {
    const uint b = as_type<uint>(x);
    return (b >> 31) == 0u && b != 0u && b <= 0x7f800000u;
}

// sign(x): -1, 0 or 1; 0 for +-0 and for NaN (as CUDA's (0 < x) - (x < 0)).
inline float bnb_sign(float x) {
    if (bnb_is_positive(x)) {
        return 1.0f;
    }
    return bnb_is_positive(-x) ? -1.0f : 0.0f;
}

// One element's update (docs/semantics.md 5.1 / 5.2 formulas, float32, in the order docs/semantics.md writes them).
// g is the raw gradient; p, m (state1), v (state2) and m2 (AdEMAMix's second momentum) hold the
// old values and receive the new ones. lr_step is the learning rate of the step (lr, or lr times
// the clipping scale); decoupled weight decay uses h.decay. Returns u, the element's update
// before the learning rate (what the update norm sums the squares of).
template <uint OPT>
inline float bnb_optim_element(float g, thread float& p, thread float& m, thread float& v, thread float& m2,
                               float lr_step, thread const bnb_optim_hyper& h) {
    // One rounding per operation, as docs/semantics.md writes the formulas: no fused multiply-adds here (a
    // contracted beta * m + (1 - beta) * g differs from the float32 reference by up to half an
    // ulp of the product, which is many ulps of m where the two terms nearly cancel). bnb_math_mode.h
    // turns contraction off for every kernel, at every Metal language version.
    const float gs = g * h.gnorm_scale;
    float u = 0.0f;
    if (OPT == BNB_OPTIM_ADAM || OPT == BNB_OPTIM_ADEMAMIX) {
        m = h.beta1 * m + (1.0f - h.beta1) * gs;
        v = h.beta2 * v + (1.0f - h.beta2) * gs * gs;
        float num = metal::precise::divide(m, h.bc1);
        if (OPT == BNB_OPTIM_ADEMAMIX) {
            m2 = h.beta3 * m2 + (1.0f - h.beta3) * gs;
            num = num + h.alpha * m2;
        }
        const float den = metal::precise::divide(metal::precise::sqrt(v), h.bc2) + h.eps;
        u = metal::precise::divide(num, den);
        p = p - metal::precise::divide(lr_step * num, den);
        if (h.weight_decay > 0.0f) {
            p = p * h.decay;  // decoupled, after the step
        }
    } else if (OPT == BNB_OPTIM_LION) {
        if (h.weight_decay > 0.0f) {
            p = p * h.decay;  // decoupled, before the step
        }
        u = bnb_sign(h.beta1 * m + (1.0f - h.beta1) * gs);
        m = h.beta2 * m + (1.0f - h.beta2) * gs;
        p = p - lr_step * u;
    } else {
        float gw = gs;
        if (h.weight_decay > 0.0f) {
            gw = gs + h.weight_decay * p;  // coupled (L2)
        }
        if (OPT == BNB_OPTIM_MOMENTUM) {
            m = h.first_step ? gw : h.beta1 * m + gw;
            u = m;
            p = p - lr_step * m;
        } else {
            if (OPT == BNB_OPTIM_RMSPROP) {
                m = h.beta1 * m + (1.0f - h.beta1) * gw * gw;
            } else {  // ADAGRAD
                m = m + gw * gw;
            }
            const float den = metal::precise::sqrt(m) + h.eps;
            u = metal::precise::divide(gw, den);
            p = p - metal::precise::divide(lr_step * gw, den);
        }
    }
    return u;
}

// --- runs of 8 consecutive elements -------------------------------------------------------------

// v[0..8) = src[idx .. idx + 8) as float, 0 past n; idx a multiple of 8. Two 4-element vector
// loads when `vector_ok` and the run is whole, scalar loads otherwise.
template <typename T>
inline void bnb_optim_load8(device const T* src, uint idx, uint n, bool vector_ok, thread float* v) {
    if (vector_ok && idx + 8u <= n) {
        const vec<T, 4> a = *reinterpret_cast<device const vec<T, 4>*>(src + idx);
        const vec<T, 4> b = *reinterpret_cast<device const vec<T, 4>*>(src + idx + 4u);
        for (uint k = 0; k < 4u; ++k) {
            v[k] = float(a[k]);
            v[k + 4u] = float(b[k]);
        }
    } else {
        for (uint k = 0; k < 8u; ++k) {
            v[k] = idx + k < n ? float(src[idx + k]) : 0.0f;
        }
    }
}

// dst[idx .. idx + 8) = T(v[0..8)) for the indices below n (rounded to nearest even).
template <typename T>
inline void bnb_optim_store8(device T* dst, uint idx, uint n, bool vector_ok, thread const float* v) {
    if (vector_ok && idx + 8u <= n) {
        *reinterpret_cast<device vec<T, 4>*>(dst + idx) = vec<T, 4>(T(v[0]), T(v[1]), T(v[2]), T(v[3]));
        *reinterpret_cast<device vec<T, 4>*>(dst + idx + 4u) = vec<T, 4>(T(v[4]), T(v[5]), T(v[6]), T(v[7]));
    } else {
        for (uint k = 0; k < 8u; ++k) {
            if (idx + k < n) {
                dst[idx + k] = T(v[k]);
            }
        }
    }
}

// q[0..8) = src[idx .. idx + 8) (state codes), 0 past n.
inline void bnb_optim_load_codes8(device const uchar* src, uint idx, uint n, bool vector_ok, thread uint* q) {
    if (vector_ok && idx + 8u <= n) {
        const uchar4 a = *reinterpret_cast<device const uchar4*>(src + idx);
        const uchar4 b = *reinterpret_cast<device const uchar4*>(src + idx + 4u);
        for (uint k = 0; k < 4u; ++k) {
            q[k] = a[k];
            q[k + 4u] = b[k];
        }
    } else {
        for (uint k = 0; k < 8u; ++k) {
            q[k] = idx + k < n ? uint(src[idx + k]) : 0u;
        }
    }
}

inline void bnb_optim_store_codes8(device uchar* dst, uint idx, uint n, bool vector_ok, thread const uint* q) {
    if (vector_ok && idx + 8u <= n) {
        *reinterpret_cast<device uchar4*>(dst + idx) = uchar4(uchar(q[0]), uchar(q[1]), uchar(q[2]), uchar(q[3]));
        *reinterpret_cast<device uchar4*>(dst + idx + 4u) = uchar4(uchar(q[4]), uchar(q[5]), uchar(q[6]), uchar(q[7]));
    } else {
        for (uint k = 0; k < 8u; ++k) {
            if (idx + k < n) {
                dst[idx + k] = uchar(q[k]);
            }
        }
    }
}

// --- 8-bit re-quantization ------------------------------------------------------------------------

// q[k] = docs/semantics.md section 2's index of x[k] in a block whose absmax has the bits `amax_bits`
// (bnb_abs_bits of the absmax): the nearest code of fl32(x * fl32(1 / absmax)), ties to the even
// index, NaN to 0. A block whose absmax is 0 gives index 0 directly (no 0 * inf).
// With `signed_state`, then the sign fix (docs/semantics.md 5.1 step 4): when the sign bit of code[q] differs
// from the sign bit of x, q steps one toward x's sign (q + 1 if x > 0, else q - 1, modulo 256). A NaN x
// counts as positive whatever its sign bit (CUDA's arithmetic gives the NaN 0x7fffffff): its index 0 then
// becomes 255, as on CUDA.
inline void bnb_optim_requantize8(thread const float* x, uint amax_bits, threadgroup const float* code,
                                  threadgroup const float* thresholds, bool signed_state, thread uint* q) {
    const bnb_recip rc = bnb_block_recip(amax_bits);
    for (uint k = 0; k < 8u; ++k) {
        uint c = amax_bits == 0u ? 0u : bnb_code_index(bnb_scaled(x[k], rc), thresholds);
        const uint x_sign = bnb_is_nan(x[k]) ? 0u : as_type<uint>(x[k]) >> 31;
        if (signed_state && (as_type<uint>(code[c]) >> 31) != x_sign) {
            c = (bnb_is_positive(x[k]) ? c + 1u : c - 1u) & 0xffu;
        }
        q[k] = c;
    }
}

// --- the kernels ------------------------------------------------------------------------------------

// optimizer_update_8bit_blockwise for one parameter tensor of n elements, in place.
// Launch: BNB_OPTIM_THREADS threads per threadgroup, any number of threadgroups (the op layer
// caps it); simdgroup s of threadgroup t takes the blocks t * 8 + s, then + 8 * threadgroups, ...
// 1-state optimizers bind state1 / qmap1 / absmax1 again for state2 / qmap2 / absmax2 (unused).
// AdEMAMix: m2's codes are state1[n .. 2n), its scales absmax1[absmax_m2 ..].
template <typename T, uint OPT>
[[kernel]] void bnb_optimizer_8bit_blockwise(
    device const T* g [[buffer(0)]],
    device T* p [[buffer(1)]],
    device uchar* state1 [[buffer(2)]],
    device uchar* state2 [[buffer(3)]],
    device const float* qmap1 [[buffer(4)]],
    device const float* qmap2 [[buffer(5)]],
    device float* absmax1 [[buffer(6)]],
    device float* absmax2 [[buffer(7)]],
    constant uint& n [[buffer(8)]],
    constant uint& absmax_m2 [[buffer(9)]],
    constant uint& flags [[buffer(10)]],
    constant float& beta1 [[buffer(11)]],
    constant float& beta2 [[buffer(12)]],
    constant float& beta3 [[buffer(13)]],
    constant float& alpha [[buffer(14)]],
    constant float& eps [[buffer(15)]],
    constant float& lr [[buffer(16)]],
    constant float& bc1 [[buffer(17)]],
    constant float& bc2 [[buffer(18)]],
    constant float& decay [[buffer(19)]],
    constant float& weight_decay [[buffer(20)]],
    constant float& gnorm_scale [[buffer(21)]],
    uint tg [[threadgroup_position_in_grid]],
    uint groups [[threadgroups_per_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    const bool two_states = OPT == BNB_OPTIM_ADAM || OPT == BNB_OPTIM_ADEMAMIX;
    const bool mix = OPT == BNB_OPTIM_ADEMAMIX;
    threadgroup float code1[256];
    threadgroup float thresholds1[256];
    threadgroup float code2[256];
    threadgroup float thresholds2[256];

    for (uint k = tid; k < 256u; k += BNB_OPTIM_THREADS) {
        code1[k] = qmap1[k];
        if (two_states) {
            code2[k] = qmap2[k];
        }
    }
    bnb_load_thresholds(qmap1, thresholds1, tid, BNB_OPTIM_THREADS);
    if (two_states) {
        bnb_load_thresholds(qmap2, thresholds2, tid, BNB_OPTIM_THREADS);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    bnb_optim_hyper h;
    h.beta1 = beta1;
    h.beta2 = beta2;
    h.beta3 = beta3;
    h.alpha = alpha;
    h.eps = eps;
    h.bc1 = bc1;
    h.bc2 = bc2;
    h.decay = decay;
    h.weight_decay = weight_decay;
    h.gnorm_scale = gnorm_scale;
    h.first_step = (flags & BNB_OPTIM_FIRST_STEP) != 0u;
    const bool skip_zeros = (flags & BNB_OPTIM_SKIP_ZEROS) != 0u;
    const bool vec_g = (flags & BNB_OPTIM_VEC_G) != 0u;
    const bool vec_p = (flags & BNB_OPTIM_VEC_P) != 0u;
    const bool vec_s1 = (flags & BNB_OPTIM_VEC_S1) != 0u;
    const bool vec_s2 = (flags & BNB_OPTIM_VEC_S2) != 0u;
    const bool vec_m2 = (flags & BNB_OPTIM_VEC_M2) != 0u;
    device uchar* codes_m2 = state1 + n;

    const uint nblocks = n / BNB_OPTIM_BLOCK + (n % BNB_OPTIM_BLOCK != 0u ? 1u : 0u);
    const uint simds = BNB_OPTIM_THREADS / 32u;
    // The loop condition depends on tg and sg only: uniform over the simdgroup (simd_max inside).
    for (uint b = tg * simds + sg; b < nblocks; b += groups * simds) {
        const uint first = b * BNB_OPTIM_BLOCK + lane * BNB_OPTIM_PER_LANE;
        float gv[8];
        float pv[8];
        float m[8];
        float v[8];
        float m2[8];
        uint q1[8];
        uint q2[8];
        uint q3[8];
        bnb_optim_load8(g, first, n, vec_g, gv);
        bnb_optim_load8(p, first, n, vec_p, pv);
        bnb_optim_load_codes8(state1, first, n, vec_s1, q1);
        const float a1 = absmax1[b];
        float a2 = 0.0f;
        float a3 = 0.0f;
        if (two_states) {
            bnb_optim_load_codes8(state2, first, n, vec_s2, q2);
            a2 = absmax2[b];
        }
        if (mix) {
            bnb_optim_load_codes8(codes_m2, first, n, vec_m2, q3);
            a3 = absmax1[absmax_m2 + b];
        }
        uint bits1 = 0u;
        uint bits2 = 0u;
        uint bits3 = 0u;
        for (uint k = 0; k < 8u; ++k) {
            m[k] = code1[q1[k]] * a1;
            v[k] = two_states ? code2[q2[k]] * a2 : 0.0f;
            m2[k] = mix ? code1[q3[k]] * a3 : 0.0f;
            if (first + k >= n) {
                continue;  // padding: no update, not in the block maxima
            }
            if (two_states) {
                if (bnb_is_finite(gv[k])) {
                    bnb_optim_element<OPT>(gv[k], pv[k], m[k], v[k], m2[k], lr, h);
                } else {  // non-finite gradient: states reset to 0, parameter unchanged
                    m[k] = 0.0f;
                    v[k] = 0.0f;
                    m2[k] = 0.0f;
                }
            } else if (!(skip_zeros && gv[k] == 0.0f)) {
                bnb_optim_element<OPT>(gv[k], pv[k], m[k], v[k], m2[k], lr, h);
            }
            bits1 = max(bits1, bnb_abs_bits(m[k]));
            bits2 = max(bits2, bnb_abs_bits(v[k]));
            bits3 = max(bits3, bnb_abs_bits(m2[k]));
        }
        bits1 = simd_max(bits1);
        if (two_states) {
            bits2 = simd_max(bits2);
        }
        if (mix) {
            bits3 = simd_max(bits3);
        }

        bnb_optim_store8(p, first, n, vec_p, pv);
        bnb_optim_requantize8(m, bits1, code1, thresholds1, true, q1);
        bnb_optim_store_codes8(state1, first, n, vec_s1, q1);
        if (two_states) {
            bnb_optim_requantize8(v, bits2, code2, thresholds2, false, q2);
            bnb_optim_store_codes8(state2, first, n, vec_s2, q2);
        }
        if (mix) {
            bnb_optim_requantize8(m2, bits3, code1, thresholds1, true, q3);
            bnb_optim_store_codes8(codes_m2, first, n, vec_m2, q3);
        }
        if (lane == 0u) {
            absmax1[b] = as_type<float>(bits1);
            if (two_states) {
                absmax2[b] = as_type<float>(bits2);
            }
            if (mix) {
                absmax1[absmax_m2 + b] = as_type<float>(bits3);
            }
        }
    }
}

// optimizer_update_32bit for one parameter tensor of n elements.
// NORM = false: the update, in place. NORM = true: nothing is updated; threadgroup t writes
// partials[t] = the sum of u^2 over the elements it covers (lanes in order, then simd_sum, then
// the simdgroups in order), for the update launch that follows with BNB_OPTIM_CLIP: there every
// threadgroup adds up partials[0 .. groups) (the norm launch must have had the same grid),
// threadgroup 0 stores the total in unorm[0], and the step's learning rate is
// lr * (sqrt(total) > max_norm ? max_norm / sqrt(total) : 1), with max_norm = max_unorm * param_norm.
// Launch: BNB_OPTIM_THREADS threads per threadgroup, any number of threadgroups (the op layer caps
// it); threadgroup t takes the 2048-element chunks t, t + threadgroups, ...
// Buffers not used by a launch (state2 of 1-state optimizers, unorm and partials without
// clipping) are bound to another buffer of the call. AdEMAMix: m2 is state1[n .. 2n).
template <typename T, uint OPT, bool NORM>
[[kernel]] void bnb_optimizer_32bit(
    device const T* g [[buffer(0)]],
    device T* p [[buffer(1)]],
    device float* state1 [[buffer(2)]],
    device float* state2 [[buffer(3)]],
    device float* unorm [[buffer(4)]],
    device float* partials [[buffer(5)]],
    constant uint& n [[buffer(6)]],
    constant uint& flags [[buffer(7)]],
    constant float& beta1 [[buffer(8)]],
    constant float& beta2 [[buffer(9)]],
    constant float& beta3 [[buffer(10)]],
    constant float& alpha [[buffer(11)]],
    constant float& eps [[buffer(12)]],
    constant float& lr [[buffer(13)]],
    constant float& bc1 [[buffer(14)]],
    constant float& bc2 [[buffer(15)]],
    constant float& decay [[buffer(16)]],
    constant float& weight_decay [[buffer(17)]],
    constant float& gnorm_scale [[buffer(18)]],
    constant float& max_norm [[buffer(19)]],
    uint tg [[threadgroup_position_in_grid]],
    uint groups [[threadgroups_per_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
    const bool two_states = OPT == BNB_OPTIM_ADAM || OPT == BNB_OPTIM_ADEMAMIX;
    const bool mix = OPT == BNB_OPTIM_ADEMAMIX;
    // skip_zeros applies to adam and the 1-state optimizers, not to AdEMAMix (docs/semantics.md 5.2).
    const bool skippable = OPT != BNB_OPTIM_ADEMAMIX;
    threadgroup float sums[BNB_OPTIM_SIMDS];
    threadgroup float total_tg[1];

    bnb_optim_hyper h;
    h.beta1 = beta1;
    h.beta2 = beta2;
    h.beta3 = beta3;
    h.alpha = alpha;
    h.eps = eps;
    h.bc1 = bc1;
    h.bc2 = bc2;
    h.decay = decay;
    h.weight_decay = weight_decay;
    h.gnorm_scale = gnorm_scale;
    h.first_step = (flags & BNB_OPTIM_FIRST_STEP) != 0u;
    const bool skip_zeros = skippable && (flags & BNB_OPTIM_SKIP_ZEROS) != 0u;
    const bool vec_g = (flags & BNB_OPTIM_VEC_G) != 0u;
    const bool vec_p = (flags & BNB_OPTIM_VEC_P) != 0u;
    const bool vec_s1 = (flags & BNB_OPTIM_VEC_S1) != 0u;
    const bool vec_s2 = (flags & BNB_OPTIM_VEC_S2) != 0u;
    const bool vec_m2 = (flags & BNB_OPTIM_VEC_M2) != 0u;
    device float* state_m2 = state1 + n;

    float lr_step = lr;
    if (!NORM && (flags & BNB_OPTIM_CLIP) != 0u) {
        if (sg == 0u) {
            float s = 0.0f;
            for (uint i = lane; i < groups; i += 32u) {
                s += partials[i];
            }
            s = simd_sum(s);
            if (lane == 0u) {
                total_tg[0] = s;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const float total = total_tg[0];
        if (tg == 0u && tid == 0u) {
            unorm[0] = total;
        }
        const float norm = metal::precise::sqrt(total);
        if (norm > max_norm) {
            lr_step = lr * metal::precise::divide(max_norm, norm);
        }
    }

    const uint chunk = BNB_OPTIM_THREADS * BNB_OPTIM_PER_LANE;
    const uint chunks = n / chunk + (n % chunk != 0u ? 1u : 0u);
    float acc = 0.0f;
    for (uint c = tg; c < chunks; c += groups) {
        const uint first = c * chunk + tid * BNB_OPTIM_PER_LANE;
        float gv[8];
        float pv[8];
        float m[8];
        float v[8];
        float m2[8];
        bnb_optim_load8(g, first, n, vec_g, gv);
        bnb_optim_load8(p, first, n, vec_p, pv);
        bnb_optim_load8(state1, first, n, vec_s1, m);
        if (two_states) {
            bnb_optim_load8(state2, first, n, vec_s2, v);
        } else {
            for (uint k = 0; k < 8u; ++k) {
                v[k] = 0.0f;
            }
        }
        if (mix) {
            bnb_optim_load8(state_m2, first, n, vec_m2, m2);
        } else {
            for (uint k = 0; k < 8u; ++k) {
                m2[k] = 0.0f;
            }
        }
        for (uint k = 0; k < 8u; ++k) {
            if (first + k < n && !(skip_zeros && gv[k] == 0.0f)) {
                const float u = bnb_optim_element<OPT>(gv[k], pv[k], m[k], v[k], m2[k], lr_step, h);
                acc += u * u;
            }
        }
        if (!NORM) {
            bnb_optim_store8(p, first, n, vec_p, pv);
            bnb_optim_store8(state1, first, n, vec_s1, m);
            if (two_states) {
                bnb_optim_store8(state2, first, n, vec_s2, v);
            }
            if (mix) {
                bnb_optim_store8(state_m2, first, n, vec_m2, m2);
            }
        }
    }
    if (NORM) {
        acc = simd_sum(acc);
        if (lane == 0u) {
            sums[sg] = acc;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid == 0u) {
            float s = 0.0f;
            for (uint j = 0; j < BNB_OPTIM_THREADS / 32u; ++j) {
                s += sums[j];
            }
            partials[tg] = s;
        }
    }
}
