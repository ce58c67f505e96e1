// float32 linear layers on bf16 weights: y = x W^T + b with x and y float32 and W held as bf16, widened to float32
// in registers (a shift or a mask), so a product reads half the weight bytes of a float32 layer and none is lost
// where the checkpoint is bf16 (Qwen3, Gemma, Llama embedders ship bf16). Small batches are bound by streaming
// the weights (a 21-token query reads all of the 0.6B shape's 1.76 GB of float32 matrices), and they get ~2x;
// the layers keep half the memory (above kTall rows, each thread also keeps one float32 buffer as large as the
// largest layer).
// Built and loaded like attention.cpp (ember.ops.native); at::parallel_for runs it on torch's OpenMP pool. The
// register blocks are written once against ember_vec::F32Lanes (16 lanes on AVX-512, 8 on AVX2 and NEON).
//
// Weights are packed once (ember.ops.linear.pack_bf16): strips of 32 output channels, [N/32][K][16] 32-bit
// words, word d of input k holding channel d in its low half and channel d + 16 in its high half. A load of W
// words widens to two registers of channels, lo = word << 16 and hi = word & 0xffff0000: no shuffle.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "vec.h"

#if !EMBER_F32X8
#error "needs AVX2 and FMA (x86-64), or aarch64"
#endif

namespace {

using L = ember_vec::F32Lanes;
using V = L::V;
constexpr int kW = L::kWidth;
constexpr int kStrip = 32;                  // output channels per strip
constexpr int kWords = kStrip / 2;          // 32-bit words per input in a strip
constexpr int kSubs = kWords / kW;          // register pairs per input: 1 (AVX-512) or 2 (8 lanes)
constexpr int64_t kTall = 512;  // rows above which oneMKL on the widened weights is faster
constexpr int kRows = kW == 16 ? 12 : 6;    // rows per register block: 2 kRows sums (24 of AVX-512's 32 registers,
                                            // 12 of AVX2's 16), one load and two widenings a step

// R rows of y (row stride ldy), one sub-strip's 2 kW channels (lo: channels s kW .., hi: 16 + s kW ..) = R rows of
// x (row stride ldx) times a strip's words w (K x kWords), sub-strip s; plus the bias (the strip's 32, or null).
template <int R>
inline void rows_block(const float* x, int64_t ldx, const uint32_t* w, int64_t K, int s, const float* bias, float* y,
                       int64_t ldy) {
  V acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = L::zero();
  const uint32_t* p = w + s * kW;
  for (int64_t k = 0; k < K; ++k, p += kWords) {
    V lo, hi;
    L::load_bf16_pairs(p, lo, hi);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V a = L::set(x[r * ldx + k]);
      acc[r][0] = L::fma(a, lo, acc[r][0]);
      acc[r][1] = L::fma(a, hi, acc[r][1]);
    }
  }
  const V b0 = bias ? L::load(bias + s * kW) : L::zero(), b1 = bias ? L::load(bias + 16 + s * kW) : L::zero();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    L::store(y + r * ldy + s * kW, L::add(acc[r][0], b0));
    L::store(y + r * ldy + 16 + s * kW, L::add(acc[r][1], b1));
  }
}

// rows_block for a run-time row count 1 .. kRows.
template <int R = kRows>
inline void rows_any(int rows, const float* x, int64_t ldx, const uint32_t* w, int64_t K, int s, const float* bias,
                     float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) return rows_block<R>(x, ldx, w, K, s, bias, y, ldy);
    rows_any<R - 1>(rows, x, ldx, w, K, s, bias, y, ldy);
  }
}

// y (M x N, row stride ldy) = x (M x K, row stride ldx) W^T + bias, W packed as above (N a multiple of 32). The
// threads split the strips; each strip's words stream from memory once, its rows in register blocks.
void linear(const float* x, int64_t M, int64_t K, int64_t ldx, const uint32_t* w, int64_t N, const float* bias,
            float* y, int64_t ldy) {
  at::parallel_for(0, N / kStrip, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t m = 0; m < M; m += kRows) {
        const int rows = int(std::min<int64_t>(kRows, M - m));
        for (int s = 0; s < kSubs; ++s)
          rows_any(rows, x + m * ldx, ldx, w + j * K * kWords, K, s, bias ? bias + j * kStrip : nullptr,
                   y + m * ldy + j * kStrip, ldy);
      }
  });
}

// The packed words as W^T, a plain (K, N) float32 matrix, for oneMKL's sgemm on taller batches.
void widen(const uint32_t* w, int64_t N, int64_t K, float* wt) {
  at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t j = 0; j < N / kStrip; ++j)
        for (int s = 0; s < kSubs; ++s) {
          V lo, hi;
          L::load_bf16_pairs(w + (j * K + k) * kWords + s * kW, lo, hi);
          L::store(wt + k * N + j * kStrip + s * kW, lo);
          L::store(wt + k * N + j * kStrip + 16 + s * kW, hi);
        }
  });
}

}  // namespace

extern "C" {

int ember_linear_usable() { return 1; }

// The register width its blocks were built for: "avx512" (16 lanes), "avx2" or "neon" (8).
const char* ember_linear_isa() {
#if defined(__aarch64__)
  return "neon";
#else
  return EMBER_F32X16 ? "avx512" : "avx2";
#endif
}

}  // extern "C"

// torch's operator ember::linear_bf16w(x, w, bias) (schema and shape function: ember.ops.linear).
namespace {

at::Tensor linear_bf16w_op(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "linear_bf16w: x must be (T, K) float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kWords && w.scalar_type() == at::kInt && w.is_contiguous(),
              "linear_bf16w: w must be packed (N / 32, K, 16) int32 words");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t t = x.size(0), k = x.size(1), n = w.size(0) * kStrip;
  TORCH_CHECK(w.size(1) == k, "linear_bf16w: x has ", k, " inputs, the weights ", w.size(1));
  TORCH_CHECK(!bias || (bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "linear_bf16w: bias must be (N,) float32");
  const auto* words = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  if (t > kTall) {  // widened for oneMKL, into a buffer this thread keeps (no page faults on every call)
    thread_local at::Tensor scratch;
    if (!scratch.defined() || scratch.numel() < k * n) scratch = at::empty({k * n}, x.options());
    const at::Tensor wt = scratch.narrow(0, 0, k * n).view({k, n});
    widen(words, n, k, wt.data_ptr<float>());
    return bias ? at::addmm(*bias, x, wt) : at::mm(x, wt);
  }
  at::Tensor out = at::empty({t, n}, x.options());
  linear(x.data_ptr<float>(), t, k, x.stride(0), words, n, bias ? bias->data_ptr<float>() : nullptr,
         out.data_ptr<float>(), n);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_bf16w", &linear_bf16w_op);
}
