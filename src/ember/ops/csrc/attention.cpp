// Flash attention over packed variable-length sequences, bf16 in and out, for CPUs with AMX.
//
// Built at run time by ember.ops.native (g++ -march=native, against the installed torch's headers),
// loaded with ctypes; torch's at::parallel_for runs it on torch's own OpenMP pool. The two matrix
// products per block are AMX tile loops written here (oneDNN's brgemm micro-kernels measured 2-3x
// slower at these small shapes: 64 x 64 x 128); the softmax between them is AVX-512.
// What it does that torch's CPU flash attention does not:
//   - every sequence of a batch in one call (cu_seqlens), reading q/k/v in place and writing the
//     packed (T, Hq, D) output, with no per-sequence call, gather or copy;
//   - causal blocks end at the diagonal (torch computes whole 512-key blocks, so at <= 512 tokens it
//     does the masked half of the work too);
//   - exp as 2^x: one FMA into base 2, a degree-5 polynomial and a scalef; the running max is raised
//     only when a block exceeds it by 2^8, so most blocks skip rescaling the output rows.
// Work items (sequence, kv head, query block: the query heads sharing a kv head go together) are
// handed out from one atomic counter, longest sequences first, so threads stay balanced under the
// causal triangle.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AMX_BF16__)
#error "needs AVX-512 BF16 and AMX"
#endif

using bf16 = uint16_t;  // bfloat16 bits

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kBM = 64;  // query rows per block
constexpr int kMaxHead = 256;

struct Item {
  int32_t seq, head, qblock, kvblocks;  // head: the kv head
};

// --- AMX: every tile is 16 rows x 64 bytes (a 16 x 32 bf16 operand or a 16 x 16 fp32 result) ---

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// C (M x N fp32, row stride ldc) = or += A (M x K bf16, row stride lda) x B, where B is K x N in the
// VNNI layout [K/2][ldb][2]. M, N, K are multiples of 32: 2 x 2 result tiles per step.
template <bool Accumulate>
void tile_gemm(int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float* C,
               int64_t ldc) {
  for (int64_t i = 0; i < M; i += 32) {
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
        _tile_loadd(4, A + i * lda + k, lda * 2);
        _tile_loadd(5, A + (i + 16) * lda + k, lda * 2);
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

// Scores -> bf16 probabilities for one row of N, in base 2: p = 2^(s * c - ref), c = scale * log2 e.
// `ref` (in/out) is the row's running reference: the largest scaled score seen, raised lazily: only
// when a block's max exceeds it by more than 8 (so p <= 256, exact enough in fp32 sums and bf16).
// Returns the factor (2^(old ref - new ref), 1 when unchanged) that earlier sums and outputs need,
// and adds this row's p to `sum` after scaling it by that factor.
template <int N>
inline float softmax_row(const float* s, bf16* p, float c, float& ref, float& sum) {
  __m512 m0 = _mm512_loadu_ps(s), m1 = _mm512_loadu_ps(s + 16);
  for (int j = 32; j < N; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * c;
  float factor = 1.f;
  if (mx > ref + 8.f) {
    factor = ref == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(ref - mx);
    ref = mx;
  }
  const __m512 vc = _mm512_set1_ps(c), off = _mm512_set1_ps(-ref);
  const __m512 lo = _mm512_set1_ps(-126.f), one = _mm512_set1_ps(1.f);
  const __m512 c1 = _mm512_set1_ps(0.6931471806f), c2 = _mm512_set1_ps(0.2402265070f),
               c3 = _mm512_set1_ps(0.0555041087f), c4 = _mm512_set1_ps(0.0096181291f),
               c5 = _mm512_set1_ps(0.0013333558f);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int j = 0; j < N; j += 32) {
    // t <= 8; masked scores are -inf and clamp to 2^-126, far below what bf16 sums can see
    __m512 t0 = _mm512_max_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vc, off), lo);
    __m512 t1 = _mm512_max_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16), vc, off), lo);
    __m512 n0 = _mm512_roundscale_ps(t0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 n1 = _mm512_roundscale_ps(t1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f0 = _mm512_sub_ps(t0, n0), f1 = _mm512_sub_ps(t1, n1);  // in [-0.5, 0.5]
    __m512 p0 = _mm512_fmadd_ps(c5, f0, c4), p1 = _mm512_fmadd_ps(c5, f1, c4);
    p0 = _mm512_fmadd_ps(p0, f0, c3), p1 = _mm512_fmadd_ps(p1, f1, c3);
    p0 = _mm512_fmadd_ps(p0, f0, c2), p1 = _mm512_fmadd_ps(p1, f1, c2);
    p0 = _mm512_fmadd_ps(p0, f0, c1), p1 = _mm512_fmadd_ps(p1, f1, c1);
    p0 = _mm512_fmadd_ps(p0, f0, one), p1 = _mm512_fmadd_ps(p1, f1, one);
    p0 = _mm512_scalef_ps(p0, n0), p1 = _mm512_scalef_ps(p1, n1);
    acc0 = _mm512_add_ps(acc0, p0), acc1 = _mm512_add_ps(acc1, p1);
    __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
    std::memcpy(p + j, &packed, sizeof(packed));
  }
  sum = sum * factor + _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  return factor;
}

inline void scale_row(float* o, int64_t d, float a) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t j = 0; j < d; j += 16) _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(o + j), va));
}

inline void store_row(const float* o, bf16* dst, int64_t d, float a) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t j = 0; j < d; j += 32) {
    __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + j + 16), va),
                                          _mm512_mul_ps(_mm512_loadu_ps(o + j), va));
    std::memcpy(dst + j, &packed, sizeof(packed));
  }
}

// One key block (N rows of D, zero past `rows`) in the layouts the AMX kernels read:
// K^T as [D/2][N][2] (B of Q K^T), V as [N/2][D][2] (B of P V).
template <int N>
void pack_kv(const bf16* k, const bf16* v, int64_t sk, int64_t sv, int64_t rows, int64_t d, bf16* kp, bf16* vp) {
  const int64_t half = d / 2;
  auto* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t n = 0; n < N; ++n) {
    if (n < rows) {
      uint32_t row[kMaxHead / 2];
      std::memcpy(row, k + n * sk, d * sizeof(bf16));
      for (int64_t j = 0; j < half; ++j) kp32[j * N + n] = row[j];
    } else {
      for (int64_t j = 0; j < half; ++j) kp32[j * N + n] = 0;
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    bf16* dst = vp + (n / 2) * d * 2 + (n % 2);
    if (n < rows) {
      const bf16* src = v + n * sv;
      for (int64_t j = 0; j < d; ++j) dst[2 * j] = src[j];
    } else {
      for (int64_t j = 0; j < d; ++j) dst[2 * j] = bf16(0);
    }
  }
}

thread_local std::vector<bf16> t_packed;  // K and V blocks, reused across calls

template <int BN>
void attend(const bf16* q, const bf16* k, const bf16* v, bf16* out, const int64_t* cu, int64_t nseq, int64_t hq,
            int64_t hkv, int64_t d, int64_t sq, int64_t sk, int64_t sv, bool causal, float scale) {
  const int64_t group = hq / hkv, block = BN * d;
  std::vector<int64_t> first(nseq + 1, 0);  // first key block of each sequence
  for (int64_t s = 0; s < nseq; ++s) first[s + 1] = first[s] + (cu[s + 1] - cu[s] + BN - 1) / BN;
  const int64_t nblocks = first[nseq];
  if (static_cast<int64_t>(t_packed.size()) < 2 * nblocks * hkv * block) t_packed.resize(2 * nblocks * hkv * block);
  bf16* kpack = t_packed.data();
  bf16* vpack = kpack + nblocks * hkv * block;

  at::parallel_for(0, nblocks * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / hkv, g = i % hkv;
      const int64_t s = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
      const int64_t start = cu[s] + (b - first[s]) * BN, rows = std::min<int64_t>(BN, cu[s + 1] - start);
      pack_kv<BN>(k + start * sk + g * d, v + start * sv + g * d, sk, sv, rows, d, kpack + i * block,
                  vpack + i * block);
    }
  });

  // Work items: one query block of one sequence for all the query heads sharing a kv head (their
  // scores are one matrix product against the same keys). Ordered by sequence and kv head, so items
  // next to each other read the same keys and values; the costliest sequences first.
  std::vector<int64_t> order(nseq);
  for (int64_t s = 0; s < nseq; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cu[a + 1] - cu[a] > cu[b + 1] - cu[b]; });
  std::vector<Item> items;
  for (int64_t s : order) {
    const int64_t len = cu[s + 1] - cu[s], nb = first[s + 1] - first[s];
    for (int64_t g = 0; g < hkv; ++g)
      for (int64_t m = (len + kBM - 1) / kBM - 1; m >= 0; --m) {
        const int64_t kvb = causal ? std::min<int64_t>(nb, (m * kBM + kBM + BN - 1) / BN) : nb;
        items.push_back({int32_t(s), int32_t(g), int32_t(m), int32_t(kvb)});
      }
  }
  const int64_t nitems = items.size(), rows_all = group * kBM;
  const float c = scale * kLog2e;
  std::atomic<int64_t> next{0};
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<bf16> qbuf(rows_all * d), probs(rows_all * BN, 0);
    std::vector<float> scores(rows_all * BN), acc(rows_all * d), row_max(rows_all), row_sum(rows_all);
    load_tile_config();
    for (int64_t it; (it = next.fetch_add(1)) < nitems;) {
      const Item& w = items[it];
      const int64_t s = w.seq, g = w.head, len = cu[s + 1] - cu[s];
      const int64_t m0 = int64_t(w.qblock) * kBM, rows = std::min<int64_t>(kBM, len - m0);
      // row x = head (g * group + x / kBM), token m0 + x % kBM
      for (int64_t x = 0; x < rows_all; ++x) {
        const int64_t h = g * group + x / kBM, r = x % kBM;
        if (r < rows) std::memcpy(qbuf.data() + x * d, q + (cu[s] + m0 + r) * sq + h * d, d * sizeof(bf16));
        else std::memset(qbuf.data() + x * d, 0, d * sizeof(bf16));
        row_max[x] = kNegInf;
        row_sum[x] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < w.kvblocks; ++b) {
        const int64_t i = (first[s] + b) * hkv + g, n0 = b * BN;
        tile_gemm<false>(rows_all, BN, d, qbuf.data(), d, kpack + i * block, BN, scores.data(), BN);
        const int64_t cols = std::min<int64_t>(BN, len - n0);
        for (int64_t x = 0; x < rows_all; ++x) {
          const int64_t r = x % kBM;
          if (r >= rows) continue;
          float* srow = scores.data() + x * BN;
          const int64_t keep = causal ? std::min<int64_t>(cols, m0 + r - n0 + 1) : cols;
          for (int64_t c = std::max<int64_t>(keep, 0); c < BN; ++c) srow[c] = kNegInf;
          const float factor = softmax_row<BN>(srow, probs.data() + x * BN, c, row_max[x], row_sum[x]);
          if (b > 0 && factor != 1.f) scale_row(acc.data() + x * d, d, factor);
        }
        tile_gemm<true>(rows_all, d, BN, probs.data(), BN, vpack + i * block, d, acc.data(), d);
      }
      for (int64_t x = 0; x < rows_all; ++x) {
        const int64_t h = g * group + x / kBM, r = x % kBM;
        if (r < rows) store_row(acc.data() + x * d, out + ((cu[s] + m0 + r) * hq + h) * d, d, 1.f / row_sum[x]);
      }
    }
    _tile_release();
  });
}

}  // namespace

extern "C" {

// 1 when the kernel can run here: Linux grants this process the AMX tile state.
int ember_attention_usable() {
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : 0;
}

// q: (T, Hq, D), k, v: (T, Hkv, D) with token strides sq, sk, sv (elements; heads contiguous), bf16.
// out: (T, Hq, D) contiguous. cu: nseq + 1 sequence offsets. Returns 0, or 1 for unsupported shapes.
int ember_attention(const bf16* q, const bf16* k, const bf16* v, bf16* out, const int64_t* cu, int64_t nseq,
                    int64_t hq, int64_t hkv, int64_t d, int64_t sq, int64_t sk, int64_t sv, int causal, float scale,
                    int long_blocks) {
  if (d % 32 != 0 || d > kMaxHead || hkv <= 0 || hq % hkv != 0) return 1;
  if (long_blocks) attend<128>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, causal != 0, scale);
  else attend<64>(q, k, v, out, cu, nseq, hq, hkv, d, sq, sk, sv, causal != 0, scale);
  return 0;
}

}  // extern "C"
