/*
 * dspx/ivp.h — emulation of the Cadence Vision DSP (IVP) vector intrinsics
 * the UCP seed's softmax uses, written with GCC vector extensions so the
 * seed's code compiles unchanged on x86.  Included by dspx/dsp.h.
 *
 * Machine model: 512-bit vectors.  IVP_N = 32 16-bit lanes, IVP_N_2 = 16
 * 32-bit lanes; lane 0 is at the lowest address.
 *
 * Types
 *   xb_vecN_2xf32  16 x float      (C++: a value type that also converts from a float scalar)
 *   xb_vecN_2x32v  16 x int32      (C++: also converts from an int scalar)
 *   xb_vecN_2x64w  16 x int64      the wide accumulator of fixed-point multiplies
 *   xb_vecNx16     32 x int16
 *   vboolN_2       16 lane predicates (a lane mask: -1 true, 0 false)
 *   valign         an alignment register; unaligned accesses are direct
 *                  here, so it carries no state
 *   In C a scalar operand of an intrinsic is broadcast to all lanes (the
 *   macros below do it); to set a vector variable from a scalar write
 *   XB_VECN_2XF32(s) / XB_VECN_2X32V(i) (dspx).
 *
 * Loads and stores (p is a pointer variable, advanced in place; any alignment)
 *   IVP_LAN_2XF32_PP(p)            prime an aligning load: returns a valign, reads nothing
 *   IVP_LAN_2XF32_IP(v, a, p)      v = 16 floats at p; p += 64 bytes.  Like the hardware, it
 *                                  may read past the end of the data (the seed's vecmul
 *                                  does): bytes outside the task's buffers and L2 read as 0
 *   IVP_LAVN_2XF32_XP(v, a, p, n)  k = clamp(n, 0, 64); v = the k bytes at p, the other
 *                                  lanes 0 (a tail); p += k.  Reads only those k bytes
 *   IVP_ZALIGN()                   a zero valign for stores
 *   IVP_SAN_2XF32_IP(v, a, p)      store 16 floats at p; p += 64
 *   IVP_SAVN_2XF32_XP(v, a, p, n)  k = clamp(n, 0, 64); store the first k bytes of v; p += k
 *   IVP_SAPOSN_2XF32_FP(a, p)      flush an aligning store: nothing left to flush here
 *   IVP_LSN_2X32_I(p, off)         the int32 at (char *)p + off, in every lane
 *   IVP_LSRN_2XF32_IP(v, p, inc)   v = the float at p in every lane; p += inc bytes
 *   IVP_LSRN_2XF32_XP(v, p, inc)   the same, with a register increment (may be negative)
 *
 * Float arithmetic (IEEE single, round to nearest, per lane)
 *   IVP_ADDN_2XF32(a, b)  a + b        IVP_SUBN_2XF32(a, b)  a - b
 *   IVP_MULN_2XF32(a, b)  a * b        IVP_MULAN_2XF32(acc, a, b)  acc += a * b, two roundings
 *                                      (the SDK builds with -ffp-contract=off)
 *   IVP_MAXN_2XF32(a, b)  IEEE maxNum: the larger; a NaN lane yields the other operand
 *   IVP_RADDN_2XF32(v)    sum of the lanes as a tree: lanes i and i+8, then i and i+4,
 *                         i and i+2, i and i+1 (the order matters in float)
 * Predicated forms (t a vboolN_2; false lanes keep the destination)
 *   IVP_MAXN_2XF32T(r, a, b, t)  r = t ? max(a, b) : r
 *   IVP_ADDN_2XF32T(r, a, b, t)  r = t ? a + b : r
 *   IVP_MOVN_2XF32T(a, b, t)     returns t ? a : b
 * Comparisons (to vboolN_2; "U" = also true when either lane is NaN)
 *   IVP_UNN_2XF32(a, b)   unordered       IVP_ULEN_2XF32(a, b)  a <= b or unordered
 *   IVP_UEQN_2XF32(a, b)  a == b or unordered
 *   IVP_LTRSN_2(n)        lanes i < n true (n <= 0: none, n >= 16: all)
 * Lane moves
 *   IVP_SELN_2XF32I(a, b, IVP_SELI_32B_ROTATE_RIGHT_k)  lanes k..k+15 of the 32-lane
 *                         concatenation (b in lanes 0..15, a in 16..31); a == b rotates
 *   IVP_MOVF32_FROMN_2XF32(v)    lane 0 as a float
 * Conversions and reinterpretation
 *   IVP_TRUNCN_2XF32(x, s)       int32 of x * 2^s, truncated toward 0, saturated; NaN -> 0
 *   IVP_FLOATN_2X32(x, s)        float of x, times 2^-s (x rounded to float, then scaled)
 *   IVP_MOVN_2XF32_FROMN_2X32(x) the int32 lanes' bits as floats
 *   IVP_MOVNX16_FROMN_2X32(x)    16 int32 lanes as 32 int16 lanes (lane 2i = low half of i)
 * Int32 arithmetic (two's complement, wrapping)
 *   IVP_ADDN_2X32(a, b)  IVP_SUBN_2X32(a, b)
 *   IVP_SLLIN_2X32(x, s)  x << s      IVP_SRLIN_2X32(x, s), IVP_SRLIN_2X32U(x, s)  logical x >> s
 * Fixed point (the pair below composes an exact signed 32 x 32 -> 64 multiply)
 *   IVP_MULN_2X16X32_0(h, x)      W[i] = (uint16)h[2i] * x[i]          (64-bit)
 *   IVP_MULAHN_2X16X32_1(W, h, x) W[i] += ((int16)h[2i+1] * x[i]) << 16
 *   IVP_PACKVRNRN_2X64W(W, s)     low 32 bits of (W[i] + 2^(s-1)) >> s (round half up, no
 *                                 saturation: the fraction bits of a Q number), s in 1..63
 *   IVP_PACKHN_2X64W(W)           high 32 bits of W[i]
 *
 * Tables for the seed's exp (vecexpf_max): expftblf (2^x on [0, 1), degree 6,
 * highest power first: p0 x^6 + ... + p6), invln2_Q30, expfminmax, minus_inff_,
 * plus_inff.  The coefficients are ours: a relative-error least-squares fit
 * of 2^x on 2000 Chebyshev nodes of [0, 1] in double, rounded to float
 * (max relative error 1.1e-8 before float evaluation).
 */
#ifndef DSPX_IVP_H
#define DSPX_IVP_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* 512-bit vector values without AVX-512: GCC notes an ABI change at every
 * use, but they only cross always-inline functions.  (Left on for the rest
 * of the file that includes this: the notes come where the intrinsics are used.) */
#pragma GCC diagnostic ignored "-Wpsabi"

#define IVP_N 32
#define IVP_N_2 16
#define LOG2_IVP_N_2 4
#define IVP_2N 64
#define IVP_SELI_32B_ROTATE_RIGHT_1 1
#define IVP_SELI_32B_ROTATE_RIGHT_2 2
#define IVP_SELI_32B_ROTATE_RIGHT_4 4
#define IVP_SELI_32B_ROTATE_RIGHT_8 8

typedef float dspx_v16f __attribute__((vector_size(64)));
typedef int32_t dspx_v16i __attribute__((vector_size(64)));
typedef uint32_t dspx_v16u __attribute__((vector_size(64)));
typedef int64_t dspx_v16l __attribute__((vector_size(128)));
typedef int16_t dspx_v32h __attribute__((vector_size(64)));

typedef float xtfloat;
typedef dspx_v16l xb_vecN_2x64w;
typedef dspx_v32h xb_vecNx16;
typedef dspx_v16i vboolN_2;
typedef struct { int32_t unused_; } valign;

#define DSPX_INLINE static inline __attribute__((always_inline, unused))

#ifdef __cplusplus
struct xb_vecN_2xf32 {
    dspx_v16f v;
    xb_vecN_2xf32() : v() {}
    xb_vecN_2xf32(dspx_v16f x) : v(x) {}
    xb_vecN_2xf32(float s) : v(dspx_v16f{} + s) {}
    operator dspx_v16f() const { return v; }
};
struct xb_vecN_2x32v {
    dspx_v16i v;
    xb_vecN_2x32v() : v() {}
    xb_vecN_2x32v(dspx_v16i x) : v(x) {}
    xb_vecN_2x32v(int32_t s) : v(dspx_v16i{} + s) {}
    operator dspx_v16i() const { return v; }
};
DSPX_INLINE dspx_v16f dspx_vf(dspx_v16f v) { return v; }
DSPX_INLINE dspx_v16f dspx_vf(float s) { return dspx_v16f{} + s; }
DSPX_INLINE dspx_v16i dspx_vi(dspx_v16i v) { return v; }
DSPX_INLINE dspx_v16i dspx_vi(int32_t s) { return dspx_v16i{} + s; }
#define DSPX_VF(x) dspx_vf(x)
#define DSPX_VI(x) dspx_vi(x)
#else
typedef dspx_v16f xb_vecN_2xf32;
typedef dspx_v16i xb_vecN_2x32v;
DSPX_INLINE dspx_v16f dspx_vf_id(dspx_v16f v) { return v; }
DSPX_INLINE dspx_v16f dspx_vf_splat(float s) { return (dspx_v16f){} + s; }
DSPX_INLINE dspx_v16i dspx_vi_id(dspx_v16i v) { return v; }
DSPX_INLINE dspx_v16i dspx_vi_splat(int32_t s) { return (dspx_v16i){} + s; }
#define DSPX_VF(x) _Generic((x), dspx_v16f: dspx_vf_id, default: dspx_vf_splat)(x)
#define DSPX_VI(x) _Generic((x), dspx_v16i: dspx_vi_id, default: dspx_vi_splat)(x)
#endif
#define XB_VECN_2XF32(s) DSPX_VF((float)(s))
#define XB_VECN_2X32V(s) DSPX_VI((int32_t)(s))

/* ------------------------------------------------------------ helpers */

DSPX_INLINE dspx_v16f dspx_self(dspx_v16i m, dspx_v16f a, dspx_v16f b) {
    return (dspx_v16f)((m & (dspx_v16i)a) | (~m & (dspx_v16i)b));
}
DSPX_INLINE dspx_v16i dspx_seli(dspx_v16i m, dspx_v16i a, dspx_v16i b) { return (m & a) | (~m & b); }
DSPX_INLINE int32_t dspx_clamp64(intptr_t n) { return n < 0 ? 0 : n > 64 ? 64 : (int32_t)n; }

/* Unaligned whole-vector accesses (one vmovups). */
typedef float dspx_v16f_u __attribute__((vector_size(64), aligned(1), may_alias));

/* A full 64-byte load.  One that starts a page or crosses into the next
 * may be an over-read past the end of a buffer (the hardware reads ahead
 * harmlessly; here the next page may be unmapped): those few go through
 * the runtime, which reads only what lies inside known memory. */
__attribute__((noinline, unused)) static dspx_v16f dspx_load64_guarded(const void *p) {
    dspx_v16f v;
    dspx_ivp_guarded_load(p, &v, 64);
    return v;
}
DSPX_INLINE dspx_v16f dspx_load64(const void *p) {
    uintptr_t off = (uintptr_t)p & 4095;
    if (__builtin_expect(off == 0 || off > 4096 - 64, 0))
        return dspx_load64_guarded(p);
    return *(const dspx_v16f_u *)p;
}
__attribute__((noinline, unused)) static dspx_v16f dspx_loadn_tail(const void *p, int32_t k) {
    dspx_v16f v = {};
    memcpy(&v, p, (size_t)k);
    return v;
}
DSPX_INLINE dspx_v16f dspx_loadn(const void *p, int32_t k) {
    if (__builtin_expect(k == 64, 1))
        return *(const dspx_v16f_u *)p;
    return dspx_loadn_tail(p, k);
}
__attribute__((noinline, unused)) static void dspx_storen_tail(void *p, dspx_v16f v, int32_t k) {
    memcpy(p, &v, (size_t)k);
}
DSPX_INLINE void dspx_storen(void *p, dspx_v16f v, int32_t k) {
    if (__builtin_expect(k == 64, 1))
        *(dspx_v16f_u *)p = v;
    else
        dspx_storen_tail(p, v, k);
}
#define DSPX_ADVANCE(p, n) ((p) = (__typeof__(p))((const char *)(p) + (n)))

DSPX_INLINE dspx_v16f dspx_rotr(dspx_v16f b, dspx_v16f a, int k) {
    const dspx_v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return __builtin_shuffle(b, a, iota + k);
}
DSPX_INLINE dspx_v16f dspx_maxf(dspx_v16f a, dspx_v16f b) {
    return dspx_self((a > b) | (b != b), a, b);
}
DSPX_INLINE float dspx_raddf(dspx_v16f v) {
    v = v + dspx_rotr(v, v, 8);
    v = v + dspx_rotr(v, v, 4);
    v = v + dspx_rotr(v, v, 2);
    v = v + dspx_rotr(v, v, 1);
    return v[0];
}
DSPX_INLINE dspx_v16i dspx_ltrs(int32_t n) {
    const dspx_v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return iota < n;
}
DSPX_INLINE dspx_v16i dspx_truncf(dspx_v16f x, int s) {
    const float lim = 2147483648.0f;
    dspx_v16f y = x * (float)(1ull << s);
    dspx_v16i hi = y >= lim, lo = y < -lim, nan = y != y;
    dspx_v16i r = __builtin_convertvector(dspx_self(hi | lo | nan, (dspx_v16f){}, y), dspx_v16i);
    r = dspx_seli(hi, (dspx_v16i){} + INT32_MAX, r);
    return dspx_seli(lo, (dspx_v16i){} + INT32_MIN, r);
}
DSPX_INLINE dspx_v16f dspx_floati(dspx_v16i x, int s) {
    return __builtin_convertvector(x, dspx_v16f) * (float)(1.0 / (double)(1ull << s));
}
/* Both factors fit 32 bits: a widening 32 x 32 -> 64 multiply (one
 * vpmuldq per 8 lanes with AVX-512, where GCC would use 64 x 64 ones). */
DSPX_INLINE dspx_v16l dspx_mul32x32(dspx_v16i a, dspx_v16i b) {
    dspx_v16l a64 = __builtin_convertvector(a, dspx_v16l), b64 = __builtin_convertvector(b, dspx_v16l);
#if defined(__AVX512F__)
    __m512i lo = _mm512_maskz_mul_epi32(0xff, (__m512i)__builtin_shufflevector(a64, a64, 0, 1, 2, 3, 4, 5, 6, 7),
                                  (__m512i)__builtin_shufflevector(b64, b64, 0, 1, 2, 3, 4, 5, 6, 7));
    __m512i hi = _mm512_maskz_mul_epi32(0xff, (__m512i)__builtin_shufflevector(a64, a64, 8, 9, 10, 11, 12, 13, 14, 15),
                                  (__m512i)__builtin_shufflevector(b64, b64, 8, 9, 10, 11, 12, 13, 14, 15));
    return (dspx_v16l)__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a64 * b64;
#endif
}
DSPX_INLINE dspx_v16l dspx_mul16x32_0(dspx_v32h h, dspx_v16i x) {
    return dspx_mul32x32((dspx_v16i)((dspx_v16u)h & 0xffffu), x);
}
DSPX_INLINE dspx_v16l dspx_mulah16x32_1(dspx_v16l w, dspx_v32h h, dspx_v16i x) {
    return w + (dspx_mul32x32((dspx_v16i)h >> 16, x) << 16);
}
DSPX_INLINE dspx_v16i dspx_packvr(dspx_v16l w, int s) {
    return __builtin_convertvector((w + ((int64_t)1 << (s - 1))) >> s, dspx_v16i);
}
DSPX_INLINE dspx_v16i dspx_packh(dspx_v16l w) { return __builtin_convertvector(w >> 32, dspx_v16i); }
DSPX_INLINE dspx_v16i dspx_srl(dspx_v16i x, int s) { return (dspx_v16i)((dspx_v16u)x >> s); }

/* ------------------------------------------------------------ exp tables */

typedef union { uint32_t u; float f; } dspx_f32bits;

static const float expftblf[7] __attribute__((unused)) = {
    0.00021690608991775662f, 0.0012443081941455603f, 0.009678472764790058f, 0.05548352375626564f,
    0.2402298003435135f, 0.6931470036506653f, 1.0f};
static const int32_t invln2_Q30 __attribute__((unused)) = 1549082005; /* round(2^30 / ln 2) */
/* [0] ln of the smallest denormal, [1] ln(FLT_MAX) = 88.72284 */
static const dspx_f32bits expfminmax[2] __attribute__((unused)) = {{0xc2cff1b5u}, {0x42b17218u}};
static const dspx_f32bits minus_inff_ __attribute__((unused)) = {0xff800000u};
static const dspx_f32bits plus_inff __attribute__((unused)) = {0x7f800000u};

/* ------------------------------------------------------------ counting (cost builds)
 * DSPX_LD(p) / DSPX_ST(p) count one vector load / store at p (TCM when p lies
 * in the running task's L2 or is one of the exp tables, else DDR); DSPX_OP(CLASS) prefixes an
 * intrinsic's expression with one operation of its class (dspx/cost.h).
 * Without DSPX_COST they are nothing: the intrinsics compile as they did. */
#if DSPX_COST
/* The exp tables above are small constants a DSP's linker keeps in local
 * data RAM (assumed; docs/cost-model.md): their loads count as TCM, like the
 * Python runtime's. */
DSPX_INLINE int dspx_cost_is_table(const void *p) {
    const char *a = (const char *)p;
    return (a >= (const char *)expftblf && a < (const char *)(expftblf + 7))
        || a == (const char *)&invln2_Q30
        || (a >= (const char *)expfminmax && a < (const char *)(expfminmax + 2))
        || a == (const char *)&minus_inff_ || a == (const char *)&plus_inff;
}
DSPX_INLINE void dspx_cost_access(const void *p, int store) {
    struct dspx_cost_counters *c = &dspx_cost_tls;
    uint64_t tcm = (uintptr_t)p - c->l2_lo < c->l2_size || dspx_cost_is_table(p);
    if (store) {
        c->tcm_stores += tcm;
        c->ddr_stores += !tcm;
    } else {
        c->tcm_loads += tcm;
        c->ddr_loads += !tcm;
    }
}
DSPX_INLINE void dspx_cost_op(int cls) { dspx_cost_tls.ops[cls]++; }
#define DSPX_LD(p) dspx_cost_access((p), 0)
#define DSPX_ST(p) dspx_cost_access((p), 1)
#define DSPX_OP(cls) dspx_cost_op(DSPX_COST_##cls),
#else
#define DSPX_LD(p) ((void)0)
#define DSPX_ST(p) ((void)0)
#define DSPX_OP(cls)
#endif

/* ------------------------------------------------------------ the intrinsics
 * Classes (COST-SPEC): ALU = add, sub, max, compare, select, logic, shifts,
 * conversions (PACK included); MUL = multiplies and multiply-accumulates;
 * SPECIAL = the lane reduction RADD; MOVE = lane moves (SEL, MOV to scalar,
 * the reinterpreting MOVs).  Priming (_PP), flush (_FP) and IVP_ZALIGN are
 * no accesses and no operations. */

DSPX_INLINE valign dspx_valign0(void) { valign a = {0}; return a; }
#define IVP_LAN_2XF32_PP(p) ((void)(p), dspx_valign0())
#define IVP_ZALIGN() dspx_valign0()
#define IVP_LAN_2XF32_IP(v, a, p) \
    do { (void)(a); DSPX_LD(p); (v) = dspx_load64((p)); DSPX_ADVANCE(p, 64); } while (0)
#define IVP_LAVN_2XF32_XP(v, a, p, n) \
    do { (void)(a); DSPX_LD(p); int32_t k_ = dspx_clamp64((intptr_t)(n)); (v) = dspx_loadn((p), k_); DSPX_ADVANCE(p, k_); } while (0)
#define IVP_SAN_2XF32_IP(v, a, p) \
    do { (void)(a); DSPX_ST(p); dspx_storen((p), DSPX_VF(v), 64); DSPX_ADVANCE(p, 64); } while (0)
#define IVP_SAVN_2XF32_XP(v, a, p, n) \
    do { (void)(a); DSPX_ST(p); int32_t k_ = dspx_clamp64((intptr_t)(n)); dspx_storen((p), DSPX_VF(v), k_); DSPX_ADVANCE(p, k_); } while (0)
#define IVP_SAPOSN_2XF32_FP(a, p) do { (void)(a); (void)(p); } while (0)
#define IVP_LSN_2X32_I(p, off) \
    __extension__({ int32_t s_; DSPX_LD((const char *)(p) + (off)); memcpy(&s_, (const char *)(p) + (off), 4); DSPX_VI(s_); })
#define IVP_LSRN_2XF32_IP(v, p, inc) \
    do { float s_; DSPX_LD(p); memcpy(&s_, (p), 4); (v) = DSPX_VF(s_); DSPX_ADVANCE(p, (inc)); } while (0)
#define IVP_LSRN_2XF32_XP(v, p, inc) IVP_LSRN_2XF32_IP(v, p, inc)

#define IVP_ADDN_2XF32(a, b) (DSPX_OP(ALU) (DSPX_VF(a) + DSPX_VF(b)))
#define IVP_SUBN_2XF32(a, b) (DSPX_OP(ALU) (DSPX_VF(a) - DSPX_VF(b)))
#define IVP_MULN_2XF32(a, b) (DSPX_OP(MUL) (DSPX_VF(a) * DSPX_VF(b)))
#define IVP_MULAN_2XF32(acc, a, b) (DSPX_OP(MUL) ((acc) = DSPX_VF(acc) + DSPX_VF(a) * DSPX_VF(b)))
#define IVP_MAXN_2XF32(a, b) (DSPX_OP(ALU) dspx_maxf(DSPX_VF(a), DSPX_VF(b)))
#define IVP_RADDN_2XF32(v) (DSPX_OP(SPECIAL) dspx_raddf(DSPX_VF(v)))
#define IVP_MAXN_2XF32T(r, a, b, t) (DSPX_OP(ALU) ((r) = dspx_self((t), dspx_maxf(DSPX_VF(a), DSPX_VF(b)), DSPX_VF(r))))
#define IVP_ADDN_2XF32T(r, a, b, t) (DSPX_OP(ALU) ((r) = dspx_self((t), DSPX_VF(a) + DSPX_VF(b), DSPX_VF(r))))
#define IVP_MOVN_2XF32T(a, b, t) (DSPX_OP(ALU) dspx_self((t), DSPX_VF(a), DSPX_VF(b)))

#define IVP_UNN_2XF32(a, b) (DSPX_OP(ALU) ((DSPX_VF(a) != DSPX_VF(a)) | (DSPX_VF(b) != DSPX_VF(b))))
#define IVP_ULEN_2XF32(a, b) (DSPX_OP(ALU) (~(DSPX_VF(a) > DSPX_VF(b))))
#define IVP_UEQN_2XF32(a, b) (DSPX_OP(ALU) (~((DSPX_VF(a) < DSPX_VF(b)) | (DSPX_VF(a) > DSPX_VF(b)))))
#define IVP_LTRSN_2(n) (DSPX_OP(ALU) dspx_ltrs((int32_t)(n)))

#define IVP_SELN_2XF32I(a, b, k) (DSPX_OP(MOVE) dspx_rotr(DSPX_VF(b), DSPX_VF(a), (k)))
#define IVP_MOVF32_FROMN_2XF32(v) (DSPX_OP(MOVE) (DSPX_VF(v)[0]))

#define IVP_TRUNCN_2XF32(x, s) (DSPX_OP(ALU) dspx_truncf(DSPX_VF(x), (s)))
#define IVP_FLOATN_2X32(x, s) (DSPX_OP(ALU) dspx_floati(DSPX_VI(x), (s)))
#define IVP_MOVN_2XF32_FROMN_2X32(x) (DSPX_OP(MOVE) ((dspx_v16f)DSPX_VI(x)))
#define IVP_MOVNX16_FROMN_2X32(x) (DSPX_OP(MOVE) ((dspx_v32h)DSPX_VI(x)))

/* in unsigned lanes: the documented wrap-around (a signed lane overflow is undefined in C) */
#define IVP_ADDN_2X32(a, b) (DSPX_OP(ALU) ((dspx_v16i)((dspx_v16u)DSPX_VI(a) + (dspx_v16u)DSPX_VI(b))))
#define IVP_SUBN_2X32(a, b) (DSPX_OP(ALU) ((dspx_v16i)((dspx_v16u)DSPX_VI(a) - (dspx_v16u)DSPX_VI(b))))
#define IVP_SLLIN_2X32(x, s) (DSPX_OP(ALU) ((dspx_v16i)((dspx_v16u)DSPX_VI(x) << (s))))
#define IVP_SRLIN_2X32(x, s) (DSPX_OP(ALU) dspx_srl(DSPX_VI(x), (s)))
#define IVP_SRLIN_2X32U(x, s) (DSPX_OP(ALU) dspx_srl(DSPX_VI(x), (s)))

#define IVP_MULN_2X16X32_0(h, x) (DSPX_OP(MUL) dspx_mul16x32_0((h), DSPX_VI(x)))
#define IVP_MULAHN_2X16X32_1(w, h, x) (DSPX_OP(MUL) ((w) = dspx_mulah16x32_1((w), (h), DSPX_VI(x))))
#define IVP_PACKVRNRN_2X64W(w, s) (DSPX_OP(ALU) dspx_packvr((w), (s)))
#define IVP_PACKHN_2X64W(w) (DSPX_OP(ALU) dspx_packh((w)))

#endif /* DSPX_IVP_H */
