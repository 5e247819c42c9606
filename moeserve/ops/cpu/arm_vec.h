/* The fp32 vector of the aarch64 kernel bodies (fp32.c, int8.c, attention.c): the macros their
 * macro-generated bodies are written in (as each x86 body defines them for AVX2 and
 * AVX-512F), for SVE where the build fixed the vector length (-msve-vector-bits, from the
 * CPU's: ops/cpu/build.py), else for NEON. Fixed-length SVE vectors can be held in arrays and
 * have a compile-time lane count, which the bodies need; a build then runs at that length
 * only. Also q8x4, 4 int8 values as 4 floats on NEON. Include after common.h; not a
 * translation unit of its own.
 *   W      lanes;  SFX  the body's name suffix (_sve, _neon);  VF  the vector type
 *   VZERO() VLOADU(p) VLOAD(p) VSTORE(p, v) VFMA(a, b, c) = a * b + c  VADD(a, b)
 *   VMUL(a, b)  VDUP(s) every lane s
 *   VHSUM(v) the sum of the lanes;  VLOADQ(q) W int8 values (sign-extended) as W floats */
#ifndef MOESERVE_ARM_VEC_H
#define MOESERVE_ARM_VEC_H
#include <arm_neon.h>
#include <string.h>

/* 4 int8 values as 4 floats (a 4-byte load: a wider one could read past a row's end) */
static inline float32x4_t q8x4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(v)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
#include <arm_sve.h>
#define W (__ARM_FEATURE_SVE_BITS / 32)
#define SFX _sve
typedef svfloat32_t vf_sve __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
#define VF vf_sve
#define VZERO() svdup_n_f32(0.0f)
#define VLOADU(p) svld1_f32(svptrue_b32(), p)
#define VLOAD(p) svld1_f32(svptrue_b32(), p)
#define VSTORE(p, v) svst1_f32(svptrue_b32(), p, v)
#define VFMA(a, b, c) svmla_f32_x(svptrue_b32(), c, a, b)
#define VADD(a, b) svadd_f32_x(svptrue_b32(), a, b)
#define VMUL(a, b) svmul_f32_x(svptrue_b32(), a, b)
#define VDUP(s) svdup_n_f32(s)
#define VHSUM(v) svaddv_f32(svptrue_b32(), v)
#define VLOADQ(q) svcvt_f32_s32_x(svptrue_b32(), svld1sb_s32(svptrue_b32(), q))
#else
#define W 4
#define SFX _neon
typedef float32x4_t vf_neon;
#define VF vf_neon
#define VZERO() vdupq_n_f32(0.0f)
#define VLOADU(p) vld1q_f32(p)
#define VLOAD(p) vld1q_f32(p)
#define VSTORE(p, v) vst1q_f32(p, v)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VADD(a, b) vaddq_f32(a, b)
#define VMUL(a, b) vmulq_f32(a, b)
#define VDUP(s) vdupq_n_f32(s)
#define VHSUM(v) vaddvq_f32(v)
#define VLOADQ(q) q8x4(q)
#endif
#endif
