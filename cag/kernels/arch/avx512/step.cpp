// The glue around a decode step's products on AVX-512 (the AVX-512 library), one call each instead of ~8
// and ~14 small torch ops a layer: RMSNorm straight to bf16 (rms_bf16) or not rounded (rms_f32), rope with the
// K/V write (rope_write), silu(gate) x up rounding once to bf16 (silu_mul_bf16), as cag/runtime/step.py calls
// them; the row functions also serve layer.cpp's one call. 16-lane steps with masked tails; a row's bits its own.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>

#include "arch/avx512/kernels.h"
#include "arch/avx512/vec.h"
#include "common/step_args.h"

namespace cagk {

// 1 / sqrt(mean(x^2) + eps) of one row x (N,) float32: the sum of squares in 16 lanes, then across them in a
// fixed order, so a row's bits are its own (rms_rows and rms_rows_f32 share it).
static float rms_inv(const float* xr, int64_t N, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = tail16(N, j);
    const __m512 v = _mm512_maskz_loadu_ps(m, xr + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)N + eps);
}

void rms_rows(const float* xd, const float* wd, int64_t R, int64_t N, float eps, uint16_t* od) {
  for (int64_t r = 0; r < R; r++) {
    const float* xr = xd + r * N;
    const float inv = rms_inv(xr, N, eps);
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = tail16(N, j);
      const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wd + j), _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), _mm512_set1_ps(inv)));
      _mm256_mask_storeu_epi16(od + r * N + j, m, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

void rms_rows_f32(float* x, int64_t ld, const float* wd, int64_t R, int64_t N, float eps) {
  for (int64_t r = 0; r < R; r++) {
    float* xr = x + r * ld;
    const float inv = rms_inv(xr, N, eps);
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = tail16(N, j);
      _mm512_mask_storeu_ps(xr + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wd + j),
                                                     _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), _mm512_set1_ps(inv))));
    }
  }
}

// rope is x * cos + roll(x, D/2) * sin with a rounding after each product and the sum, as torch computes it.
// Each half of a head runs in steps of 16 (the last one masked where D/2 is not a multiple of 16: 40 of
// a head of 80), so a step's rolled operand is one run of x: roll(x, D/2)[j] = x[j + D/2] in the first
// half, x[j - D/2] in the second.
void rope_rows(const float* qkv, int64_t ld, const float* cd, const float* sd, int64_t R, int64_t H, int64_t Hk,
               int64_t D, int64_t room, const int64_t* sl, const int64_t* ps, float* qd, uint16_t* kd, uint16_t* vd) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; r++) {
    const float* row = qkv + r * ld;
    const float* c = cd + r * D;
    const float* sn = sd + r * D;
    for (int64_t h = 0; h < H + Hk; h++) {  // q heads, then k heads
      const float* x = row + h * D;
      for (int64_t j0 : {(int64_t)0, half})
        for (int64_t j = j0; j < j0 + half; j += 16) {
          const int64_t o = j0 ? j - half : j + half;
          const __mmask16 m = tail16(j0 + half, j);
          const __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_maskz_loadu_ps(m, c + j)),
                                         _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + o), _mm512_maskz_loadu_ps(m, sn + j)));
          if (h < H) _mm512_mask_storeu_ps(qd + (r * H + h) * D + j, m, y);
          else _mm256_mask_storeu_epi16(kd + ((sl[r] * Hk + (h - H)) * room + ps[r]) * D + j, m, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
    for (int64_t h = 0; h < Hk; h++)
      for (int64_t j = 0; j < D; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(vd + ((sl[r] * Hk + h) * room + ps[r]) * D + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + (H + Hk + h) * D + j)));
  }
}

void to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail16(n, j);
    _mm256_mask_storeu_epi16(y + j, m, bf16_rne(_mm512_maskz_loadu_ps(m, x + j)));
  }
}

// silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
void silu_mul_rows(const float* gu, int64_t R, int64_t I, uint16_t* y) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < I; j += 16) {
      const __mmask16 m = tail16(I, j);
      const __m512 g = _mm512_maskz_loadu_ps(m, gu + r * 2 * I + j), u = _mm512_maskz_loadu_ps(m, gu + r * 2 * I + I + j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
      const __m512 one = _mm512_set1_ps(1.0f), den = _mm512_add_ps(one, e);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, one), den);
      _mm256_mask_storeu_epi16(y + r * I + j, m, bf16_rne(_mm512_mul_ps(_mm512_mul_ps(g, sig), u)));
    }
}

}  // namespace cagk

namespace {

// x (R, N) float32, w (N,) float32 -> (R, N) bfloat16: LlamaRMSNorm in float32, w * (x * rsqrt(mean(x^2)
// + eps)), rounded once to bf16 (the packed products' input).
at::Tensor rms_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  cagk::check_rms_bf16(x, w);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kBFloat16));
  cagk::rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), (float)eps,
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// x (..., N) float32, w (N,) float32 -> x's shape float32: the same norm as rms_bf16 (LlamaRMSNorm's order),
// not rounded: the step's q/k norms (per head or over the projection) and post-norms.
at::Tensor rms_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = cagk::check_rms_f32(x, w);
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  cagk::rms_rows_f32(out.data_ptr<float>(), N, w.data_ptr<float>(), N ? out.numel() / N : 0, N, (float)eps);
  return out;
}

// gu (R, 2 I) float32, each row gate ++ up -> (R, I) bfloat16: silu(gate) * up, rounded once (torch's rounding).
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  cagk::check_silu_mul(gu);
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options().dtype(at::kBFloat16));
  cagk::silu_mul_rows(gu.data_ptr<float>(), gu.size(0), gu.size(1) / 2, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// qkv (R, (H + 2 Hk) D) float32: each row's q, k and v; cos, sin (R, D) float32 (sin's first half
// negated, cag.runtime.step). Writes roped k and v as bf16 to K, V (S, Hk, room, D) at [slot[r], :, pos[r]]
// and returns roped q (R, H, D) float32: the same bits as the formula in torch.
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor K, at::Tensor V,
                      const at::Tensor& slots, const at::Tensor& pos, int64_t H) {
  cagk::check_rope_write(qkv, cos, sin, K, V, slots, pos, H);
  const int64_t R = qkv.size(0), Hk = K.size(1), D = K.size(3);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  at::Tensor q = at::empty({R, H, D}, qkv.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  cagk::rope_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), R, H, Hk, D, K.size(2),
                  sl, ps, q.data_ptr<float>(), reinterpret_cast<uint16_t*>(K.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(V.data_ptr<at::BFloat16>()));
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag, m) {
  m.def("rms_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, Tensor slots, Tensor pos, int H) -> Tensor");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
  m.def("rms_f32(Tensor x, Tensor w, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("rms_bf16", rms_bf16);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul_bf16", silu_mul_bf16);
  m.impl("rms_f32", rms_f32);
}
