// Flash attention over packed variable-length sequences, for every x86-64 tier from AVX2 up and for aarch64: bf16
// in and out where the CPU has AVX-512 BF16 (AMX tiles, or `vdpbf16ps` register blocks), float32 in and out
// everywhere (register blocks of 16-lane FMAs on AVX-512, the path of Xeons without AVX-512 BF16; of 8-lane FMAs
// elsewhere: AVX2 on x86-64, for the AVX2-only Xeons where torch's bf16 is not fast, and NEON on aarch64, e.g.
// Graviton).
//
// Built at run time by ember.ops.native (g++ -march=native, against the installed torch's headers),
// loaded with ctypes; torch's at::parallel_for runs it on torch's own OpenMP pool. One structure (the work items,
// the blocks, the online softmax: `attend`, `attend_item`) serves both element types; what differs by instruction
// set are the inner loops, overloaded on the element type: the two matrix products per block (`tile_gemm`: AMX
// tile loops where the compiler targets AMX, else AVX-512 BF16 register blocks for bf16; for float32, FMA register
// blocks written once against F32Lanes: 16 lanes where it targets AVX-512, else vec.h's 8-lane f32x8), the softmax
// of a row, and the packing of keys and values. oneDNN's brgemm micro-kernels measured 2-3x slower than the tile loops
// at these small shapes (64 x 64 x 128).
// What it does that torch's CPU flash attention does not:
//   - every sequence of a batch in one call (cu_seqlens), reading q/k/v in place and writing the
//     packed (T, Hq, D) output, with no per-sequence call, gather or copy;
//   - causal blocks end at the diagonal (torch computes whole 512-key blocks, so at <= 512 tokens it
//     does the masked half of the work too);
//   - exp as 2^x: one FMA into base 2, a polynomial (degree 3 for bf16 probabilities, 5 for float32) and the
//     exponent; the running max is raised only when a block exceeds it by 2^8, so most blocks skip rescaling the
//     output rows, and a row's later blocks take one pass over their scores (checking that bound as they go)
//     instead of two;
//   - blocks sized to the batch (query rows x keys): 32 x 32 for short sequences (a query of 20 tokens
//     computes 1/4 of a 64 x 64 block's work), 32 x 64, 32 x 128 (a work item's scores, probabilities and
//     output rows stay in L1), and 64 x 256 for long ones (each item streams every key block before it,
//     so from ~6,000 tokens taller items read the keys and values from memory half as often; 128 x 128 from
//     ~3,000 on AMD Zen 1-3; bf16 without AMX keeps 32 x 128, its key blocks in strips of 32 columns); a partly
//     empty key block (the end of a sequence, or the diagonal) is computed only up to the next multiple
//     of 32 keys, and the first block's P V writes the output rows instead of adding to zeros.
// One parallel region per call: the threads first pack K and V of the whole batch (into a buffer freed
// on return), then take work items (sequence, kv head, query block: the query heads sharing a kv head
// go together) from one atomic counter, a few at a time, longest sequences first, so they stay
// balanced under the causal triangle.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define EMBER_BF16 1
#else
#define EMBER_BF16 0
#endif
#if EMBER_BF16 && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define EMBER_AMX 1
#include "amx.h"
#else
#define EMBER_AMX 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#if !EMBER_F32X8
#error "needs AVX2 and FMA (x86-64), or aarch64"
#endif

using ember_vec::bf16;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxHead = 256;

struct Item {
  int32_t seq, head, qblock, kvfirst, kvblocks;  // head: the kv head; key blocks [kvfirst, kvfirst + kvblocks)
};

// Where A's rows are, 16 at a time: tile t (rows 16 t .. 16 t + 15) starts at row[t], its rows ld[t]
// elements apart; or all of A at one pointer with one row stride. live[t]: how many of tile t's rows, from its
// first, are its sequence's (the rest is padding, whose rows of C the products may skip; null: all 16).
template <typename T>
struct RowTiles {
  const T* const* row;
  const int64_t* ld;
  const T* a;
  int64_t lda;
  const uint8_t* live = nullptr;
  const T* start(int64_t t) const { return row ? row[t] : a + t * 16 * lda; }
  int64_t stride(int64_t t) const { return row ? ld[t] : lda; }
  int rows(int64_t t) const { return live ? live[t] : 16; }
};

// ---- float32 ----------------------------------------------------------------------------------------------------
// The products and the softmax are written once against F32Lanes: 16 lanes (one AVX-512 register) where the compiler
// targets AVX-512 (Skylake-SP and later Xeons, Zen 4/5), else 8 (ember_vec::f32x8: one AVX2 register, or two NEON
// registers). The row helpers after them are 8-lane everywhere.

using ember_vec::f32x8;
using ember_vec::load8;
using ember_vec::store8;
using ember_vec::set8;
using ember_vec::fma8;

#if EMBER_F32X16
// Scores outside [from, keep) (a window's band, the causal mask, and keys past the sequence's end) count as -inf:
// masked in the loads, not written into the row (scalar stores there stalled the vector loads behind them).
inline __m512 load_scores(const float* s, int64_t j, int64_t from, int64_t keep) {
  const int64_t valid = std::clamp<int64_t>(keep - j, 0, 16), before = std::clamp<int64_t>(from - j, 0, 16);
  const __mmask16 m = static_cast<__mmask16>(((1u << valid) - 1) & ~((1u << before) - 1));
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), m, s + j);
}

// attention's additions to the shared lanes: how a register block splits 32 rows, the masked loads of scores,
// and 2^x.
struct F32Lanes : ember_vec::F32Lanes {
  // 32 rows of a register block as 12 + 12 + 8: 24 sums (of 32 registers), two loads of B and one broadcast a step.
  // (8 + 8 + 8 + 8 ran at 0.88x.)
  using Split = std::integer_sequence<int, 12, 12, 8>;
  using Full = Split;  // where all 32 rows are the sequence's
  static V load_scores(const float* s, int64_t j, int64_t from, int64_t keep) { return ::load_scores(s, j, from, keep); }
  static V exp2(V t) { return ember_vec::exp2_ps<5, false>(t); }
};
#else
struct F32Lanes : ember_vec::F32Lanes {
  // 32 rows as 5 x 6 + 2: 12 sums (of AVX2's 16 registers; 24 of NEON's 32), 12 FMAs for 8 loads a step. Where
  // all 32 are the sequence's, 2 x 6 + 4 x 5 instead: the 2-row block's 4 sums cannot keep both FMA pipes busy
  // (8,000 tokens 1.00-1.09x), and a short tile's rows still end in as few blocks (18 rows: 6 + 6 + 6).
  using Split = std::integer_sequence<int, 6, 6, 6, 6, 6, 2>;
  using Full = std::integer_sequence<int, 6, 6, 5, 5, 5, 5>;
  static V load_scores(const float* s, int64_t j, int64_t from, int64_t keep) {
    return ember_vec::load8_in(s, j, from, keep, -std::numeric_limits<float>::infinity());
  }
  static V exp2(V t) { return ember_vec::exp2_ps<5, false>(t); }
};
#endif
using FV = F32Lanes::V;
constexpr int kW = F32Lanes::kWidth;
constexpr int64_t kStripF32 = 2 * kW;  // columns of B per strip, as tile_gemm reads them and pack_kv lays them out

// R rows x 2W columns of C (row stride ldc) = or += R rows of A (at a[r]) x a strip of B (K x 2W, row stride ldb):
// 2 R registers of sums; each step broadcasts one of A's columns per row and loads one row of B (two registers).
template <int R, bool Accumulate>
inline void rows_block(const float* const* a, const float* b, int64_t K, int64_t ldb, float* c, int64_t ldc) {
  using L = F32Lanes;
  FV acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = Accumulate ? L::load(c + r * ldc) : L::zero();
    acc[r][1] = Accumulate ? L::load(c + r * ldc + kW) : L::zero();
  }
  for (int64_t k = 0; k < K; ++k, b += ldb) {
    const FV b0 = L::load(b), b1 = L::load(b + kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const FV x = L::set(a[r][k]);
      acc[r][0] = L::fma(x, b0, acc[r][0]);
      acc[r][1] = L::fma(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    L::store(c + r * ldc, acc[r][0]);
    L::store(c + r * ldc + kW, acc[r][1]);
  }
}

// The 32 rows at `row` times one strip of B, as F32Lanes::Split's blocks; those starting at `live` or later (all
// padding) are skipped.
template <bool Accumulate, int... Rows>
inline void rows_32(std::integer_sequence<int, Rows...>, int live, const float* const* row, const float* b,
                    int64_t K, int64_t ldb, float* c, int64_t ldc) {
  int r = 0;
  ((r < live ? rows_block<Rows, Accumulate>(row + r, b, K, ldb, c + r * ldc, ldc) : void(), r += Rows), ...);
}

// C (M x N fp32, row stride ldc) = or += A (M x K, its rows by RowTiles) x B (K x N), B held in strips of 2 kW
// columns, each K x 2 kW contiguous and the next `strip` elements on. M, N, K are multiples of 32. Rows outside,
// column strips inside: 32 rows of A and one strip of B stay in L1 while the register blocks pass them (a strip
// read out of a row-major B, rows 512 bytes apart, fell into 8 of L1's 64 sets and came from L2 for every block).
// Register blocks of padding rows are skipped (a query of 15 tokens in blocks of 32 rows computes 18 of them).
template <bool Accumulate>
void tile_gemm(int64_t M, int64_t N, int64_t K, const RowTiles<float>& A, const float* B, int64_t strip, float* C,
               int64_t ldc) {
  for (int64_t i = 0; i < M; i += 32) {
    const int first = A.rows(i / 16), live = first < 16 ? first : 16 + A.rows(i / 16 + 1);
    if (live == 0) continue;
    const float* row[32];
    for (int r = 0; r < 32; ++r) row[r] = A.start((i + r) / 16) + ((i + r) % 16) * A.stride((i + r) / 16);
    for (int64_t j = 0; j < N; j += kStripF32) {
      const float* b = B + j / kStripF32 * strip;
      if (live == 32) rows_32<Accumulate>(F32Lanes::Full{}, live, row, b, K, kStripF32, C + i * ldc + j, ldc);
      else rows_32<Accumulate>(F32Lanes::Split{}, live, row, b, K, kStripF32, C + i * ldc + j, ldc);
    }
  }
}

// softmax_row below (the bf16 one), in float32: the same lazy reference and one-pass blocks, 2^x of degree 5 (~3e-6,
// float32 attention's accuracy); the row's partial sums are sum[0 .. W - 1] (any others stay 0).
inline float softmax_row(const float* s, int64_t from, int64_t keep, float* p, int64_t n, float c, float& ref,
                         float* sum) {
  using L = F32Lanes;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const FV vc = L::set(c);
  if (ref != kNegInf) {
    const FV off = L::set(-ref);
    FV acc = L::zero(), top = L::set(kNegInf);
    for (int64_t j = 0; j < n; j += kW) {
      const FV t = L::fma(L::load_scores(s, j, from, keep), vc, off);
      top = L::max(top, t);
      const FV e = L::exp2(t);
      acc = L::add(acc, e);
      L::store(p + j, e);
    }
    if (!L::any_above(top, 8.f)) {
      L::store(sum, L::add(L::load(sum), acc));
      return 1.f;
    }
  }
  FV m = L::load_scores(s, 0, from, keep);
  for (int64_t j = kW; j < n; j += kW) m = L::max(m, L::load_scores(s, j, from, keep));
  const float mx = L::max_of(m) * c;
  float factor = 1.f;
  if (mx > ref + 8.f) {
    factor = ref == kNegInf ? 0.f : std::exp2(ref - mx);
    ref = mx;
  }
  const FV off = L::set(-ref);
  FV acc = L::zero();
  for (int64_t j = 0; j < n; j += kW) {
    const FV e = L::exp2(L::fma(L::load_scores(s, j, from, keep), vc, off));
    acc = L::add(acc, e);
    L::store(p + j, e);
  }
  L::store(sum, L::fma(L::load(sum), L::set(factor), acc));
  return factor;
}

// A row of the output times a (both element types: rare, when a row's reference is raised).
inline void scale_row(float* o, int64_t d, float a) {
  const f32x8 va = set8(a);
  for (int64_t j = 0; j < d; j += 8) store8(o + j, ember_vec::mul8(load8(o + j), va));
}

// The sum of a row's 16 partial sums (both element types).
inline float row_total(const float* sum) { return ember_vec::sum_of8(ember_vec::add8(load8(sum), load8(sum + 8))); }

inline void store_row(const float* o, float* dst, int64_t d, float a) {
  const f32x8 va = set8(a);
  for (int64_t j = 0; j < d; j += 8) store8(dst + j, ember_vec::mul8(load8(o + j), va));
}

// One key block (N rows of D, zero past `rows`) in the layouts tile_gemm reads, strips of 2 kW columns: K^T as
// [N / 2 kW][D][2 kW] (8 x 8 transposes), V as [D / 2 kW][N][2 kW].
template <int N>
void pack_kv(const float* k, const float* v, int64_t sk, int64_t sv, int64_t rows, int64_t d, float* kp, float* vp) {
  for (int64_t n0 = 0; n0 < N; n0 += 8) {
    float* dst = kp + n0 / kStripF32 * d * kStripF32 + n0 % kStripF32;
    for (int64_t j0 = 0; j0 < d; j0 += 8) {
      f32x8 r[8];
      for (int64_t n = 0; n < 8; ++n) r[n] = n0 + n < rows ? load8(k + (n0 + n) * sk + j0) : ember_vec::zero8();
      ember_vec::transpose8(r);
      for (int64_t j = 0; j < 8; ++j) store8(dst + (j0 + j) * kStripF32, r[j]);
    }
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < d; j += kStripF32) {
      float* dst = vp + j / kStripF32 * N * kStripF32 + n * kStripF32;
      if (n < rows) std::memcpy(dst, v + n * sv + j, kStripF32 * sizeof(float));
      else std::memset(dst, 0, kStripF32 * sizeof(float));
    }
}

// ---- bf16, AVX-512 BF16 or AMX ---------------------------------------------------------------------------------
#if EMBER_BF16


// C (M x N fp32, row stride ldc) = or += A (M x K bf16, its rows by RowTiles) x B, where B is K x N in the
// VNNI layout [K/2][ldb][2]. M, N, K are multiples of 32.
#if EMBER_AMX
// AMX: 2 x 2 result tiles per step.
template <bool Accumulate>
void tile_gemm(int64_t M, int64_t N, int64_t K, const RowTiles<bf16>& A, const bf16* B, int64_t ldb, float* C,
               int64_t ldc) {
  for (int64_t i = 0; i < M; i += 32) {
    if (A.rows(i / 16) == 0) continue;  // (then the second tile is padding too)
    const bf16 *a0 = A.start(i / 16), *a1 = A.start(i / 16 + 1);
    const int64_t s0 = A.stride(i / 16) * 2, s1 = A.stride(i / 16 + 1) * 2;
    for (int64_t j = 0; j < N; j += 32) {
      float* c = C + i * ldc + j;
      if constexpr (Accumulate) {
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < K; k += 32) {
        const bf16* b = B + (k / 2) * ldb * 2 + j * 2;
        _tile_loadd(4, a0 + k, s0);
        _tile_loadd(5, a1 + k, s1);
        _tile_loadd(6, b, ldb * 4);
        _tile_loadd(7, b + 32, ldb * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ldc * 4);
      _tile_stored(1, c + 16, ldc * 4);
      _tile_stored(2, c + 16 * ldc, ldc * 4);
      _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    }
  }
}

#else
// AVX-512 BF16: 8 rows x 32 columns of C in 16 registers. Each step takes a pair of A's columns (one 32-bit
// broadcast per row) and the matching pair of B's rows (two 16-column vectors): 16 vdpbf16ps for 2 loads
// and 8 broadcasts. Column strips outside, rows inside: a strip of B (K/2 x 32 pairs, contiguous, the next
// `strip` elements on: pack_kv's layout here) stays in L1 while every row of A passes it.
template <bool Accumulate>
void tile_gemm(int64_t M, int64_t N, int64_t K, const RowTiles<bf16>& A, const bf16* B, int64_t strip, float* C,
               int64_t ldc) {
  constexpr int R = 8;  // divides 16: a row block lies inside one of A's 16-row tiles
  for (int64_t j = 0; j < N; j += 32) {
    for (int64_t i = 0; i < M; i += R) {
      if (i % 16 >= A.rows(i / 16)) continue;  // padding rows only
      const int64_t lda = A.stride(i / 16);
      const bf16* a = A.start(i / 16) + (i % 16) * lda;
      float* c = C + i * ldc + j;
      __m512 acc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][0] = Accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
        acc[r][1] = Accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
      }
      const bf16* b = B + j / 32 * strip;
      for (int64_t k = 0; k < K; k += 2, b += 64) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, a + r * lda + k, sizeof(pair));
          const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(c + r * ldc, acc[r][0]);
        _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
      }
    }
  }
}
#endif

// 2^t for t <= 8 (scores are at most 8 above the row's reference): vec.h's degree-3 polynomial.
inline __m512 exp2_approx(__m512 t) { return ember_vec::exp2_ps<3, false>(t); }

// Scores -> bf16 probabilities for one row of n (a multiple of 32), of which [from, keep) are unmasked,
// in base 2: p = 2^(s * c - ref), c = scale * log2 e.
// `ref` (in/out) is the row's running reference: the largest scaled score seen, raised lazily: only
// when a block's max exceeds it by more than 8 (so p <= 256, exact enough in fp32 sums and bf16).
// Returns the factor (2^(old ref - new ref), 1 when unchanged) that earlier sums and outputs need,
// and adds this row's p to `sum` (16 partial sums) after scaling it by that factor.
// With a reference already set the row takes one pass, checking as it goes that no score exceeds it by
// more than 8, and is redone with the new reference when one does (rare after a row's first block).
template <bool kAll>
inline float softmax_row_as(const float* s, int64_t from, int64_t keep, bf16* p, int64_t n, float c, float& ref,
                            float* sum) {
  const auto load_scores = [&](const float* x, int64_t j, int64_t lo, int64_t hi) {
    return kAll ? _mm512_loadu_ps(x + j) : ::load_scores(x, j, lo, hi);
  };
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const __m512 vc = _mm512_set1_ps(c);
  if (ref != kNegInf) {
    const __m512 off = _mm512_set1_ps(-ref);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512 top = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < n; j += 32) {
      const __m512 t0 = _mm512_fmadd_ps(load_scores(s, j, from, keep), vc, off);
      const __m512 t1 = _mm512_fmadd_ps(load_scores(s, j + 16, from, keep), vc, off);
      top = _mm512_max_ps(top, _mm512_max_ps(t0, t1));
      const __m512 p0 = exp2_approx(t0), p1 = exp2_approx(t1);
      acc0 = _mm512_add_ps(acc0, p0), acc1 = _mm512_add_ps(acc1, p1);
      __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
      std::memcpy(p + j, &packed, sizeof(packed));
    }
    if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(8.f), _CMP_GT_OQ) == 0) {
      _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), _mm512_add_ps(acc0, acc1)));
      return 1.f;
    }
  }
  __m512 m0 = load_scores(s, 0, from, keep), m1 = load_scores(s, 16, from, keep);
  for (int64_t j = 32; j < n; j += 32) {
    m0 = _mm512_max_ps(m0, load_scores(s, j, from, keep));
    m1 = _mm512_max_ps(m1, load_scores(s, j + 16, from, keep));
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * c;
  float factor = 1.f;
  if (mx > ref + 8.f) {
    factor = ref == kNegInf ? 0.f : std::exp2(ref - mx);
    ref = mx;
  }
  const __m512 off = _mm512_set1_ps(-ref);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __m512 p0 = exp2_approx(_mm512_fmadd_ps(load_scores(s, j, from, keep), vc, off));
    const __m512 p1 = exp2_approx(_mm512_fmadd_ps(load_scores(s, j + 16, from, keep), vc, off));
    acc0 = _mm512_add_ps(acc0, p0), acc1 = _mm512_add_ps(acc1, p1);
    __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
    std::memcpy(p + j, &packed, sizeof(packed));
  }
  _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(factor), _mm512_add_ps(acc0, acc1)));
  return factor;
}

// softmax_row for bf16 probabilities: a row whose scores are all unmasked (most rows of a long sequence's blocks) loads
// them without the masks.
inline float softmax_row(const float* s, int64_t from, int64_t keep, bf16* p, int64_t n, float c, float& ref,
                         float* sum) {
  if (from == 0 && keep >= n) return softmax_row_as<true>(s, from, keep, p, n, c, ref, sum);
  return softmax_row_as<false>(s, from, keep, p, n, c, ref, sum);
}

inline void store_row(const float* o, bf16* dst, int64_t d, float a) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t j = 0; j < d; j += 32) {
    __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + j + 16), va),
                                          _mm512_mul_ps(_mm512_loadu_ps(o + j), va));
    std::memcpy(dst + j, &packed, sizeof(packed));
  }
}

// Transposes a 16 x 16 matrix of 32-bit words held in r[0..15] (rows) in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                  y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Where the pair row p of column c lies in a packed block of `cols` columns and `pairs` pair rows (32-bit words):
// for AMX, rows of all the columns ([pairs][cols], what a tile loads with one row stride); for AVX-512 BF16, strips
// of 32 columns ([cols / 32][pairs][32]), each contiguous: rows of all a block's 128 keys or 128 dimensions (512 B
// apart) put a strip in 8 of L1's 64 sets, and it was read from L2 (Zen 5, attention alone: 1.03-1.06x at 8,000
// tokens, level on short batches).
inline int64_t packed_word(int64_t p, int64_t c, int64_t pairs, int64_t cols) {
#if EMBER_AMX
  (void)pairs;
  return p * cols + c;
#else
  (void)cols;
  return (c / 32 * pairs + p) * 32 + c % 32;
#endif
}

// One key block (N rows of D, zero past `rows`) in the layout tile_gemm reads (packed_word):
// K^T as D/2 pair rows of N columns (B of Q K^T: a transpose of 32-bit pairs, 16 x 16 at a time),
// V as N/2 pair rows of D columns (B of P V: rows interleaved in pairs).
template <int N>
void pack_kv(const bf16* k, const bf16* v, int64_t sk, int64_t sv, int64_t rows, int64_t d, bf16* kp, bf16* vp) {
  const int64_t words = d / 2;
  auto* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    for (int64_t j0 = 0; j0 < words; j0 += 16) {
      __m512i r[16];
      for (int64_t n = 0; n < 16; ++n)
        r[n] = n0 + n < rows ? _mm512_loadu_si512(k + (n0 + n) * sk + 2 * j0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(kp32 + packed_word(j0 + j, n0, words, N), r[j]);
    }
  }
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  auto* vp32 = reinterpret_cast<uint32_t*>(vp);
  for (int64_t n = 0; n < N; n += 2) {
    for (int64_t j = 0; j < d; j += 32) {
      const __m512i a = n < rows ? _mm512_loadu_si512(v + n * sv + j) : _mm512_setzero_si512();
      const __m512i b = n + 1 < rows ? _mm512_loadu_si512(v + (n + 1) * sv + j) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp32 + packed_word(n / 2, j, N / 2, d), _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp32 + packed_word(n / 2, j + 16, N / 2, d), _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

#endif  // EMBER_BF16

// ---- the structure both element types share ---------------------------------------------------------------------

// A thread's buffers for one work item (bounded by the head count and size, kept between calls).
template <typename T>
struct Scratch {
  std::vector<T> qbuf, probs;
  std::vector<float> scores, acc, row_max, row_sum;
  std::vector<const T*> qrow;  // where each 16-row tile of the item's queries is read from
  std::vector<int64_t> qld;
  std::vector<uint8_t> live;  // how many of each 16-row tile's rows are the sequence's
  void resize(int64_t rows, int64_t keys, int64_t d) {
    qbuf.resize(rows * d), probs.resize(rows * keys), scores.resize(rows * keys), acc.resize(rows * d);
    row_max.resize(rows), row_sum.resize(rows * 16), qrow.resize(rows / 16), qld.resize(rows / 16);
    live.resize(rows / 16);
  }
};
template <typename T>
Scratch<T>& thread_scratch() {
  thread_local Scratch<T> scratch;
  return scratch;
}

// Work items: one query block of one sequence for all the query heads sharing a kv head (their
// scores are one matrix product against the same keys). Ordered by sequence and kv head, so items
// next to each other read the same keys and values; the costliest sequences first.
template <int BM, int BN>
std::vector<Item> work_items(const int64_t* cu, const std::vector<int64_t>& first, int64_t nseq, int64_t hkv,
                             bool causal, int64_t window) {
  std::vector<int64_t> order(nseq);
  for (int64_t s = 0; s < nseq; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cu[a + 1] - cu[a] > cu[b + 1] - cu[b]; });
  std::vector<Item> items;
  for (int64_t s : order) {
    const int64_t len = cu[s + 1] - cu[s], nb = first[s + 1] - first[s];
    for (int64_t g = 0; g < hkv; ++g)
      for (int64_t m = (len + BM - 1) / BM - 1; m >= 0; --m) {
        // the keys rows m BM .. m BM + BM - 1 see: up to the diagonal (causal), within the window (window >= 0)
        int64_t lo = 0, hi = causal ? std::min<int64_t>(len, m * BM + BM) : len;
        if (window >= 0) lo = std::max<int64_t>(0, m * BM - window), hi = std::min(hi, m * BM + BM + window);
        const int64_t b0 = lo / BN, b1 = std::min<int64_t>(nb, (hi + BN - 1) / BN);
        items.push_back({int32_t(s), int32_t(g), int32_t(m), int32_t(b0), int32_t(b1 - b0)});
      }
  }
  return items;
}

// What one call's work items share: the batch, its packed keys and values, and the head shape.
template <typename T>
struct Call {
  const T* q;
  T* out;
  const int64_t* cu;     // sequence offsets
  const int64_t* first;  // first key block of each sequence
  const T *kpack, *vpack;
  int64_t hq, hkv, group, d, sq, block;  // block: elements of one packed key (or value) block
  bool causal;
  int64_t window;  // a query sees the keys within this many positions of it; -1: all
  float c;  // scale * log2 e
};

// Claims [from, from + chunk) of n items from `next` until none are left; fn(i) for each.
template <typename Fn>
void for_each_claimed(std::atomic<int64_t>& next, int64_t n, int64_t chunk, Fn fn) {
  for (int64_t from; (from = next.fetch_add(chunk, std::memory_order_relaxed)) < n;)
    for (int64_t i = from; i < std::min(n, from + chunk); ++i) fn(i);
}

// One work item: a query block of one sequence, for the query heads sharing one kv head.
template <typename T, int BM, int BN>
void attend_item(const Call<T>& a, const Item& item, Scratch<T>& w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t d = a.d, rows_all = a.group * BM;
  const int64_t s = item.seq, g = item.head, len = a.cu[s + 1] - a.cu[s];
  const int64_t m0 = int64_t(item.qblock) * BM, rows = std::min<int64_t>(BM, len - m0);
  // row x = head (g * group + x / BM), token m0 + x % BM. AMX tiles read the query tiles in place where all 16
  // rows are the sequence's; register blocks (float32, bf16 without AMX) read copies (in place, rows the
  // projection's stride apart fall into a few L1 sets); a tile the sequence ends inside is copied and zero padded,
  // and one past its end reads the first tile again. The products skip what they can of the padding rows (their
  // results are never used).
  for (int64_t t = 0; t < rows_all / 16; ++t) {
    const int64_t h = g * a.group + t * 16 / BM, r0 = t * 16 % BM;
    const T* src = a.q + (a.cu[s] + m0 + r0) * a.sq + h * d;
    w.live[t] = uint8_t(std::clamp<int64_t>(rows - r0, 0, 16));
    if (std::is_same_v<T, bf16> && EMBER_AMX && r0 + 16 <= rows) {
      w.qrow[t] = src, w.qld[t] = a.sq;
    } else if (r0 < rows) {
      T* dst = w.qbuf.data() + t * 16 * d;
      for (int64_t r = 0; r < 16; ++r) {
        if (r0 + r < rows) std::memcpy(dst + r * d, src + r * a.sq, d * sizeof(T));
        else std::memset(dst + r * d, 0, d * sizeof(T));
      }
      w.qrow[t] = dst, w.qld[t] = d;
    } else {
      w.qrow[t] = w.qrow[0], w.qld[t] = w.qld[0];
    }
  }
  std::fill(w.row_max.begin(), w.row_max.begin() + rows_all, kNegInf);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + rows_all * 16, 0.f);
  const RowTiles<T> queries{w.qrow.data(), w.qld.data(), nullptr, 0, w.live.data()};
  const RowTiles<T> probs{nullptr, nullptr, w.probs.data(), BN, w.live.data()};
  const int64_t ahead = a.causal ? 1 : a.window >= 0 ? a.window + 1 : len;  // a row sees the keys before row + ahead
  // how tile_gemm steps through a packed block: float32's strips (elements from one to the next), bf16's rows
  // (bf16 strips without AMX: 32 columns of pairs, 32 d elements of K^T and 32 BN of V)
  constexpr bool kStrips = std::is_same_v<T, float> || !EMBER_AMX;
  constexpr int64_t kStrip = std::is_same_v<T, float> ? kStripF32 : 32;
  const int64_t kstep = kStrips ? d * kStrip : BN, vstep = kStrips ? BN * kStrip : d;
  for (int64_t b = item.kvfirst; b < item.kvfirst + item.kvblocks; ++b) {
    const int64_t i = (a.first[s] + b) * a.hkv + g, n0 = b * BN;
    // keys this block holds for these rows (the last block of a sequence, of a causal row range or of a window
    // is partly empty): both products and the softmax stop at the next multiple of 32
    const int64_t cols = std::min<int64_t>(BN, len - n0);
    const int64_t need = std::min(cols, m0 + rows - 1 + ahead - n0);
    const int64_t n = (need + 31) / 32 * 32;
    tile_gemm<false>(rows_all, n, d, queries, a.kpack + i * a.block, kstep, w.scores.data(), BN);
    for (int64_t x = 0; x < rows_all; ++x) {
      const int64_t r = x % BM;
      if (r >= rows) continue;
      const float* srow = w.scores.data() + x * BN;
      const int64_t from = a.window >= 0 ? std::max<int64_t>(0, m0 + r - a.window - n0) : 0;
      const int64_t keep = std::min(cols, m0 + r + ahead - n0);
      if (keep <= from) {  // none of this block's keys is in the row's window
        std::memset(w.probs.data() + x * BN, 0, n * sizeof(T));
        continue;
      }
      const float factor =
          softmax_row(srow, from, keep, w.probs.data() + x * BN, n, a.c, w.row_max[x], w.row_sum.data() + x * 16);
      if (b > item.kvfirst && factor != 1.f) scale_row(w.acc.data() + x * d, d, factor);
    }
    const T* vb = a.vpack + i * a.block;
    if (b == item.kvfirst) tile_gemm<false>(rows_all, d, n, probs, vb, vstep, w.acc.data(), d);  // writes the rows
    else tile_gemm<true>(rows_all, d, n, probs, vb, vstep, w.acc.data(), d);
  }
  for (int64_t x = 0; x < rows_all; ++x) {
    const int64_t h = g * a.group + x / BM, r = x % BM;
    if (r < rows) store_row(w.acc.data() + x * d, a.out + ((a.cu[s] + m0 + r) * a.hq + h) * d, d,
                            1.f / row_total(w.row_sum.data() + x * 16));
  }
}

// BM query rows per block, BN keys per block (multiples of 32).
template <typename T, int BM, int BN>
void attend(const T* q, const T* k, const T* v, T* out, const int64_t* cu, int64_t nseq, int64_t hq, int64_t hkv,
            int64_t d, int64_t sq, int64_t sk, int64_t sv, bool causal, int64_t window, float scale) {
  const int64_t block = BN * d;
  std::vector<int64_t> first(nseq + 1, 0);  // first key block of each sequence
  for (int64_t s = 0; s < nseq; ++s) first[s + 1] = first[s] + (cu[s + 1] - cu[s] + BN - 1) / BN;
  const int64_t npack = first[nseq] * hkv;
  // K and V of the whole batch, packed (as large as k and v; freed on return)
  std::unique_ptr<T[]> packed(new T[2 * npack * block]);
  T* kpack = packed.get();
  T* vpack = kpack + npack * block;
  const Call<T> call{q, out, cu, first.data(), kpack, vpack, hq, hkv, hq / hkv, d, sq, block, causal, window,
                     scale * kLog2e};

  const std::vector<Item> items = work_items<BM, BN>(cu, first, nseq, hkv, causal, window);
  const int64_t nitems = items.size(), threads = at::get_num_threads();
  // One parallel region: the threads pack every key block, wait for each other, then take work items,
  // a few at a time (one atomic per item costs as much as a short item). Each counter has a cache line
  // of its own: the threads spin on packed_count while the others claim.
  alignas(64) std::atomic<int64_t> next_pack{0};
  alignas(64) std::atomic<int64_t> packed_count{0};
  alignas(64) std::atomic<int64_t> next{0};

  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t done = 0;
    for_each_claimed(next_pack, npack, std::max<int64_t>(1, npack / (4 * threads)), [&](int64_t i) {
      const int64_t b = i / hkv, g = i % hkv;
      const int64_t s = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
      const int64_t start = cu[s] + (b - first[s]) * BN, rows = std::min<int64_t>(BN, cu[s + 1] - start);
      pack_kv<BN>(k + start * sk + g * d, v + start * sv + g * d, sk, sv, rows, d, kpack + i * block,
                  vpack + i * block);
      ++done;
    });
    packed_count.fetch_add(done, std::memory_order_release);
    while (packed_count.load(std::memory_order_acquire) < npack) ember_vec::cpu_relax();

    Scratch<T>& w = thread_scratch<T>();
    w.resize(call.group * BM, BN, d);
#if EMBER_AMX
    if constexpr (std::is_same_v<T, bf16>) ember_amx::load_tile_config();
#endif
    for_each_claimed(next, nitems, std::max<int64_t>(1, nitems / (8 * threads)),
                     [&](int64_t i) { attend_item<T, BM, BN>(call, items[i], w); });
#if EMBER_AMX
    if constexpr (std::is_same_v<T, bf16>) _tile_release();
#endif
  });
}

// From kTallFrom keys (the longest sequence, or window) a call's blocks are kTall: 64 x 256 (code 3), or 128 x 128
// (code 4) on AMD's Zen cores with 8 lanes (Zen 1-3), where items of 128 query rows, which stream every key block
// before them half as often, took 0.83-0.85x the time of 64 x 256 at 4,096-8,000 tokens and were level with 32 x 128
// at 2,560-3,072 (a Zen 3 EPYC, float32; benchmarks/NOTES.md). Elsewhere 64 x 256 from 6,144 keys, as measured there.
constexpr bool kTallRows = EMBER_ZEN && !EMBER_F32X16;
constexpr int64_t kTallFrom = kTallRows ? 3072 : 6144;
constexpr int kTall = kTallRows ? 4 : 3;

// One call of `attend` for the block shape `blocks` names (-1: chosen by the longest sequence); ember_attention's
// return codes.
template <typename T>
int run(const T* q, const T* k, const T* v, T* out, const int64_t* cu, int64_t nseq, int64_t hq, int64_t hkv,
        int64_t d, int64_t sq, int64_t sk, int64_t sv, int causal, int64_t window, float scale, int blocks) {
  if (d % 32 != 0 || d > kMaxHead || hkv <= 0 || hq % hkv != 0) return 1;
  if (blocks < 0) {
    int64_t longest = 0;
    for (int64_t s = 0; s < nseq; ++s) longest = std::max(longest, cu[s + 1] - cu[s]);
    if (window >= 0) longest = std::min(longest, window + 1);  // measured: a window of 64 runs best on 32 x 64
    // bf16 without AMX stays on 32 x 128: with its key blocks in strips it was the fastest at every length from 512
    // tokens on a Zen 5 (64 x 256 1.02x its time at 8,000, 1.01x at 12,000), within 1% at 8,000 on a Zen 4
    constexpr bool kTallBlocks = std::is_same_v<T, float> || EMBER_AMX;
    blocks = longest < 64 ? 0 : longest < 128 ? 1 : !kTallBlocks || longest < kTallFrom ? 2 : kTall;
  }
  const bool c = causal != 0;
  try {  // no exception may cross into ctypes (it would terminate the process)
    switch (blocks) {  // query rows x keys per block
      case 0: attend<T, 32, 32>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, c, window, scale); break;
      case 1: attend<T, 32, 64>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, c, window, scale); break;
      case 2: attend<T, 32, 128>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, c, window, scale); break;
      case 3: attend<T, 64, 256>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, c, window, scale); break;
      case 4: attend<T, 128, 128>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, c, window, scale); break;
      default: return 1;
    }
  } catch (const std::bad_alloc&) {
    return 2;
  }
  return 0;
}

}  // namespace

extern "C" {

// 1 when the kernel can run here: built without AMX, or for AMX and Linux grants this process the tile state.
int ember_attention_usable() {
#if EMBER_AMX
  return ember_amx::tiles_usable();
#else
  return 1;
#endif
}

// The instruction set its matrix products were built for: "amx" or "avx512_bf16" (bf16 and float32), or "avx512",
// "avx2" or "neon" (float32 only).
const char* ember_attention_isa() {
#if defined(__aarch64__)
  return "neon";
#else
  return EMBER_AMX ? "amx" : EMBER_BF16 ? "avx512_bf16" : EMBER_F32X16 ? "avx512" : "avx2";
#endif
}

// q: (T, Hq, D), k, v: (T, Hkv, D) with token strides sq, sk, sv (elements; heads contiguous), float32.
// out: (T, Hq, D) contiguous. cu: nseq + 1 sequence offsets. window >= 0: a query sees only the keys of its sequence
// within `window` positions of it (local attention: ModernBERT's and EmbeddingGemma's sliding layers); -1: all.
// blocks (query rows x keys): 0 for 32 x 32, 1 for 32 x 64, 2 for 32 x 128, 3 for 64 x 256, 4 for 128 x 128, -1 to
// choose by the longest sequence (or window): each is the fastest measured below 64, 128, kTallFrom keys and beyond
// (benchmarks/NOTES.md).
// Returns 0; 1 for unsupported shapes; 2 when its buffers cannot be allocated.
int ember_attention_f32(const float* q, const float* k, const float* v, float* out, const int64_t* cu, int64_t nseq,
                        int64_t hq, int64_t hkv, int64_t d, int64_t sq, int64_t sk, int64_t sv, int causal,
                        int64_t window, float scale, int blocks) {
  return run<float>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, causal, window, scale, blocks);
}

#if EMBER_BF16
// ember_attention_f32 in bf16 (built where the compiler targets AVX-512 BF16).
int ember_attention(const bf16* q, const bf16* k, const bf16* v, bf16* out, const int64_t* cu, int64_t nseq,
                    int64_t hq, int64_t hkv, int64_t d, int64_t sq, int64_t sk, int64_t sv, int causal,
                    int64_t window, float scale, int blocks) {
  return run<bf16>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, causal, window, scale, blocks);
}
#endif

}  // extern "C"

// The kernel as torch's operator ember::native_attention(q, k, v, cu, causal, window) (schema and shape function:
// ember.ops.attention), its one entry from Python: compiled regions call it through the dispatcher with no
// Python in between (~45 us a call through Python). float32, and bf16 where built for it.
namespace {

template <typename T>
int call_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, const at::Tensor& cu,
                bool causal, int64_t window) {
  const auto ptr = [](const at::Tensor& x) { return static_cast<const T*>(x.data_ptr()); };
  return run<T>(ptr(q), ptr(k), ptr(v), static_cast<T*>(out.data_ptr()), cu.data_ptr<int64_t>(), cu.size(0) - 1,
                q.size(1), k.size(1), q.size(2), q.stride(0), k.stride(0), v.stride(0), causal ? 1 : 0, window,
                static_cast<float>(1.0 / std::sqrt(double(q.size(2)))), -1);
}

at::Tensor native_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_in,
                               bool causal, int64_t window) {
  const int64_t t = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || (EMBER_BF16 && dtype == at::kBFloat16),
              "native_attention: q, k, v must be float32", EMBER_BF16 ? " or bf16" : " (this build has no bf16)");
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == dtype && x->stride(2) == 1 && x->stride(1) == d,
                "native_attention: q, k, v must be (T, H, D) of one dtype with each token's heads contiguous");
  const at::Tensor cu = cu_in.to(at::kLong).contiguous();
  at::Tensor out = at::empty({t, hq, d}, q.options());
  int status = 1;
  if (dtype == at::kFloat) status = call_kernel<float>(q, k, v, out, cu, causal, window);
#if EMBER_BF16
  else status = call_kernel<bf16>(q, k, v, out, cu, causal, window);
#endif
  TORCH_CHECK_WITH(OutOfMemoryError, status != 2, "native attention: no memory for its working buffers");
  TORCH_CHECK(status == 0, "native attention on q (", t, ", ", hq, ", ", d, "), ", hkv, " kv heads: shapes refused");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("native_attention", &native_attention_op);
}
