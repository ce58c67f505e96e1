// float32 linear layers for short batches: y = x W^T + b, all float32, W packed once at load (ember.ops.linear.
// pack_f32) into strips of S output channels, [N/S][K][S], S = two registers of channels (16 on AVX2 and NEON, 32 on
// AVX-512; ember.ops.linear.strip_width).
//
// A query of 10-30 tokens reads every weight of the model once for a few multiply-adds each. oneDNN's packed matmul
// then takes about the weights' streaming time PLUS the compute time (on a Zen 3 EPYC, 2 threads, 15 rows: ~2.5 ms
// for a 6,144 x 1,024 matrix, where streaming alone is ~0.9 ms and computing ~1.4 ms). Here each thread computes one
// strip from L2 while it prefetches the next one from memory, spread over the strip's passes, so the two overlap:
// 1.1-1.4x oneDNN's speed at 15-21 rows, 1.1x at 64, level at 160 (benchmarks/NOTES.md). A strip is exactly one
// register block wide, so each pass over it reads its weights as one contiguous stream (strips of two blocks, read
// half a line at a time, ran at 0.8x). The rows go in register blocks of equal size (15 rows: 5 + 5 + 5 on AVX2, not
// 6 + 6 + 3). Taller products run in panels of kPanel rows, each streaming the weights again while it computes
// (0.9-1.0x oneDNN's at 512-2,048 rows, and no second copy of the weights nor a widened one).
// A bf16 checkpoint's weights can stay bf16 in the same strips, as pack_bf16's words (channel d in the low half of
// word d, channel d + kW in its high half), widened in registers by a shift and a mask as they are read
// (ember::linear_f32h): half the bytes, the same sums. Where a strip's rows take three register blocks or more, the
// first block keeps the widened floats (in L2) for the others, so each word is widened once per strip and pass
// (except on AMD's Zen with 8 lanes, where widening is cheaper than keeping: kKeepFrom).
// On a Zen 3 EPYC, 28 layers' matrices in turn: 2.0x at one row (streaming-bound), 0.97-1.02x from 15 rows to 2,048
// (benchmarks/NOTES.md).
// int8 layers (ember.ops.quant) on CPUs without VNNI or AMX hold their int8 weights in the same strips and widen
// them to float32 as they are read (ember::linear_f32q): x then holds each token's int8 values as floats, and the
// sums are the int8 product's, exact while they stay below 2^24.
// Built and loaded like linear.cpp (ember.ops.native); at::parallel_for runs it on torch's OpenMP pool. The register
// blocks are written once against ember_vec::F32Lanes (16 lanes on AVX-512, 8 on AVX2 and NEON).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "strips.h"
#include "vec.h"

#if !EMBER_F32X8
#error "needs AVX2 and FMA (x86-64), or aarch64"
#endif

namespace {

using L = ember_vec::F32Lanes;
using V = L::V;
constexpr int kW = L::kWidth;
constexpr int kPer = 2;                   // registers of channels per register block
constexpr int kStrip = kPer * kW;         // output channels per strip: one register block's
// Rows per register block at most: 2 kRows sums of AVX-512's 32 registers (12 of AVX2's 16). Widened words (bf16,
// int8) take issue slots from the FMAs once per k for the whole block, so their blocks are taller; float32 strips
// stream twice the bytes, and their taller blocks prefetched too fast for a query's rows.
template <typename W>
constexpr int kRows = kW == 16 ? (std::is_same_v<W, float> ? 12 : 15) : 6;
// bf16 words' blocks of 14 or 15 rows run out of AVX-512's registers (30 sums, two widened registers, the mask and
// a row's value) and spill, which costs more than one more, shorter block where a product's rows are few: up to
// kShortUpTo rows, their blocks take at most kShortRows (products of 15 rows 0.89-0.91x the time, 28-30 rows
// 0.87-0.94x; benchmarks/NOTES.md). Taller products keep blocks of 15 (at 256 rows, blocks of 13 took 1.00-1.09x).
// AVX2's blocks of 6 do not spill (blocks of 5 took up to 1.5x).
constexpr int kShortRows = 13;
constexpr int64_t kShortUpTo = 4 * kShortRows;

// Rows per register block at most, for a product of M rows.
template <typename W>
constexpr int64_t block_rows(int64_t M) {
  return kW == 16 && std::is_same_v<W, uint32_t> && M <= kShortUpTo ? kShortRows : kRows<W>;
}

constexpr int64_t kPanel = 256;              // rows per pass over the weights (x's panel stays in L2/L3)
constexpr int64_t kLine = 64;                // bytes per cache line
// Register blocks per strip from which its words are widened once (kept by the first block for the others). Not
// for bf16 words on AMD's Zen cores with 8 lanes: there each block widening its own words took 0.90-0.95x the time
// of keeping them (whole forwards of 15-24 tokens; products of 256 rows 0.91x, 8 x 20 tokens and 1,024 rows level):
// the shift and the mask go to pipes the FMAs leave free, where keeping costs a store and a second load every step
// of k (benchmarks/NOTES.md). int8 words (four instructions to widen) and other 8-lane builds keep them.
constexpr bool kZen = EMBER_ZEN;
template <typename W>
constexpr int64_t kKeepFrom = kW == 8 && kZen && std::is_same_v<W, uint32_t> ? INT64_MAX : 3;
// Where a product is bound by streaming its weights (a query's few rows: up to two register blocks on AVX-512, one
// where the FMAs take twice as long), each strip prefetches the next as kStreams streams, each a part of it, taken
// in turn: the caches' own prefetchers then follow several streams, which read more per core than one (the products
// of a query's 8 rows 0.80x the time, 15 rows 0.85-0.86x; benchmarks/NOTES.md). Taller strips' blocks each prefetch
// a small share of the next, as one stream.
constexpr int kStreams = 4;
constexpr int64_t kStreamsUpTo = kW == 16 ? 2 : 1;  // register blocks per strip up to which the next is streams
static_assert(kStreamsUpTo < kKeepFrom<int8_t> && kStreamsUpTo < kKeepFrom<uint32_t>,
              "a strip read as streams keeps no widened words");

template <typename W>
constexpr int64_t kStep = std::is_same_v<W, uint32_t> ? kW : kStrip;  // W elements per input k of a strip

// A strip's kStrip weights of input k as two registers: float32 as they are, or bf16 pairs (pack_bf16's words,
// width kW: channel d in the low half of word d, channel d + kW in its high half) widened by a shift and a mask.
inline void load_strip(const float* p, V (&b)[kPer]) {
  for (int c = 0; c < kPer; ++c) b[c] = L::load(p + c * kW);
}
inline void load_strip(const uint32_t* p, V (&b)[kPer]) { L::load_bf16_pairs(p, b[0], b[1]); }
inline void load_strip(const int8_t* p, V (&b)[kPer]) {
  for (int c = 0; c < kPer; ++c) b[c] = L::load_int8(p + c * kW);
}

// R rows of y (row stride ldy), a strip's kStrip channels = R rows of x (row stride ldx) times the strip's weights
// w (K x kStrip), plus the bias (the strip's kStrip, or null). When pf is not null it prefetches a share of the next
// strip, pf_step bytes a step of k, as S streams of K / S steps each, taken in turn.
template <int R, typename W, bool Keep = false, int S = 1>
inline void rows_block(const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y,
                       int64_t ldy, const char* pf, int64_t pf_step, float* kept = nullptr) {
  V acc[R][kPer];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPer; ++c) acc[r][c] = L::zero();
  int64_t k = 0;
  const W* p = w;
  if constexpr (S == 1) {  // written out, as every batch of three blocks or more has always run it
    for (; k < K; ++k, p += kStep<W>) {
      if (pf) __builtin_prefetch(pf + k * pf_step, 0, 2);
      V b[kPer];
      load_strip(p, b);
      if constexpr (Keep)  // the strip's weights as float32, for the row blocks after this one
        for (int c = 0; c < kPer; ++c) L::store(kept + k * kStrip + c * kW, b[c]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V a = L::set(x[r * ldx + k]);
        for (int c = 0; c < kPer; ++c) acc[r][c] = L::fma(a, b[c], acc[r][c]);
      }
    }
  } else {
    static_assert(!Keep, "strips read as streams keep no widened words");
    const auto step = [&](int64_t k, const W* p) __attribute__((always_inline)) {
      V b[kPer];
      load_strip(p, b);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const V a = L::set(x[r * ldx + k]);
        for (int c = 0; c < kPer; ++c) acc[r][c] = L::fma(a, b[c], acc[r][c]);
      }
    };
    if (pf) {
      const int64_t part = pf_step * (K / S);  // bytes of each stream
      for (const char* at = pf; k + S <= K; k += S, at += pf_step)
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s, p += kStep<W>) {
          __builtin_prefetch(at + s * part, 0, 2);
          if (pf_step > kLine) __builtin_prefetch(at + s * part + kLine, 0, 2);  // float32 strips, one block
          step(k + s, p);
        }
    }
    for (; k < K; ++k, p += kStep<W>) step(k, p);
  }
  for (int c = 0; c < kPer; ++c) {
    const int at = c * kW;
    const V bb = bias ? L::load(bias + at) : L::zero();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) L::store(y + r * ldy + at, L::add(acc[r][c], bb));
  }
}

// rows_block for a run-time row count 1 .. R.
template <typename W, bool Keep = false, int S = 1, int R = kRows<W>>
inline void rows_any(int rows, const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y,
                     int64_t ldy, const char* pf, int64_t pf_step, float* kept = nullptr) {
  if constexpr (R > 0) {
    if (rows == R) return rows_block<R, W, Keep, S>(x, ldx, w, K, bias, y, ldy, pf, pf_step, kept);
    rows_any<W, Keep, S, R - 1>(rows, x, ldx, w, K, bias, y, ldy, pf, pf_step, kept);
  }
}

// A strip's K x kStrip weights widened to float32, per thread: where a strip's rows take several register blocks,
// the first widens its bf16 (or int8) words and keeps them here, and the others read them as float32 from L2, so
// the words are widened once per strip rather than once per block (each widening takes issue slots from the FMAs).
inline float* widened(int64_t K) {
  thread_local at::Tensor buf;  // torch's allocator: 64-byte aligned, so each k's floats start a cache line
  if (!buf.defined() || buf.numel() < K * kStrip) buf = at::empty({K * kStrip}, at::kFloat);
  return buf.data_ptr<float>();
}

// One strip (its kStrip channels of y) for all M rows, in register blocks of equal size; `next` (or null): the strip
// this thread computes after it, whose K x kStrip floats are prefetched in equal shares by this strip's passes.
template <typename W>
inline void strip_rows(const float* x, int64_t ldx, int64_t M, const W* w, int64_t K, const float* bias, float* y,
                       int64_t ldy, const W* next) {
  const int64_t most = block_rows<W>(M), blocks = (M + most - 1) / most;
  const int64_t lines = K * kStep<W> * int64_t(sizeof(W)) / kLine;
  float* const kept = std::is_same_v<W, float> || blocks < kKeepFrom<W> ? nullptr : widened(K);
  ember_strips::row_blocks(M, blocks, [&](int64_t b, int64_t m, int64_t rows) {
    const int n = int(rows);
    const char* pf = nullptr;
    int64_t step = 0;
    if (next) {
      const int64_t lo = b * lines / blocks, hi = (b + 1) * lines / blocks;
      pf = reinterpret_cast<const char*>(next) + lo * kLine;
      step = std::max<int64_t>(1, ((hi - lo) * kLine + K - 1) / K);  // bytes per step of k
    }
    if (blocks <= kStreamsUpTo)  // (then kept is null: kKeepFrom > kStreamsUpTo)
      rows_any<W, false, kStreams>(n, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, pf, step);
    else if (!kept)
      rows_any(n, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, pf, step);
    else if constexpr (!std::is_same_v<W, float>) {  // float32 strips keep nothing
      if (b == 0)
        rows_any<W, true>(n, x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, pf, step, kept);
      else
        rows_any<float, false, 1, kRows<W>>(n, x + m * ldx, ldx, static_cast<const float*>(kept), K, bias,
                                            y + m * ldy, ldy, pf, step);
    }
  });
}

// y (M x N, row stride ldy) = x (M x K, row stride ldx) W^T + bias, W packed as above (N a multiple of kStrip). The
// threads claim strips one at a time from one counter (strips.h), each claiming the strip it computes next before it
// computes the one it holds, so that strip's passes prefetch the next (a query's products are bound by that stream)
// and a core the host runs slower takes fewer strips instead of keeping the other waiting at the end: the two vCPUs
// of a Zen 3 EPYC differed by up to 40% in FMA rate from minute to minute. Against fixed halves: products of 15 rows
// 0.83-0.97x the time, 64-512 rows 0.84-0.95x, 1-8 and 18-22 rows level; one strip is still computed whole by one
// thread, so the sums do not depend on which (benchmarks/NOTES.md).
template <typename W>
void linear(const float* x, int64_t M, int64_t K, int64_t ldx, const W* w, int64_t N, const float* bias, float* y,
            int64_t ldy) {
  const int64_t strip = K * kStep<W>, strips = N / kStrip;
  ember_strips::claim(strips, [&](int64_t j, int64_t after) {
    strip_rows(x, ldx, M, w + j * strip, K, bias ? bias + j * kStrip : nullptr, y + j * kStrip, ldy,
               after < strips ? w + after * strip : nullptr);
  });
}

}  // namespace

extern "C" {

int ember_linear_f32_usable() { return 1; }

// The strip width its weights must be packed in (ember.ops.linear.pack_f32): 32 on AVX-512, 16 on AVX2 and NEON.
int ember_linear_f32_strip() { return kStrip; }

// The register width its blocks were built for: "avx512" (16 lanes), "avx2" or "neon" (8).
const char* ember_linear_f32_isa() {
#if defined(__aarch64__)
  return "neon";
#else
  return EMBER_F32X16 ? "avx512" : "avx2";
#endif
}

}  // extern "C"

// torch's operators ember::linear_f32w / linear_f32h / linear_f32q(x, w, bias) (schemas and shape functions:
// ember.ops.linear).
namespace {

enum class Held { kFloat, kBf16, kInt8 };  // what the strips hold

// y = x W^T + bias for x (T, K) float32 and W packed as `w`: float32 strips (N / kStrip, K, kStrip), bf16 pairs
// (N / kStrip, K, kW) int32 words, or int8 strips (N / kStrip, K, kStrip); in panels of kPanel rows.
at::Tensor product(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias, Held held) {
  const int64_t step = held == Held::kBf16 ? kW : kStrip;
  const at::ScalarType type = held == Held::kFloat ? at::kFloat : held == Held::kBf16 ? at::kInt : at::kChar;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "linear_f32: x must be (T, K) float32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == step && w.scalar_type() == type && w.is_contiguous(),
              "linear_f32: w must be packed (N / ", kStrip, ", K, ", step, ") ", c10::toString(type));
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t t = x.size(0), k = x.size(1), n = w.size(0) * kStrip;
  TORCH_CHECK(w.size(1) == k, "linear_f32: x has ", k, " inputs, the weights ", w.size(1));
  TORCH_CHECK(!bias || (bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "linear_f32: bias must be (N,) float32");
  at::Tensor out = at::empty({t, n}, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  for (int64_t m = 0; m < t; m += kPanel) {
    const float* xm = x.data_ptr<float>() + m * x.stride(0);
    float* ym = out.data_ptr<float>() + m * n;
    const int64_t rows = std::min(kPanel, t - m);
    if (held == Held::kBf16)
      linear(xm, rows, k, x.stride(0), reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>()), n, b, ym, n);
    else if (held == Held::kInt8)
      linear(xm, rows, k, x.stride(0), w.data_ptr<int8_t>(), n, b, ym, n);
    else
      linear(xm, rows, k, x.stride(0), w.data_ptr<float>(), n, b, ym, n);
  }
  return out;
}

at::Tensor linear_f32w_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return product(x, w, bias, Held::kFloat);
}

at::Tensor linear_f32h_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return product(x, w, bias, Held::kBf16);
}

at::Tensor linear_f32q_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return product(x, w, bias, Held::kInt8);
}

}  // namespace

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("linear_f32w", &linear_f32w_op);
  m.impl("linear_f32h", &linear_f32h_op);
  m.impl("linear_f32q", &linear_f32q_op);
}
