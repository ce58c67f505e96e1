// bf16 linear layers on AVX-512 BF16: y = x W^T + b, x and y bf16, W packed once at load (ember.ops.bf16_pairs.
// pack_pairs, for PairLinear) into strips of kStrip = 32 output channels, [N/32][K/2][32] int32 words, word c
// of input pair i holding channel c's weights of inputs 2i (low half) and 2i + 1 (high half): what `vdpbf16ps`
// multiplies against a broadcast pair of x's inputs, 32 products a register, summed in float32.
//
// A query of 10-30 tokens reads every weight of the model once for a few multiply-adds each: the product is bound by
// how fast the weights stream in. oneDNN's packed bf16 matmul read them at ~26 GB/s on 2 vCPUs of a Zen 5 EPYC,
// where a bare loop of two threads reads 45-75 GB/s and this product 40-44; ember's float32 product on bf16 words
// (linear_f32.cpp) streams at oneDNN's rate but spends twice the multiply-adds. Here, as there, each thread computes
// one strip while it prefetches the next, spread over the strip's passes, and claims strips one at a time from one
// counter. The next strip is read in order, one line after another: read as four streams in turn (as linear_f32.cpp
// reads it, which suits Zen 3), a query's products took 1.15-1.2x the time on Zen 5 (benchmarks/NOTES.md). Taller
// products run in panels of kPanel rows, each streaming the weights again: level with oneDNN at 160-512 rows, 1.04x
// its time at 2,048, so one layout serves every height (panels of 96, 128 or 512 rows, or sized to keep x in L2, were
// no better). The sums are float32 over the bf16 products, rounded once to bf16 (with the bias added in float32), as
// oneDNN's; only their order differs.
// Built and loaded like the other kernels (ember.ops.native); at::parallel_for runs it on torch's OpenMP pool.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "strips.h"
#include "vec.h"

#if !defined(__AVX512BF16__) || !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "needs AVX-512 BF16"
#endif
#include <immintrin.h>

namespace {

constexpr int kW = 16;               // float32 lanes of a register
constexpr int kPer = 2;              // registers of channels per strip
constexpr int kStrip = kPer * kW;    // output channels per strip
constexpr int kRows = 14;            // rows per register block at most: 28 sums, two weights and x's pair of 32
constexpr int64_t kPanel = 256;      // rows per pass over the weights
constexpr int64_t kLine = 64;        // bytes per cache line

// R rows of y (bf16, row stride ldy): a strip's 32 channels = R rows of x (bf16, row stride ldx) times the strip's
// words w (K2 = K / 2 pairs x 32), plus the bias (float32, the strip's 32, or null). pf (or null): this pass's share
// of the next strip, `lines` cache lines, prefetched in order. Glu: the strip's channels are 16 of a SwiGLU's gates
// and their 16 ups (ember.ops.glu), and y gets silu(gate) * up, 16 channels.
template <int R, bool Glu>
inline void rows_block(const uint16_t* x, int64_t ldx, const int32_t* w, int64_t K2, const float* bias, uint16_t* y,
                       int64_t ldy, const char* pf, int64_t lines) {
  __m512 acc[R][kPer];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPer; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t per = K2 ? (lines + K2 - 1) / K2 : 0;  // lines prefetched a step
  for (int64_t i = 0; i < K2; ++i) {
    if (pf)
      for (int64_t q = i * per; q < std::min(lines, (i + 1) * per); ++q) __builtin_prefetch(pf + q * kLine, 0, 2);
    const __m512i* p = reinterpret_cast<const __m512i*>(w + i * kStrip);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(p), b1 = (__m512bh)_mm512_loadu_si512(p + 1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  if constexpr (Glu) {  // the strip's 16 gates and their 16 ups, each rounded to bf16 as the plain product's are
    const __m512 bg = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bu = bias ? _mm512_loadu_ps(bias + kW) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 g = ember_vec::round_bf16(_mm512_add_ps(acc[r][0], bg));
      const __m512 u = ember_vec::round_bf16(_mm512_add_ps(acc[r][1], bu));
      ember_vec::store_bf16(y + r * ldy, ember_vec::silu_mul_ps(g, u));
    }
  } else {
    for (int c = 0; c < kPer; ++c) {
      const __m512 bb = bias ? _mm512_loadu_ps(bias + c * kW) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], bb));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * kW), (__m256i)h);
      }
    }
  }
}

// rows_block for a run-time row count 1 .. R.
template <bool Glu, int R = kRows>
inline void rows_any(int rows, const uint16_t* x, int64_t ldx, const int32_t* w, int64_t K2, const float* bias,
                     uint16_t* y, int64_t ldy, const char* pf, int64_t lines) {
  if constexpr (R > 0) {
    if (rows == R) return rows_block<R, Glu>(x, ldx, w, K2, bias, y, ldy, pf, lines);
    rows_any<Glu, R - 1>(rows, x, ldx, w, K2, bias, y, ldy, pf, lines);
  }
}

// One strip for all M rows, in register blocks of equal size; `next` (or null): the strip this thread computes after
// it, prefetched in equal shares by this strip's passes.
template <bool Glu>
inline void strip_rows(const uint16_t* x, int64_t ldx, int64_t M, const int32_t* w, int64_t K2, const float* bias,
                       uint16_t* y, int64_t ldy, const int32_t* next) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  const int64_t lines = K2 * kStrip * int64_t(sizeof(int32_t)) / kLine;
  ember_strips::row_blocks(M, blocks, [&](int64_t b, int64_t m, int64_t n) {
    const int64_t lo = b * lines / blocks, hi = (b + 1) * lines / blocks;
    const char* pf = next ? reinterpret_cast<const char*>(next) + lo * kLine : nullptr;
    rows_any<Glu>(int(n), x + m * ldx, ldx, w, K2, bias, y + m * ldy, ldy, pf, hi - lo);
  });
}

// y (M x N) = x (M x K) W^T + bias, W packed as above, its strips shared among the threads as strips.h says; with
// Glu, y (M x N / 2) = silu(gate) * up of those products.
template <bool Glu>
void linear(const uint16_t* x, int64_t M, int64_t K2, int64_t ldx, const int32_t* w, int64_t N, const float* bias,
            uint16_t* y, int64_t ldy) {
  const int64_t strip = K2 * kStrip, strips = N / kStrip, out = Glu ? kW : kStrip;  // y's channels per strip
  ember_strips::claim(strips, [&](int64_t j, int64_t after) {
    strip_rows<Glu>(x, ldx, M, w + j * strip, K2, bias ? bias + j * kStrip : nullptr, y + j * out, ldy,
                    after < strips ? w + after * strip : nullptr);
  });
}

// y = x W^T + bias for x (T, K) bf16 and W packed as (N / 32, K / 2, 32) int32 words; bias (N,) float32 or none.
// glu: W's rows are a SwiGLU's gates and ups in blocks of 16 (ember.ops.glu), and y = silu(gate) * up, (T, N / 2).
at::Tensor product(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool glu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "linear_bf16d: x must be (T, K) bf16");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kStrip && w.scalar_type() == at::kInt && w.is_contiguous(),
              "linear_bf16d: w must be packed (N / 32, K / 2, 32) int32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();  // pairs read with memcpy: any row stride
  const int64_t t = x.size(0), k = x.size(1), n = w.size(0) * kStrip, ny = glu ? n / 2 : n;
  TORCH_CHECK(k == 2 * w.size(1), "linear_bf16d: x has ", k, " inputs, the weights ", 2 * w.size(1));
  TORCH_CHECK(!bias || (bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "linear_bf16d: bias must be (N,) float32");
  TORCH_CHECK(!glu || n % (2 * kStrip) == 0, "linear_bf16d_glu: gates and ups must fill whole strips");
  at::Tensor out = at::empty({t, ny}, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* ws = w.data_ptr<int32_t>();
  for (int64_t m = 0; m < t; m += kPanel) {
    const int64_t rows = std::min(kPanel, t - m);
    if (glu) linear<true>(xs + m * x.stride(0), rows, k / 2, x.stride(0), ws, n, b, ys + m * ny, ny);
    else linear<false>(xs + m * x.stride(0), rows, k / 2, x.stride(0), ws, n, b, ys + m * ny, ny);
  }
  return out;
}

}  // namespace

extern "C" {
int ember_linear_bf16_usable() { return 1; }
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_bf16d", [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    return product(x, w, bias, false);
  });
  m.impl("linear_bf16d_glu", [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    return product(x, w, bias, true);
  });
}
