// int8 x int8 matrix product for the int8 linear layers: out = (x @ w^T) * w_scale[n] * x_scale[m], on AMX tiles
// where the compiler targets AMX, else on AVX-512 VNNI (AMD Zen 4/5, Cascade Lake and later, an AMX CPU built
// with AMX off).
//
// Built and loaded like attention.cpp (ember.ops.native); at::parallel_for runs it on torch's OpenMP pool.
// x: (M, K) activations, int8 quantised per token, or bf16 / float32 that the kernel quantises per token
// itself while re-laying them for the tiles (saving the separate pass over memory and the kernel launch
// that quantising in torch costs per layer); w: the (N, K) int8 weights packed once at load into
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
// The one part that differs by instruction set is the product of 16 tokens x 32 channels (`block_product`):
// AMX's TDPBSSD multiplies signed by signed bytes; AVX-512 VNNI's VPDPBUSD multiplies unsigned by signed, so
// there the activations are stored offset by 128 (as unsigned bytes) and 128 x each channel's weight sum is
// taken off the sums again (computed once per block of channels, from the weights the block reads anyway).
// Without AMX, a query's product (up to kShortRows tokens) takes a path of its own (short_gemm): bound by the
// weights' stream, it runs as ember's bf16 product does, in register blocks of its own token count, not tiles of 16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "strips.h"
#include "vec.h"
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define EMBER_AMX 1
#include "amx.h"
#else
#define EMBER_AMX 0
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <type_traits>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512BF16__) || \
    (!EMBER_AMX && !defined(__AVX512VNNI__))
#error "needs AVX-512 BF16 and AMX int8 or AVX-512 VNNI"
#endif

using ember_vec::bf16;

namespace {

constexpr int64_t kTile = 1024;          // bytes per packed weight tile: 16 rows (of 4 inputs) x 16 channels x 4
constexpr int64_t kChunkBytes = 256 << 10;  // activations per token chunk: a quarter of L2

// Rows of a 16 x 32 int32 block (row stride 32) -> out, times the channels' and tokens' scales, plus the
// channels' bias where there is one (bias: nullptr).
// Glu: the block's first 16 channels are gates and the next 16 their up projections (pack order of a
// SwiGLU layer); writes the 16 values silu(gate) * up (vec.h: exp2 by a polynomial, rcp14's reciprocal, far
// inside the bf16 rounding or int8 step after it).
template <typename Out, bool Glu>
void store_rows(const int32_t* c, int64_t rows, const float* ws, const float* xs, const float* bias, Out* out,
                int64_t ldo) {
  const __m512 s0 = _mm512_loadu_ps(ws), s1 = _mm512_loadu_ps(ws + 16);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 t = _mm512_set1_ps(xs[r]);
    const __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32)), s0), t, b0);
    const __m512 b = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 32 + 16)), s1), t, b1);
    if constexpr (Glu) {
      const __m512 h = ember_vec::silu_mul_ps(a, b);
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

// 16 values of a row of activations, as float32.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const bf16* x) { return ember_vec::load_bf16(x); }

// One token's K activations -> int8 in the tile buffer (64 inputs per k step, kTile bytes apart), quantised
// symmetrically as ember.ops.quant._quantize_tokens does, to the bit: q = round(x * (127 / amax)) with
// amax = max|x| (at least 1e-8), ties to even, where 127 / amax is torch's (1 / amax) * 127; returns the
// token's scale amax / 127.
template <typename In>
float quantize_row(const In* x, int64_t K, int8_t* dst, int64_t chunk = kTile) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + k)));
  const float amax = std::max(_mm512_reduce_max_ps(m), 1e-8f);
  const __m512 inv = _mm512_set1_ps(1.f / amax * 127.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 64) {
    for (int j = 0; j < 4; ++j) {
      __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k + 16 * j), inv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
      __m512i qi = _mm512_cvtps_epi32(q);
      if constexpr (!EMBER_AMX) qi = _mm512_add_epi32(qi, _mm512_set1_epi32(128));  // VPDPBUSD: unsigned bytes
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k / 64 * chunk + 16 * j), _mm512_cvtepi32_epi8(qi));
    }
  }
  return amax / 127.f;
}

// The activations re-laid tile by tile into a, [M/16][K/64][16][64], the last tile zero padded, so every
// tile load reads 1 KB in a row (measured as fast as loading rows K bytes apart, and one layout for the
// padded tail and the rest). In: int8 (already quantised; xs is left alone) or bf16 / float32, quantised
// per token on the way, their scales written to xs.
template <typename In>
void relayout(const In* x, int64_t M, int64_t K, int64_t lda, int8_t* a, float* xs) {
  const int64_t ksteps = K / 64, mtiles = (M + 15) / 16;
  at::parallel_for(0, mtiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = t * 16 + r;
        int8_t* dst = a + t * 16 * K + r * 64;
        if (row >= M) {
          for (int64_t k = 0; k < ksteps; ++k) std::memset(dst + k * kTile, 0, 64);
        } else if constexpr (std::is_same_v<In, int8_t>) {
          for (int64_t k = 0; k < ksteps; ++k) {
            __m512i v = _mm512_loadu_si512(x + row * lda + k * 64);
            if constexpr (!EMBER_AMX) v = _mm512_xor_si512(v, _mm512_set1_epi8(-128));  // + 128, as unsigned
            _mm512_storeu_si512(dst + k * kTile, v);
          }
        } else {
          xs[row] = quantize_row(x + row * lda, K, dst);
        }
      }
    }
  });
}

// The next block's weights, pulled into L2 a few lines per k step while this block computes.
struct Prefetch {
  const char* next;
  int64_t lines, per_step, fetched;
  void step() {
    if (next)
      for (int64_t q = 0; q < per_step && fetched < lines; ++q, ++fetched) _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
  }
};

// One block of 32 channels: its two 16-channel weight columns (and, for VNNI, 128 x each channel's weight sum).
struct Block {
  const int8_t *b0, *b1;
  __m512i offset0, offset1;
};

#if EMBER_AMX
inline Block begin_block(const int8_t* b0, const int8_t* b1, int64_t) {
  return {b0, b1, _mm512_setzero_si512(), _mm512_setzero_si512()};
}

// c0 (and c1 when `two`), 16 x 32 int32, row stride 32 = the 16 tokens of the tile at `a` (and of the next
// tile) x the block's 32 channels: 2 x 2 result tiles.
inline void block_product(const int8_t* a, bool two, int64_t ksteps, const Block& blk, Prefetch& prefetch,
                          int32_t* c0, int32_t* c1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < ksteps; ++k) {
    _tile_loadd(4, a + k * kTile, 64);
    _tile_loadd(6, blk.b0 + k * kTile, 64);
    _tile_loadd(7, blk.b1 + k * kTile, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    prefetch.step();
    if (two) {
      _tile_loadd(5, a + (ksteps + k) * kTile, 64);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, c0, 128);
  _tile_stored(1, c0 + 16, 128);
  if (two) {
    _tile_stored(2, c1, 128);
    _tile_stored(3, c1 + 16, 128);
  }
}
#else
// 128 x the sum of each channel's weights (VPDPBUSD with bytes of 1), what the +128 on the activations adds.
inline Block begin_block(const int8_t* b0, const int8_t* b1, int64_t ksteps) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int64_t i = 0; i < ksteps * 16; ++i) {
    s0 = _mm512_dpbusd_epi32(s0, ones, _mm512_loadu_si512(b0 + i * 64));
    s1 = _mm512_dpbusd_epi32(s1, ones, _mm512_loadu_si512(b1 + i * 64));
  }
  return {b0, b1, _mm512_slli_epi32(s0, 7), _mm512_slli_epi32(s1, 7)};
}

// The same product with VPDPBUSD: 8 tokens x 32 channels in 16 registers; each step broadcasts 4 inputs of
// a token (one 32-bit word of its row in the tile layout) against a weight tile's row (16 channels x the
// same 4 inputs: one 64-byte vector).
inline void rows_product(const int8_t* a, int64_t ksteps, const Block& blk, Prefetch& prefetch, int32_t* c) {
  constexpr int R = 8;
  __v16si acc[R][2];  // GCC's own int32 vectors, as short_block's sums (there, why)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = __v16si{};
  for (int64_t k = 0; k < ksteps; ++k) {
    const int8_t *ak = a + k * kTile, *w0 = blk.b0 + k * kTile, *w1 = blk.b1 + k * kTile;
    for (int j = 0; j < 16; ++j) {
      const __m512i v0 = _mm512_loadu_si512(w0 + j * 64), v1 = _mm512_loadu_si512(w1 + j * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, ak + r * 64 + 4 * j, sizeof(word));
        const __v16si x = (__v16si)_mm512_set1_epi32(word);
        acc[r][0] = __builtin_ia32_vpdpbusd_v16si(acc[r][0], x, (__v16si)v0);
        acc[r][1] = __builtin_ia32_vpdpbusd_v16si(acc[r][1], x, (__v16si)v1);
      }
    }
    prefetch.step();
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_store_si512(c + r * 32, _mm512_sub_epi32((__m512i)acc[r][0], blk.offset0));
    _mm512_store_si512(c + r * 32 + 16, _mm512_sub_epi32((__m512i)acc[r][1], blk.offset1));
  }
}

inline void block_product(const int8_t* a, bool two, int64_t ksteps, const Block& blk, Prefetch& prefetch,
                          int32_t* c0, int32_t* c1) {
  rows_product(a, ksteps, blk, prefetch, c0);  // tokens 0-7 of the tile (rows 64 bytes apart)
  rows_product(a + 8 * 64, ksteps, blk, prefetch, c0 + 8 * 32);
  if (two) {
    rows_product(a + ksteps * kTile, ksteps, blk, prefetch, c1);
    rows_product(a + ksteps * kTile + 8 * 64, ksteps, blk, prefetch, c1 + 8 * 32);
  }
}
#endif

#if !EMBER_AMX
// A short product (a query: up to kShortRows tokens) on AVX-512 VNNI reads every weight of the layer once for a few
// multiply-adds each, so it is bound by the weights' stream, as ember's bf16 product is (linear_bf16.cpp), and runs
// the same way: the tokens in register blocks of their own count (up to kRows: 28 sums, two weights, x's word),
// not in tiles of 16 padded with zeros; one 32-channel block (tiles b0 and b1) for all of them at a time, the block
// a thread computes next prefetched in order by this block's passes, blocks claimed from one counter (strips.h).
// The weights' sums (the VPDPBUSD offset) are taken by the first pass, from the words it reads anyway.
constexpr int kRows = 14;
constexpr int64_t kShortRows = 2 * kRows;

// c (R x 32, row stride 32) = R tokens (xq: offset by 128 as unsigned bytes, K a token) times the 32 channels of b0
// and b1, less 128 x the channels' weight sums (off0, off1: taken here when Sums, else given).
// pf (or null): this pass's share of the next block, `lines` cache lines.
template <int R, bool Sums>
__attribute__((noinline)) void short_block(const uint8_t* xq, int64_t K, const int8_t* b0, const int8_t* b1,
                                           __m512i& off0, __m512i& off1, int32_t* c, const char* pf, int64_t lines) {
  const int64_t ksteps = K / 64, steps = ksteps * 16, per = (lines + steps - 1) / steps;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  // the sums as GCC's own int32 vectors: held as __m512i (8 x int64) and converted for every VPDPBUSD, GCC keeps
  // them on the stack
  __v16si acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = __v16si{};
  for (int64_t k = 0, q = 0; k < ksteps; ++k) {
    const int8_t *w0 = b0 + k * kTile, *w1 = b1 + k * kTile;
    const uint8_t* xk = xq + k * 64;
    for (int j = 0; j < 16; ++j) {
      if (pf)
        for (const int64_t end = std::min(lines, q + per); q < end; ++q) _mm_prefetch(pf + q * 64, _MM_HINT_T1);
      const __m512i v0 = _mm512_loadu_si512(w0 + j * 64), v1 = _mm512_loadu_si512(w1 + j * 64);
      if constexpr (Sums) {
        s0 = _mm512_dpbusd_epi32(s0, ones, v0);
        s1 = _mm512_dpbusd_epi32(s1, ones, v1);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xk + r * K + 4 * j, sizeof(word));
        const __v16si x = (__v16si)_mm512_set1_epi32(word);
        acc[r][0] = __builtin_ia32_vpdpbusd_v16si(acc[r][0], x, (__v16si)v0);
        acc[r][1] = __builtin_ia32_vpdpbusd_v16si(acc[r][1], x, (__v16si)v1);
      }
    }
  }
  if constexpr (Sums) {
    off0 = _mm512_slli_epi32(s0, 7);
    off1 = _mm512_slli_epi32(s1, 7);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_store_si512(c + r * 32, _mm512_sub_epi32((__m512i)acc[r][0], off0));
    _mm512_store_si512(c + r * 32 + 16, _mm512_sub_epi32((__m512i)acc[r][1], off1));
  }
}

// short_block for a run-time token count 1 .. R.
template <int R = kRows>
inline void short_any(int rows, bool sums, const uint8_t* xq, int64_t K, const int8_t* b0, const int8_t* b1,
                      __m512i& off0, __m512i& off1, int32_t* c, const char* pf, int64_t lines) {
  if constexpr (R > 0) {
    if (rows == R)
      return sums ? short_block<R, true>(xq, K, b0, b1, off0, off1, c, pf, lines)
                  : short_block<R, false>(xq, K, b0, b1, off0, off1, c, pf, lines);
    short_any<R - 1>(rows, sums, xq, K, b0, b1, off0, off1, c, pf, lines);
  }
}

// c (M x 32) = the M <= kShortRows tokens (xq, K bytes a token) times one 32-channel block (its tiles from b0), in
// register blocks as even as they can be; next (or null): the block this thread computes after it, prefetched in
// equal shares by the passes.
inline void short_strip(const uint8_t* xq, int64_t M, int64_t K, const int8_t* b0, const char* next, int32_t* c) {
  const int64_t ksteps = K / 64, lines = 2 * ksteps * kTile / 64, blocks = (M + kRows - 1) / kRows;
  __m512i off0 = _mm512_setzero_si512(), off1 = _mm512_setzero_si512();
  ember_strips::row_blocks(M, blocks, [&](int64_t b, int64_t m, int64_t n) {
    const int64_t lo = b * lines / blocks, hi = (b + 1) * lines / blocks;
    short_any(int(n), b == 0, xq + m * K, K, b0, b0 + ksteps * kTile, off0, off1, c + m * 32,
              next ? next + lo * 64 : nullptr, hi - lo);
  });
}

// gemm for M <= kShortRows tokens: x quantised (or, int8 already, offset) row by row, then the blocks of channels.
template <typename Out, bool Glu, typename In>
bool short_gemm(const In* x, int64_t M, int64_t K, int64_t lda, const int8_t* w, int64_t N, const float* ws,
                const float* xs, const float* bias, Out* out, int64_t ldo) {
  alignas(64) float own_xs[kShortRows];
  std::unique_ptr<int8_t, decltype(&std::free)> xq(static_cast<int8_t*>(std::aligned_alloc(64, M * K)), &std::free);
  if (!xq) return false;
  for (int64_t r = 0; r < M; ++r) {
    int8_t* dst = xq.get() + r * K;
    if constexpr (std::is_same_v<In, int8_t>) {
      for (int64_t k = 0; k < K; k += 64)  // + 128, as unsigned
        _mm512_storeu_si512(dst + k, _mm512_xor_si512(_mm512_loadu_si512(x + r * lda + k), _mm512_set1_epi8(-128)));
    } else {
      own_xs[r] = quantize_row(x + r * lda, K, dst, 64);
    }
  }
  if constexpr (!std::is_same_v<In, int8_t>) xs = own_xs;
  const int64_t ksteps = K / 64, nblocks = N / 32, block = 2 * ksteps * kTile;
  ember_strips::claim(nblocks, [&](int64_t nb, int64_t after) {
    alignas(64) int32_t c[kShortRows * 32];
    const char* next = after < nblocks ? reinterpret_cast<const char*>(w + after * block) : nullptr;
    short_strip(reinterpret_cast<const uint8_t*>(xq.get()), M, K, w + nb * block, next, c);
    store_rows<Out, Glu>(c, M, ws + nb * 32, xs, bias ? bias + nb * 32 : nullptr, out + nb * (Glu ? 16 : 32), ldo);
  });
  return true;
}
#endif

// x: int8 with its tokens' scales in xs, or bf16 / float32 (In) quantised here, xs then unused (nullptr).
template <typename Out, bool Glu, typename In>
bool gemm(const In* x, int64_t M, int64_t K, int64_t lda, const int8_t* w, int64_t N, const float* ws,
          const float* xs, const float* bias, Out* out, int64_t ldo) {
#if !EMBER_AMX
  if (M <= kShortRows) return short_gemm<Out, Glu>(x, M, K, lda, w, N, ws, xs, bias, out, ldo);
#endif
  const int64_t ksteps = K / 64, nblocks = N / 32, mtiles = (M + 15) / 16;
  // the re-laid activations, then (for activations quantised here) the tokens' scales
  const int64_t a_bytes = mtiles * 16 * K, xs_bytes = std::is_same_v<In, int8_t> ? 0 : mtiles * 16 * 4;
  std::unique_ptr<int8_t, decltype(&std::free)> a(static_cast<int8_t*>(std::aligned_alloc(64, a_bytes + xs_bytes)),
                                                   &std::free);
  if (!a) return false;
  float* own_xs = xs_bytes ? reinterpret_cast<float*>(a.get() + a_bytes) : nullptr;
  relayout(x, M, K, lda, a.get(), own_xs);
  if (own_xs) xs = own_xs;
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (16 * K) / 2 * 2);  // tiles of tokens, even

  at::parallel_for(0, nblocks, 1, [&](int64_t nb0, int64_t nb1) {
#if EMBER_AMX
    ember_amx::load_tile_config();
#endif
    alignas(64) int32_t c[2][16 * 32];
    // The result tiles for tokens 16 t.. (already stored in c[i]) -> out.
    auto emit = [&](int64_t t, int64_t nb, const int32_t* ci) {
      store_rows<Out, Glu>(ci, std::min<int64_t>(16, M - t * 16), ws + nb * 32, xs + t * 16,
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
        Prefetch prefetch{next, lines, per_step, 0};
        const Block block = begin_block(b0, b1, ksteps);
        for (int64_t t = t0; t < t1; t += 2) {
          const bool two = t + 1 < t1;
          block_product(a.get() + t * ksteps * kTile, two, ksteps, block, prefetch, c[0], c[1]);
          emit(t, nb, c[0]);
          if (two) emit(t + 1, nb, c[1]);
        }
      }
    }
#if EMBER_AMX
    _tile_release();
#endif
  });
  return true;
}

}  // namespace

extern "C" {

// 1 when the kernel can run here: built for AVX-512 VNNI, or for AMX and Linux grants this process the tile state.
int ember_int8_gemm_usable() {
#if EMBER_AMX
  return ember_amx::tiles_usable();
#else
  return 1;
#endif
}

// The instruction set its products were built for: "amx" or "avx512_vnni".
const char* ember_int8_gemm_isa() { return EMBER_AMX ? "amx" : "avx512_vnni"; }

// out (M, N), row stride ldo: bf16 (out_float 0) or float32 (1) = (x @ w^T) * ws[n] * xs[m] + bias[n] (bias
// may be null), where x is (M, K) with row stride lda: int8 (x_type 0) with its tokens' scales xs, or bf16 (1)
// or float32 (2) activations that the kernel quantises per token itself (xs unused); w the packed weights.
// With glu, out is (M, N / 2): silu(gate) * up, for weights packed with gates and ups alternating in blocks
// of 16 channels. Returns 0; 1 for unsupported shapes (K a multiple of 64 and N of 32 are needed) or types;
// 2 when its buffer cannot be allocated.
int ember_int8_gemm(const void* x, int x_type, int64_t M, int64_t K, int64_t lda, const int8_t* w, int64_t N,
                    const float* ws, const float* xs, const float* bias, void* out, int64_t ldo, int out_float,
                    int glu) {
  if (K % 64 != 0 || N % 32 != 0 || M < 1 || x_type < 0 || x_type > 2 || (x_type == 0 && !xs)) return 1;
  auto run = [&](auto* in) {
    if (out_float && glu) return gemm<float, true>(in, M, K, lda, w, N, ws, xs, bias, static_cast<float*>(out), ldo);
    if (out_float) return gemm<float, false>(in, M, K, lda, w, N, ws, xs, bias, static_cast<float*>(out), ldo);
    if (glu) return gemm<bf16, true>(in, M, K, lda, w, N, ws, xs, bias, static_cast<bf16*>(out), ldo);
    return gemm<bf16, false>(in, M, K, lda, w, N, ws, xs, bias, static_cast<bf16*>(out), ldo);
  };
  bool done;
  if (x_type == 0)
    done = run(static_cast<const int8_t*>(x));
  else if (x_type == 1)
    done = run(static_cast<const bf16*>(x));
  else
    done = run(static_cast<const float*>(x));
  return done ? 0 : 2;
}

}  // extern "C"

// The same product as torch's operator ember::int8_gemm (schema and shape function: ember.ops.quant), so that
// compiled regions call it through the dispatcher with no Python in between (~20 us a call through Python).
namespace {

at::Tensor int8_gemm_op(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& w_scale,
                        const std::optional<at::Tensor>& x_scale, const std::optional<at::Tensor>& bias,
                        at::ScalarType out_dtype, bool glu) {
  TORCH_CHECK(x_in.dim() == 2, "int8_gemm: x must be (T, K)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t t = x.size(0), k = x.size(1), n = w_scale.size(0), width = glu ? n / 2 : n;
  const at::ScalarType in = x.scalar_type();
  const int x_type = in == at::kChar ? 0 : in == at::kBFloat16 ? 1 : in == at::kFloat ? 2 : -1;
  const at::Tensor xs = x_scale ? x_scale->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({t, width}, x.options().dtype(out_dtype));
  const int status = ember_int8_gemm(
      x.data_ptr(), x_type, t, k, x.stride(0), static_cast<const int8_t*>(tiles.data_ptr()), n,
      w_scale.data_ptr<float>(), xs.defined() ? xs.data_ptr<float>() : nullptr,
      bias ? bias->data_ptr<float>() : nullptr, out.data_ptr(), width, out_dtype == at::kFloat ? 1 : 0, glu ? 1 : 0);
  TORCH_CHECK_WITH(OutOfMemoryError, status != 2, "native int8 product: no memory for its working buffers");
  TORCH_CHECK(status == 0, "native int8 product (T, K, N) = (", t, ", ", k, ", ", n, ") on ", in, ": shapes refused");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("int8_gemm", &int8_gemm_op);
}
