// What ember's kernels share: 2^x (one polynomial, in AVX-512, AVX2 and NEON registers), 8 float32 lanes with the
// few operations the float32 kernels use (one AVX2 register on x86-64, two NEON registers on aarch64), silu, and
// bf16 <-> float32 for 16 values. The 8-lane part is there on every x86-64-v3 and aarch64 target; the 16-lane 2^x
// where the compiler targets AVX-512 (EMBER_F32X16); silu and bf16 where it targets AVX-512 BF16.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <cstdint>
#include <limits>

// AMD's Zen cores (GCC defines __znverN__ under -march=native there): a few choices measured faster on them.
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define EMBER_ZEN 1
#else
#define EMBER_ZEN 0
#endif

namespace ember_vec {

using bf16 = uint16_t;  // bfloat16 bits

// 2^f for f in [-0.5, 0.5]: the polynomial both register widths use (V: __m256 or __m512; set1, fma: its own).
// Degree 3: relative error 1.1e-4, under bf16's rounding of 3.9e-3 (attention's probabilities); degree 5: ~3e-6.
template <int kDegree, typename V, typename Set, typename Fma>
inline V exp2_poly(V f, Set set1, Fma fma) {
  static_assert(kDegree == 3 || kDegree == 5, "exp2 has degree 3 and degree 5 polynomials");
  V p;
  if constexpr (kDegree == 3) {
    p = fma(set1(0.05459283f), f, set1(0.24221838f));
    p = fma(p, f, set1(0.69336869f));
  } else {
    p = fma(set1(0.0013333558f), f, set1(0.0096181291f));
    p = fma(p, f, set1(0.0555041087f));
    p = fma(p, f, set1(0.2402265070f));
    p = fma(p, f, set1(0.6931471806f));
  }
  return fma(p, f, set1(1.f));
}

// ---- 8 float32 lanes -------------------------------------------------------------------------------------------
// f32x8 and its operations: the float32 kernels' inner loops are written once against these.
#if defined(__AVX2__) && defined(__FMA__)
#define EMBER_F32X8 1
using f32x8 = __m256;
inline f32x8 load8(const float* x) { return _mm256_loadu_ps(x); }
inline void store8(float* y, f32x8 v) { _mm256_storeu_ps(y, v); }
inline f32x8 set8(float x) { return _mm256_set1_ps(x); }
inline f32x8 zero8() { return _mm256_setzero_ps(); }
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }  // a b + c
inline f32x8 add8(f32x8 a, f32x8 b) { return _mm256_add_ps(a, b); }
inline f32x8 mul8(f32x8 a, f32x8 b) { return _mm256_mul_ps(a, b); }
inline f32x8 max8(f32x8 a, f32x8 b) { return _mm256_max_ps(a, b); }
inline float max_of8(f32x8 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float sum_of8(f32x8 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline bool any_above8(f32x8 v, float x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_GT_OQ)) != 0;
}
// x[j .. j + 7] (all 8 readable), those outside [from, keep) as `fill`.
inline f32x8 load8_in(const float* x, int64_t j, int64_t from, int64_t keep, float fill) {
  const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int32_t(j)));
  const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(from)), at),
                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(keep)), at));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_loadu_ps(x + j), _mm256_castsi256_ps(in));
}

// 2^t in 8 lanes: as the AVX-512 exp2_ps below, with 2^n built in the exponent bits (no scalef).
template <int kDegree, bool kClampHigh = true>
inline f32x8 exp2_ps(f32x8 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  if constexpr (kClampHigh) t = _mm256_min_ps(t, _mm256_set1_ps(126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp2_poly<kDegree>(
      _mm256_sub_ps(t, n), [](float x) { return _mm256_set1_ps(x); },
      [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); });
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Transposes the 8 x 8 matrix held in r[0..7] (rows) in place.
inline void transpose8(f32x8 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

inline void cpu_relax() { _mm_pause(); }

#elif defined(__aarch64__)
#define EMBER_F32X8 1
struct f32x8 {
  float32x4_t lo, hi;
};
inline f32x8 load8(const float* x) { return {vld1q_f32(x), vld1q_f32(x + 4)}; }
inline void store8(float* y, f32x8 v) { vst1q_f32(y, v.lo), vst1q_f32(y + 4, v.hi); }
inline f32x8 set8(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
inline f32x8 zero8() { return set8(0.f); }
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline f32x8 add8(f32x8 a, f32x8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline f32x8 mul8(f32x8 a, f32x8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline f32x8 max8(f32x8 a, f32x8 b) { return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; }
inline float max_of8(f32x8 v) { return vmaxvq_f32(vmaxq_f32(v.lo, v.hi)); }
inline float sum_of8(f32x8 v) { return vaddvq_f32(vaddq_f32(v.lo, v.hi)); }
inline bool any_above8(f32x8 v, float x) {
  return vmaxvq_u32(vorrq_u32(vcgtq_f32(v.lo, vdupq_n_f32(x)), vcgtq_f32(v.hi, vdupq_n_f32(x)))) != 0;
}
inline f32x8 load8_in(const float* x, int64_t j, int64_t from, int64_t keep, float fill) {
  static const int32_t kAt[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32x4_t j4 = vdupq_n_s32(int32_t(j)), f4 = vdupq_n_s32(int32_t(from)), k4 = vdupq_n_s32(int32_t(keep));
  const int32x4_t lo = vaddq_s32(vld1q_s32(kAt), j4), hi = vaddq_s32(vld1q_s32(kAt + 4), j4);
  const float32x4_t fv = vdupq_n_f32(fill);
  return {vbslq_f32(vandq_u32(vcgeq_s32(lo, f4), vcltq_s32(lo, k4)), vld1q_f32(x + j), fv),
          vbslq_f32(vandq_u32(vcgeq_s32(hi, f4), vcltq_s32(hi, k4)), vld1q_f32(x + j + 4), fv)};
}

template <int kDegree, bool kClampHigh = true>
inline float32x4_t exp2_ps(float32x4_t t) {
  t = vmaxq_f32(t, vdupq_n_f32(-126.f));
  if constexpr (kClampHigh) t = vminq_f32(t, vdupq_n_f32(126.f));
  const float32x4_t n = vrndnq_f32(t);
  const float32x4_t p = exp2_poly<kDegree>(
      vsubq_f32(t, n), [](float x) { return vdupq_n_f32(x); },
      [](float32x4_t a, float32x4_t b, float32x4_t c) { return vfmaq_f32(c, a, b); });
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
template <int kDegree, bool kClampHigh = true>
inline f32x8 exp2_ps(f32x8 t) {
  return {exp2_ps<kDegree, kClampHigh>(t.lo), exp2_ps<kDegree, kClampHigh>(t.hi)};
}

// Transposes the 4 x 4 matrix in a[0..3] (rows) into b[0..3].
inline void transpose4(const float32x4_t a[4], float32x4_t b[4]) {
  const float32x4x2_t t01 = vtrnq_f32(a[0], a[1]), t23 = vtrnq_f32(a[2], a[3]);
  b[0] = vcombine_f32(vget_low_f32(t01.val[0]), vget_low_f32(t23.val[0]));
  b[1] = vcombine_f32(vget_low_f32(t01.val[1]), vget_low_f32(t23.val[1]));
  b[2] = vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0]));
  b[3] = vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1]));
}
inline void transpose8(f32x8 r[8]) {
  float32x4_t in[4][4], out[4][4];  // quadrant (row half, column half) as [2 * rows + cols]
  for (int i = 0; i < 4; ++i) in[0][i] = r[i].lo, in[1][i] = r[i].hi, in[2][i] = r[4 + i].lo, in[3][i] = r[4 + i].hi;
  for (int q = 0; q < 4; ++q) transpose4(in[q], out[q]);
  for (int i = 0; i < 4; ++i) r[i] = {out[0][i], out[2][i]}, r[4 + i] = {out[1][i], out[3][i]};
}

inline void cpu_relax() { __asm__ __volatile__("yield"); }
#endif  // 8 float32 lanes

#if defined(__AVX512F__)
#define EMBER_F32X16 1

// 2^t: t = n + f (n rounded to nearest, f in [-0.5, 0.5]), 2^f by a polynomial of degree kDegree, times 2^n by
// scalef. t is clamped below at -126, and above at 126 when kClampHigh (callers whose t is bounded skip it).
template <int kDegree, bool kClampHigh = true>
inline __m512 exp2_ps(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  if constexpr (kClampHigh) t = _mm512_min_ps(t, _mm512_set1_ps(126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = exp2_poly<kDegree>(
      _mm512_sub_ps(t, n), [](float x) { return _mm512_set1_ps(x); },
      [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); });
  return _mm512_scalef_ps(p, n);
}

#else
#define EMBER_F32X16 0
#endif  // AVX-512F

// ---- F32Lanes: the widest float32 register the compiler targets -----------------------------------------------
// 16 lanes (one AVX-512 register) where it targets AVX-512 (Skylake-SP and later Xeons, Zen 4/5), else 8 (f32x8:
// one AVX2 register, or two NEON registers). The float32 register blocks (attention's products, the bf16-weight
// linear layers) are written once against it.
#if EMBER_F32X16
struct F32Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* x) { return _mm512_loadu_ps(x); }
  static void store(float* y, V v) { _mm512_storeu_ps(y, v); }
  static V set(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float max_of(V v) { return _mm512_reduce_max_ps(v); }
  static bool any_above(V v, float x) { return _mm512_cmp_ps_mask(v, set(x), _CMP_GT_OQ) != 0; }
  // kWidth 32-bit words, each two bf16 values side by side, as float32: the low halves (lo) and the high (hi).
  static void load_bf16_pairs(const uint32_t* p, V& lo, V& hi) {
    const __m512i w = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xffff0000u))));
  }
  // kWidth int8 values as float32 (exact).
  static V load_int8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#elif EMBER_F32X8
struct F32Lanes {
  using V = f32x8;
  static constexpr int kWidth = 8;
  static V load(const float* x) { return load8(x); }
  static void store(float* y, V v) { store8(y, v); }
  static V set(float x) { return set8(x); }
  static V zero() { return zero8(); }
  static V fma(V a, V b, V c) { return fma8(a, b, c); }
  static V add(V a, V b) { return add8(a, b); }
  static V max(V a, V b) { return max8(a, b); }
  static float max_of(V v) { return max_of8(v); }
  static bool any_above(V v, float x) { return any_above8(v, x); }
  static void load_bf16_pairs(const uint32_t* p, V& lo, V& hi) {
#if defined(__x86_64__)
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xffff0000u))));
#else
    const uint32x4_t a = vld1q_u32(p), b = vld1q_u32(p + 4), m = vdupq_n_u32(0xffff0000u);
    lo = {vreinterpretq_f32_u32(vshlq_n_u32(a, 16)), vreinterpretq_f32_u32(vshlq_n_u32(b, 16))};
    hi = {vreinterpretq_f32_u32(vandq_u32(a, m)), vreinterpretq_f32_u32(vandq_u32(b, m))};
#endif
  }
  // kWidth int8 values as float32 (exact).
  static V load_int8(const int8_t* p) {
#if defined(__x86_64__)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_high_s16(w))};
#endif
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

// silu(a) * b = a * b / (1 + 2^(-a log2 e)); the reciprocal is rcp14's (relative error < 2^-14, far inside
// a bf16 rounding).
inline __m512 silu_mul_ps(__m512 a, __m512 b) {
  const __m512 e = exp2_ps<5>(_mm512_mul_ps(a, _mm512_set1_ps(-1.4426950408889634f)));
  return _mm512_mul_ps(_mm512_mul_ps(a, b), _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.f), e)));
}

// 16 bf16 values (the first `n` of them; the rest read as 0) as float32, and back (rounded to nearest even).
inline __m512 load_bf16(const bf16* x, __mmask16 n = 0xffff) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, x)), 16));
}
inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
inline void store_bf16(bf16* y, __m512 v, __mmask16 n = 0xffff) {
  _mm256_mask_storeu_epi16(y, n, (__m256i)_mm512_cvtneps_pbh(v));
}

#endif  // AVX-512 BF16

}  // namespace ember_vec
