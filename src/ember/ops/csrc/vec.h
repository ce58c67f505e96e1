// What ember's kernels share: 2^x (one polynomial, in AVX-512 and AVX2 registers), silu, and bf16 <-> float32 for
// 16 values. The AVX-512 half is there when the compiler targets AVX-512 BF16; the AVX2 half always (x86-64-v3).
#pragma once

#include <immintrin.h>

#include <cstdint>

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

// 2^t in 8 lanes (AVX2 + FMA): as the AVX-512 exp2_ps below, with 2^n built in the exponent bits (no scalef).
template <int kDegree, bool kClampHigh = true>
inline __m256 exp2_ps(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  if constexpr (kClampHigh) t = _mm256_min_ps(t, _mm256_set1_ps(126.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = exp2_poly<kDegree>(
      _mm256_sub_ps(t, n), [](float x) { return _mm256_set1_ps(x); },
      [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); });
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

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
