// The glue around a decode step's products on CPUs with AVX2, FMA and F16C but not the AVX512-BF16 floor of
// cag's main library (AMD Zen 2/3, Intel before Cooper Lake): RMSNorm straight to bf16, rope with the K/V write,
// silu(gate) x up, with the signatures of the main library's ops (arch/avx512/step.cpp), so cag/runtime/step.py
// calls either set alike; the row functions under them (cagk::avx2, kernels.h) also run inside layer.cpp's one
// call. Built into the AVX2 library with the rest of arch/avx2/ by cag/kernels/native.py (CAG_DECODE_KERNELS=avx2).
//
// Why: with the AVX2 int4 products, torch's flash attention (two calls a layer: prefix and suffix) and
// ~20 small torch ops a layer took more of a SmolLM2 step than the products themselves
// (bench/JOURNAL.md, 2026-12-06). Each op runs its rows in 8-lane steps with masked tails, a row's bits its own.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>

#include "arch/avx2/kernels.h"
#include "arch/avx2/vec.h"
#include "common/step_args.h"

namespace {

// 1 / sqrt(mean(x^2) + eps) of one row x (N,) float32, its squares summed in 8 lanes, then across them.
float rms_inv(const float* x, int64_t N, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < N; j += 8) {
    const __m256 v = load(x + j, N - j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(hsum(acc) / (float)N + eps);
}

}  // namespace

namespace cagk::avx2 {

void rms_rows(const float* xd, const float* wd, int64_t R, int64_t N, float eps, uint16_t* od) {
  for (int64_t r = 0; r < R; r++) {
    const float* xr = xd + r * N;
    const __m256 inv = _mm256_set1_ps(rms_inv(xr, N, eps));
    for (int64_t j = 0; j < N; j += 8)
      store_bf16(od + r * N + j, _mm256_mul_ps(load(wd + j, N - j), _mm256_mul_ps(load(xr + j, N - j), inv)), N - j);
  }
}

void rms_rows_f32(float* x, int64_t ld, const float* wd, int64_t R, int64_t N, float eps) {
  for (int64_t r = 0; r < R; r++) {
    float* xr = x + r * ld;
    const __m256 inv = _mm256_set1_ps(rms_inv(xr, N, eps));
    for (int64_t j = 0; j < N; j += 8) store(xr + j, _mm256_mul_ps(load(wd + j, N - j), _mm256_mul_ps(load(xr + j, N - j), inv)), N - j);
  }
}

void to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t j = 0; j < n; j += 8) store_bf16(y + j, load(x + j, n - j), n - j);
}

// silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
void silu_mul_rows(const float* g0, int64_t R, int64_t I, uint16_t* y) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < I; j += 8) {
      const __m256 g = load(g0 + r * 2 * I + j, I - j), u = load(g0 + r * 2 * I + I + j, I - j);
      const __m256 e = exp8(_mm256_or_ps(g, sign));  // e^-|g|
      const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
      store_bf16(y + r * I + j, _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))), u), I - j);
    }
}

// rope is x * cos + roll(x, D/2) * sin, a rounding after each product and the sum, as torch computes it; each
// half of a head in steps of 8 (D a multiple of 16), so a step's rolled operand is one run of x.
void rope_rows(const float* qkv, int64_t ld, const float* cd, const float* sd, int64_t R, int64_t H, int64_t Hk,
               int64_t D, int64_t room, const int64_t* sl, const int64_t* ps, float* qd, uint16_t* kd, uint16_t* vd) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; r++) {
    const float* row = qkv + r * ld;
    const float* c = cd + r * D;
    const float* sn = sd + r * D;
    for (int64_t h = 0; h < H + Hk; h++) {  // q heads, then k heads
      const float* x = row + h * D;
      for (int64_t j = 0; j < D; j += 8) {
        const int64_t o = j < half ? j + half : j - half;
        const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(c + j)),
                                       _mm256_mul_ps(_mm256_loadu_ps(x + o), _mm256_loadu_ps(sn + j)));
        if (h < H) _mm256_storeu_ps(qd + (r * H + h) * D + j, y);
        else store_bf16(kd + ((sl[r] * Hk + (h - H)) * room + ps[r]) * D + j, y, 8);
      }
    }
    for (int64_t h = 0; h < Hk; h++)
      for (int64_t j = 0; j < D; j += 8)
        store_bf16(vd + ((sl[r] * Hk + h) * room + ps[r]) * D + j, _mm256_loadu_ps(row + (H + Hk + h) * D + j), 8);
  }
}

}  // namespace cagk::avx2

namespace {

// x (R, N) float32, w (N,) float32 -> (R, N) bfloat16: LlamaRMSNorm in float32, w * (x * rsqrt(mean(x^2)
// + eps)), rounded once to bf16 (the products' input).
at::Tensor rms_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  cagk::check_rms_bf16(x, w);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kBFloat16));
  cagk::avx2::rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), (float)eps,
                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// x (..., N) float32, w (N,) float32 -> x's shape float32: the same norm, not rounded (q/k norms, post-norms).
at::Tensor rms_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = cagk::check_rms_f32(x, w);
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  cagk::avx2::rms_rows_f32(out.data_ptr<float>(), N, w.data_ptr<float>(), N ? out.numel() / N : 0, N, (float)eps);
  return out;
}

// gu (R, 2 I) float32, each row gate ++ up -> (R, I) bfloat16: silu(gate) * up, rounded once.
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  cagk::check_silu_mul(gu);
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options().dtype(at::kBFloat16));
  cagk::avx2::silu_mul_rows(gu.data_ptr<float>(), gu.size(0), gu.size(1) / 2,
                            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// qkv (R, (H + 2 Hk) D) float32: each row's q, k and v; cos, sin (R, D) float32 (sin's first half negated,
// cag.runtime.step). Writes roped k and v as bf16 to K, V (S, Hk, room, D) at [slot[r], :, pos[r]] and returns
// roped q (R, H, D) float32.
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor K, at::Tensor V,
                      const at::Tensor& slots, const at::Tensor& pos, int64_t H) {
  cagk::check_rope_write(qkv, cos, sin, K, V, slots, pos, H);
  const int64_t R = qkv.size(0), Hk = K.size(1), D = K.size(3);
  at::Tensor q = at::empty({R, H, D}, qkv.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  cagk::avx2::rope_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), R, H, Hk, D,
                        K.size(2), slots.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), q.data_ptr<float>(),
                        reinterpret_cast<uint16_t*>(K.data_ptr<at::BFloat16>()),
                        reinterpret_cast<uint16_t*>(V.data_ptr<at::BFloat16>()));
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag_avx2, m) {
  m.def("rms_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rms_f32(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, Tensor slots, Tensor pos, int H) -> Tensor");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag_avx2, CPU, m) {
  m.impl("rms_bf16", rms_bf16);
  m.impl("rms_f32", rms_f32);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul_bf16", silu_mul_bf16);
}
