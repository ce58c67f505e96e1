// int8 x int8 matrix product for the int8 linear layers, on AMX tiles: out = (x @ w^T) * w_scale[n] * x_scale[m].
//
// Built and loaded like attention.cpp (ember.ops.native); at::parallel_for runs it on torch's OpenMP pool.
// x: (M, K) int8 activations, quantised per token; w: the (N, K) int8 weights packed once at load into
// AMX's tile layout, [N/16][K/64][16][16][4]: one 1 KB tile per 16 output channels x 64 inputs, 4
// consecutive inputs per channel side by side (what TDPBSSD reads as its B operand). The int32 sums
// are scaled and rounded once, to bf16 or float32, on the way out.
//
// Why not oneDNN's int8 matmul (onednn::qlinear_pointwise, which ember used before): at the batch
// sizes an embedding server runs, 20 to 2,048 tokens, it reached 0.5-2 of the 5-10 TOPS this kernel's
// tiles can do, and applies only the weights' scales (the per-token rescale was another pass).
// Here each thread takes a range of 32-channel blocks; per block it walks the tokens 32 at a time
// (2 x 2 result tiles), its weights (32 KB at K = 1,024) staying in L1/L2 while the next block's are
// prefetched into L2. Long batches run in chunks of tokens whose activations fit in L2.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <memory>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AMX_INT8__)
#error "needs AVX-512 BF16 and AMX int8"
#endif

using ember_amx::bf16;
using ember_amx::load_tile_config;

namespace {

constexpr int64_t kTile = 1024;          // bytes per packed weight tile: 16 rows (of 4 inputs) x 16 channels x 4
constexpr int64_t kChunkBytes = 256 << 10;  // activations per token chunk: a quarter of L2

// 2^t for t in [-126, 126]: one rounding, a degree-5 polynomial on the fraction, a scalef (as attention.cpp).
inline __m512 exp2_ps(__m512 t) {
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.f)), _mm512_set1_ps(126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0013333558f), f, _mm512_set1_ps(0.0096181291f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Rows of a 16 x 32 int32 block (row stride 32) -> out, times the channels' and tokens' scales, plus the
// channels' bias where there is one (bias: nullptr).
// Glu: the block's first 16 channels are gates and the next 16 their up projections (pack order of a
// SwiGLU layer); writes the 16 values silu(gate) * up = gate * up / (1 + 2^(-gate log2 e)). The
// reciprocal is rcp14's (relative error < 2^-14, far inside the bf16 rounding or int8 step after it).
template <typename Out, bool Glu>
void store_rows(const int32_t* c, int64_t rows, const float* ws, const float* xs, const float* bias, Out* out,
                int64_t ldo) {
  const __m512 s0 = _mm512_loadu_ps(ws), s1 = _mm512_loadu_ps(ws + 16);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __m512 minus_log2e = _mm512_set1_ps(-1.4426950408889634f), one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 t = _mm512_set1_ps(xs[r]);
    const __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32)), s0), t, b0);
    const __m512 b = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32 + 16)), s1), t, b1);
    if constexpr (Glu) {
      const __m512 sig = _mm512_rcp14_ps(_mm512_add_ps(one, exp2_ps(_mm512_mul_ps(a, minus_log2e))));
      const __m512 h = _mm512_mul_ps(_mm512_mul_ps(a, b), sig);
      if constexpr (sizeof(Out) == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(h));
      else
        _mm512_storeu_ps(out + r * ldo, h);
    } else if constexpr (sizeof(Out) == 2) {
      _mm512_storeu_si512(out + r * ldo, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    } else {
      _mm512_storeu_ps(out + r * ldo, a);
      _mm512_storeu_ps(out + r * ldo + 16, b);
    }
  }
}

template <typename Out, bool Glu>
bool gemm(const int8_t* x, int64_t M, int64_t K, int64_t lda, const int8_t* w, int64_t N, const float* ws,
          const float* xs, const float* bias, Out* out, int64_t ldo) {
  const int64_t ksteps = K / 64, nblocks = N / 32, mtiles = (M + 15) / 16;
  // The activations re-laid tile by tile, [M/16][K/64][16][64], the last tile zero padded, so every
  // tile load reads 1 KB in a row (measured as fast as loading rows K bytes apart, and one layout for
  // the padded tail and the rest).
  std::unique_ptr<int8_t, decltype(&std::free)> a(static_cast<int8_t*>(std::aligned_alloc(64, mtiles * 16 * K)), &std::free);
  if (!a) return false;
  at::parallel_for(0, mtiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = t * 16 + r;
        int8_t* dst = a.get() + t * 16 * K + r * 64;
        for (int64_t k = 0; k < ksteps; ++k) {
          if (row < M)
            std::memcpy(dst + k * kTile, x + row * lda + k * 64, 64);
          else
            std::memset(dst + k * kTile, 0, 64);
        }
      }
    }
  });
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (16 * K) / 2 * 2);  // tiles of tokens, even

  at::parallel_for(0, nblocks, 1, [&](int64_t nb0, int64_t nb1) {
    load_tile_config();
    alignas(64) int32_t c[16 * 32];
    // The result tiles for tokens 16 t.. (already stored in c) -> out.
    auto emit = [&](int64_t t, int64_t nb) {
      store_rows<Out, Glu>(c, std::min<int64_t>(16, M - t * 16), ws + nb * 32, xs + t * 16,
                           bias ? bias + nb * 32 : nullptr,
                           out + t * 16 * ldo + nb * (Glu ? 16 : 32), ldo);
    };
    for (int64_t t0 = 0; t0 < mtiles; t0 += chunk) {
      const int64_t t1 = std::min(mtiles, t0 + chunk);
      const int64_t steps = (t1 - t0 + 1) / 2 * ksteps, lines = 2 * ksteps * kTile / 64;
      const int64_t per_step = (lines + steps - 1) / steps;
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const int8_t* b0 = w + 2 * nb * ksteps * kTile;  // channels 32 nb .. +15
        const int8_t* b1 = b0 + ksteps * kTile;          // and the next 16
        const char* next = nb + 1 < nb1 ? reinterpret_cast<const char*>(b1 + ksteps * kTile) : nullptr;
        int64_t fetched = 0;
        for (int64_t t = t0; t < t1; t += 2) {
          const bool two = t + 1 < t1;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k = 0; k < ksteps; ++k) {
            _tile_loadd(4, a.get() + (t * ksteps + k) * kTile, 64);
            _tile_loadd(6, b0 + k * kTile, 64);
            _tile_loadd(7, b1 + k * kTile, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            if (next)
              for (int64_t q = 0; q < per_step && fetched < lines; ++q, ++fetched)
                _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
            if (two) {
              _tile_loadd(5, a.get() + ((t + 1) * ksteps + k) * kTile, 64);
              _tile_dpbssd(2, 5, 6);
              _tile_dpbssd(3, 5, 7);
            }
          }
          _tile_stored(0, c, 128);
          _tile_stored(1, c + 16, 128);
          emit(t, nb);
          if (two) {
            _tile_stored(2, c, 128);
            _tile_stored(3, c + 16, 128);
            emit(t + 1, nb);
          }
        }
      }
    }
    _tile_release();
  });
  return true;
}

}  // namespace

extern "C" {

// 1 when the kernel can run here: Linux grants this process the AMX tile state.
int ember_int8_gemm_usable() {
  return ember_amx::tiles_usable();
}

// out (M, N), row stride ldo: bf16 (out_float 0) or float32 (1) = (x @ w^T) * ws[n] * xs[m] + bias[n] (bias
// may be null), where x is (M, K) int8 with row stride lda, w the packed weights. With glu, out is (M, N / 2): silu(gate) * up,
// for weights packed with gates and ups alternating in blocks of 16 channels. Returns 0; 1 for
// unsupported shapes (K a multiple of 64 and N of 32 are needed); 2 when its buffer cannot be allocated.
int ember_int8_gemm(const int8_t* x, int64_t M, int64_t K, int64_t lda, const int8_t* w, int64_t N, const float* ws,
                    const float* xs, const float* bias, void* out, int64_t ldo, int out_float, int glu) {
  if (K % 64 != 0 || N % 32 != 0 || M < 1) return 1;
  bool done;
  if (out_float && glu)
    done = gemm<float, true>(x, M, K, lda, w, N, ws, xs, bias, static_cast<float*>(out), ldo);
  else if (out_float)
    done = gemm<float, false>(x, M, K, lda, w, N, ws, xs, bias, static_cast<float*>(out), ldo);
  else if (glu)
    done = gemm<bf16, true>(x, M, K, lda, w, N, ws, xs, bias, static_cast<bf16*>(out), ldo);
  else
    done = gemm<bf16, false>(x, M, K, lda, w, N, ws, xs, bias, static_cast<bf16*>(out), ldo);
  if (!done) return 2;
  return 0;
}

}  // extern "C"
