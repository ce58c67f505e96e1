// The elementwise work between a bf16 layer's matrix products, on AVX-512: SwiGLU's silu(gate) * up,
// Qwen3's q/k RMSNorm + rotary, each one pass over the projection, and the Hadamard rotation of an int8 layer's
// inputs (ember.ops.rotation) as a fast Walsh-Hadamard transform.
//
// torch.compile's kernels for them (ember.ops.fused) run far under memory speed: for 1,600 tokens of
// Qwen3-0.6B, silu_mul 1.8-2.7 ms (its exp) and qk_norm_rope ~2 ms, where a copy of as many bytes takes
// ~0.5-0.8 ms. Here exp is a degree-5 polynomial and a scalef and 1 / (1 + e) is rcp14, both far inside
// bf16's rounding; the norm rounds where the reference does.
// Registered as torch's operators ember::silu_mul and ember::qk_norm_rope (schemas and shape functions:
// ember.ops.fused) and ember::hadamard_rotate (ember.ops.rotation).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "needs AVX-512 (F, BW) and AVX512_BF16"
#endif

using ember_vec::bf16;

namespace {

// One row: out[j] = silu(x[j]) * x[n + j] for j < n.
void silu_mul_row(const bf16* x, bf16* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    ember_vec::store_bf16(out + j, ember_vec::silu_mul_ps(ember_vec::load_bf16(x + j), ember_vec::load_bf16(x + n + j)));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
    ember_vec::store_bf16(out + j,
                          ember_vec::silu_mul_ps(ember_vec::load_bf16(x + j, m), ember_vec::load_bf16(x + n + j, m)), m);
  }
}

at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul: a bf16 tensor whose last axis holds gate then up");
  const at::Tensor x = gate_up.stride(-1) == 1 && gate_up.dim() == 2 ? gate_up : gate_up.reshape({-1, gate_up.size(-1)}).contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2, ldx = x.stride(0);
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, gate_up.options());
  const auto* src = static_cast<const bf16*>(x.data_ptr());
  auto* dst = static_cast<bf16*>(out.data_ptr());
  // ~16 KB of output per task at the least: a query's few rows stay on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(src + r * ldx, dst + r * n, n);
  });
  return out;
}

// 16 float32 values of a norm's weights or the rotary's cos / sin, held as float32 or as bf16 (a bf16 model's, read
// as they are rather than converted on every call).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return ember_vec::load_bf16(p); }

// One token's heads: the first n_norm (q, then k) RMS-normed over d with their weight (qw for the first n_q,
// kw after), rounded to bf16 as the reference does, then rotated: out = x cos + swap_halves(x) sin (the sin's
// first half negated, ember.ops.rope); the rest (v) copied. T: how the weights, cos and sin are held.
template <typename T>
void qk_norm_rope_token(const bf16* x, bf16* out, int64_t heads, int64_t n_q, int64_t n_norm, int64_t d,
                        const T* qw, const T* kw, const T* cos, const T* sin, float eps) {
  const int64_t nv = d / 16, nh = nv / 2;  // vectors per head, per half
  __m512 v[16];                              // d <= 256
  for (int64_t h = 0; h < n_norm; ++h) {
    const bf16* src = x + h * d;
    const T* w = h < n_q ? qw : kw;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) {
      v[i] = ember_vec::load_bf16(src + 16 * i);
      ss = _mm512_fmadd_ps(v[i], v[i], ss);
    }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
    for (int64_t i = 0; i < nv; ++i)
      v[i] = ember_vec::round_bf16(_mm512_mul_ps(_mm512_mul_ps(v[i], r), load16(w + 16 * i)));
    bf16* dst = out + h * d;
    for (int64_t i = 0; i < nh; ++i) {
      const __m512 c1 = load16(cos + 16 * i), c2 = load16(cos + 16 * (nh + i));
      const __m512 s1 = load16(sin + 16 * i), s2 = load16(sin + 16 * (nh + i));
      ember_vec::store_bf16(dst + 16 * i, _mm512_add_ps(_mm512_mul_ps(v[i], c1), _mm512_mul_ps(v[nh + i], s1)));
      ember_vec::store_bf16(dst + 16 * (nh + i), _mm512_add_ps(_mm512_mul_ps(v[nh + i], c2), _mm512_mul_ps(v[i], s2)));
    }
  }
  std::memcpy(out + n_norm * d, x + n_norm * d, (heads - n_norm) * d * sizeof(bf16));
}

// Every token of x (T, heads, d; token stride ld) into out, the weights, cos and sin held as T (cos, sin: d values a
// token, `lc` elements from one token's to the next).
template <typename T>
void qk_norm_rope_all(const bf16* x, int64_t ld, bf16* out, int64_t t, int64_t heads, int64_t n_q, int64_t n_kv,
                      int64_t d, const T* qw, const T* kw, const T* c, const T* s, int64_t lc, float eps) {
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      qk_norm_rope_token(x + i * ld, out + i * heads * d, heads, n_q, n_q + n_kv, d, qw, kw, c + i * lc, s + i * lc,
                         eps);
  });
}

at::Tensor qk_norm_rope_op(const at::Tensor& qkv, int64_t n_kv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                           const at::Tensor& cos, const at::Tensor& sin, double eps) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kBFloat16, "qk_norm_rope: qkv must be (T, heads, D) bf16");
  const int64_t t = qkv.size(0), heads = qkv.size(1), d = qkv.size(2), n_q = heads - 2 * n_kv;
  TORCH_CHECK(d % 32 == 0 && d <= 256 && n_q > 0, "qk_norm_rope: head size must be a multiple of 32 up to 256");
  TORCH_CHECK(q_weight.numel() == d && k_weight.numel() == d && cos.numel() == t * d && sin.numel() == t * d,
              "qk_norm_rope: weights of D and cos, sin of (T, 1, D) values");
  const at::Tensor x = qkv.stride(2) == 1 && qkv.stride(1) == d ? qkv : qkv.contiguous();
  at::Tensor out = at::empty({t, heads, d}, qkv.options());
  const auto* src = static_cast<const bf16*>(x.data_ptr());
  auto* dst = static_cast<bf16*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  const at::Tensor* held[] = {&q_weight, &k_weight, &cos, &sin};
  if (std::all_of(std::begin(held), std::end(held), [](const at::Tensor* a) {
        return a->scalar_type() == at::kBFloat16 && a->is_contiguous();
      })) {  // a bf16 model's, read as they are
    const auto ptr = [](const at::Tensor& a) { return static_cast<const bf16*>(a.data_ptr()); };
    qk_norm_rope_all(src, x.stride(0), dst, t, heads, n_q, n_kv, d, ptr(q_weight), ptr(k_weight), ptr(cos), ptr(sin),
                     d, e);
  } else {
    const auto f32 = [](const at::Tensor& a) { return a.to(at::kFloat).contiguous(); };
    const at::Tensor qw = f32(q_weight), kw = f32(k_weight), c = f32(cos), s = f32(sin);
    qk_norm_rope_all(src, x.stride(0), dst, t, heads, n_q, n_kv, d, qw.data_ptr<float>(), kw.data_ptr<float>(),
                     c.data_ptr<float>(), s.data_ptr<float>(), d, e);
  }
  return out;
}

// One butterfly stage within a register: lanes i and i ^ L become (a + b, a - b), a the lower lane.
template <int L>
inline __m512 butterfly(__m512 v) {
  __m512 t;
  if constexpr (L == 1) t = _mm512_permute_ps(v, 0xB1);
  else if constexpr (L == 2) t = _mm512_permute_ps(v, 0x4E);
  else if constexpr (L == 4) t = _mm512_shuffle_f32x4(v, v, 0xB1);
  else t = _mm512_shuffle_f32x4(v, v, 0x4E);
  constexpr __mmask16 upper = L == 1 ? 0xAAAA : L == 2 ? 0xCCCC : L == 4 ? 0xF0F0 : 0xFF00;
  return _mm512_mask_sub_ps(_mm512_add_ps(v, t), upper, t, v);
}

// One block of B inputs (16, 32 or 64) times the rotation: each input times its sign / sqrt(B) (the rotation's
// first column), then the Walsh-Hadamard transform in float32, rounded once to bf16.
template <int B>
void hadamard_block(const bf16* x, bf16* out, const __m512* first_column) {
  constexpr int R = B / 16;
  __m512 v[R];
  for (int r = 0; r < R; ++r) {
    v[r] = _mm512_mul_ps(ember_vec::load_bf16(x + 16 * r), first_column[r]);
    v[r] = butterfly<8>(butterfly<4>(butterfly<2>(butterfly<1>(v[r]))));
  }
  for (int len = 1; len < R; len *= 2)
    for (int r = 0; r < R; ++r)
      if (!(r & len)) {
        const __m512 a = v[r], b = v[r + len];
        v[r] = _mm512_add_ps(a, b);
        v[r + len] = _mm512_sub_ps(a, b);
      }
  for (int r = 0; r < R; ++r) ember_vec::store_bf16(out + 16 * r, v[r]);
}

template <int B>
void hadamard_rows(const bf16* x, int64_t ldx, bf16* out, int64_t t, int64_t k, const float* h) {
  __m512 first_column[B / 16];
  for (int r = 0; r < B / 16; ++r) {
    alignas(64) float c[16];
    for (int j = 0; j < 16; ++j) c[j] = h[(16 * r + j) * B];
    first_column[r] = _mm512_load_ps(c);
  }
  // ~32 KB of rows per task at the least: a query's rows stay on one thread
  at::parallel_for(0, t, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < k; j += B) hadamard_block<B>(x + i * ldx + j, out + i * k + j, first_column);
  });
}

// (T, K) bf16 rows times the block-diagonal rotation of h (B, B): h is ember.ops.rotation.hadamard's, a Sylvester
// Hadamard matrix over sqrt(B) with its rows' signs flipped, so x @ h is the signs applied, then the transform.
at::Tensor hadamard_rotate_op(const at::Tensor& x, const at::Tensor& h) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "hadamard_rotate: x must be (T, K) bf16");
  TORCH_CHECK(h.dim() == 2 && h.size(0) == h.size(1) && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "hadamard_rotate: h must be a contiguous (B, B) float32 rotation");
  const int64_t t = x.size(0), k = x.size(1), b = h.size(0);
  TORCH_CHECK((b == 16 || b == 32 || b == 64) && k % b == 0, "hadamard_rotate: blocks of 16, 32 or 64 dividing K");
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({t, k}, x.options());
  const auto* src = static_cast<const bf16*>(rows.data_ptr());
  auto* dst = static_cast<bf16*>(out.data_ptr());
  const float* hp = h.data_ptr<float>();
  if (b == 16) hadamard_rows<16>(src, rows.stride(0), dst, t, k, hp);
  else if (b == 32) hadamard_rows<32>(src, rows.stride(0), dst, t, k, hp);
  else hadamard_rows<64>(src, rows.stride(0), dst, t, k, hp);
  return out;
}

}  // namespace

extern "C" int ember_elementwise_usable() { return 1; }

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("silu_mul", &silu_mul_op);
  m.impl("qk_norm_rope", &qk_norm_rope_op);
  m.impl("hadamard_rotate", &hadamard_rotate_op);
}
