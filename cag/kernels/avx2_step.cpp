// The rest of a decode step on CPUs with AVX2, FMA and F16C but not the AVX512-BF16 floor of cag's main
// library (AMD Zen 2/3, Intel before Cooper Lake): the decode attention over bf16 K/V and the glue around
// the products (RMSNorm straight to bf16, rope with the K/V write, silu(gate) x up), with the signatures
// of the main library's ops (decode_attention.cpp), so cag/runtime/step.py calls either set alike.
// Built into the AVX2 library beside avx2_products.cpp by cag/kernels/native.py (CAG_DECODE_KERNELS=avx2).
//
// Why: with the AVX2 int4 products, torch's flash attention (two calls a layer: prefix and suffix) and
// ~20 small torch ops a layer took more of a SmolLM2 step than the products themselves
// (bench/JOURNAL.md, 2026-12-06).
//
// Attention work: keys in items of C (a prefix chunk for the rows of every request on it, or a suffix
// chunk for one request's rows), spread over torch's threads; each item leaves per row its max score m,
// its sum l of e^(s - m) and sum_t e^(s_t - m) v_t, merged per row in chunk order. All in float32: the
// keys and values widen exactly from bf16. A row's result depends on its own query and keys only, in a
// fixed order of operations: a request's bits never depend on its neighbours or on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "step_args.h"

namespace {

constexpr int64_t C = cagk::CHUNK;  // keys per attention item: its K and V (64 KB at D = 64) stay in L2

// Lanes below n set (n < 8): the mask of a row's last, partial vector.
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load(const float* p, int64_t n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n)); }
inline void store(float* p, __m256 v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes(n), v);
}

// 8 bf16 values -> float32, exactly.
inline __m256 widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// torch's float -> bf16: round to nearest even by adding 0x7FFF plus the lowest kept bit; NaN -> 0x7FC0.
inline __m128i bf16_rne(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i p = _mm256_packus_epi32(r, r);                      // per 128-bit lane: r0-r3 r0-r3 | r4-r7 r4-r7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));  // r0-r7
}
inline void store_bf16(uint16_t* p, __m256 v, int64_t n) {
  const __m128i b = bf16_rne(v);
  if (n >= 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  else std::memcpy(p, &b, 2 * n);
}

// The 8 lanes of v summed in one fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// e^x for x <= 0 (-inf gives 0): x = n ln2 + f, e^f by a degree-6 polynomial, scaled by 2^n.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n, n >= -126
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- the glue ----

// 1 / sqrt(mean(x^2) + eps) of one row x (N,) float32, its squares summed in 8 lanes, then across them.
float rms_inv(const float* x, int64_t N, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < N; j += 8) {
    const __m256 v = load(x + j, N - j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(hsum(acc) / (float)N + eps);
}

// x (R, N) float32, w (N,) float32 -> (R, N) bfloat16: LlamaRMSNorm in float32, w * (x * rsqrt(mean(x^2)
// + eps)), rounded once to bf16 (the products' input).
at::Tensor rms_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  cagk::check_rms_bf16(x, w);
  const int64_t R = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kBFloat16));
  const float *xd = x.data_ptr<float>(), *wd = w.data_ptr<float>();
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < R; r++) {
    const float* xr = xd + r * N;
    const __m256 inv = _mm256_set1_ps(rms_inv(xr, N, (float)eps));
    for (int64_t j = 0; j < N; j += 8)
      store_bf16(od + r * N + j, _mm256_mul_ps(load(wd + j, N - j), _mm256_mul_ps(load(xr + j, N - j), inv)), N - j);
  }
  return out;
}

// x (..., N) float32, w (N,) float32 -> x's shape float32: the same norm, not rounded (q/k norms, post-norms).
at::Tensor rms_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = cagk::check_rms_f32(x, w);
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  float* od = out.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  for (int64_t r = 0, R = N ? out.numel() / N : 0; r < R; r++) {
    float* xr = od + r * N;
    const __m256 inv = _mm256_set1_ps(rms_inv(xr, N, (float)eps));
    for (int64_t j = 0; j < N; j += 8) store(xr + j, _mm256_mul_ps(load(wd + j, N - j), _mm256_mul_ps(load(xr + j, N - j), inv)), N - j);
  }
  return out;
}

// gu (R, 2 I) float32, each row gate ++ up -> (R, I) bfloat16: silu(gate) * up, rounded once.
// silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  cagk::check_silu_mul(gu);
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({R, I}, gu.options().dtype(at::kBFloat16));
  const float* g0 = gu.data_ptr<float>();
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < I; j += 8) {
      const __m256 g = load(g0 + r * 2 * I + j, I - j), u = load(g0 + r * 2 * I + I + j, I - j);
      const __m256 e = exp8(_mm256_or_ps(g, sign));  // e^-|g|
      const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
      store_bf16(y + r * I + j, _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))), u), I - j);
    }
  return out;
}

// qkv (R, (H + 2 Hk) D) float32: each row's q, k and v; cos, sin (R, D) float32 (sin's first half negated,
// cag.runtime.step). Writes roped k and v as bf16 to K, V (S, Hk, room, D) at [slot[r], :, pos[r]] and returns
// roped q (R, H, D) float32. rope is x * cos + roll(x, D/2) * sin, a rounding after each product and the sum,
// as torch computes it; each half of a head in steps of 8 (D a multiple of 16), so a step's rolled operand is
// one run of x.
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor K, at::Tensor V,
                      const at::Tensor& slots, const at::Tensor& pos, int64_t H) {
  cagk::check_rope_write(qkv, cos, sin, K, V, slots, pos, H);
  const int64_t R = qkv.size(0), Hk = K.size(1), D = K.size(3), room = K.size(2), half = D / 2;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  at::Tensor q = at::empty({R, H, D}, qkv.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  float* qd = q.data_ptr<float>();
  uint16_t* kd = reinterpret_cast<uint16_t*>(K.data_ptr<at::BFloat16>());
  uint16_t* vd = reinterpret_cast<uint16_t*>(V.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < R; r++) {
    const float* row = qkv.data_ptr<float>() + r * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + r * D;
    const float* sn = sin.data_ptr<float>() + r * D;
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
  return q;
}

// ---- the attention ----

struct Partial { float m, l; };

// Scores of one query row q (D,) against keys k[t] (rows `stride` apart), t in [0, w), times scale, into s:
// 8 keys at a time, each key's 8 lane sums reduced in the same order whichever of the 8 it is (a last,
// partial block repeats its last key), so a key's score does not depend on where its block starts.
void scores(const float* q, const uint16_t* k, int64_t stride, int64_t w, int64_t D, float scale, float* s) {
  for (int64_t t0 = 0; t0 < w; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, w - t0);
    const uint16_t* kr[8];
    for (int j = 0; j < 8; j++) kr[j] = k + (t0 + std::min<int64_t>(j, n - 1)) * stride;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, widen(kr[j] + d), a[j]);
    }
    // lane sums of a[j] land in lane j: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) for every j
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
    store(s + t0, _mm256_mul_ps(sum, _mm256_set1_ps(scale)), n);
  }
}

// acc[d0 .. d0 + 8 NB) = sum_t p[t] v[t][d] over t in [0, w), in key order.
template <int NB>
inline void weigh(const float* p, const uint16_t* v, int64_t stride, int64_t w, int64_t d0, float* acc) {
  __m256 o[NB];
  for (int i = 0; i < NB; i++) o[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < w; t++) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const uint16_t* vr = v + t * stride + d0;
    for (int i = 0; i < NB; i++) o[i] = _mm256_fmadd_ps(pt, widen(vr + 8 * i), o[i]);
  }
  for (int i = 0; i < NB; i++) _mm256_storeu_ps(acc + d0 + 8 * i, o[i]);
}

// The lane sums of a[0..7] (one key each), reduced in one order for every key: lane j of the result is
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of a[j].
inline __m256 key_sums(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// scores() of two query rows at once: each key block widened once for both. Every (row, key) sum is the
// same chain of FMAs over d and the same reduction as scores() gives it, so the same bits; the keys go
// four at a time (8 accumulators, two q vectors and a key: within the 16 AVX2 registers).
void scores2(const float* q0, const float* q1, const uint16_t* k, int64_t stride, int64_t w, int64_t D, float scale,
             float* s0, float* s1) {
  for (int64_t t0 = 0; t0 < w; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, w - t0);
    __m256 a[8], b[8];
    for (int half = 0; half < 8; half += 4) {
      const uint16_t* kr[4];
      for (int j = 0; j < 4; j++) kr[j] = k + (t0 + std::min<int64_t>(half + j, n - 1)) * stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
        __m256 kv = widen(kr[0] + d);
        a0 = _mm256_fmadd_ps(x, kv, a0), b0 = _mm256_fmadd_ps(y, kv, b0);
        kv = widen(kr[1] + d);
        a1 = _mm256_fmadd_ps(x, kv, a1), b1 = _mm256_fmadd_ps(y, kv, b1);
        kv = widen(kr[2] + d);
        a2 = _mm256_fmadd_ps(x, kv, a2), b2 = _mm256_fmadd_ps(y, kv, b2);
        kv = widen(kr[3] + d);
        a3 = _mm256_fmadd_ps(x, kv, a3), b3 = _mm256_fmadd_ps(y, kv, b3);
      }
      a[half] = a0, a[half + 1] = a1, a[half + 2] = a2, a[half + 3] = a3;
      b[half] = b0, b[half + 1] = b1, b[half + 2] = b2, b[half + 3] = b3;
    }
    store(s0 + t0, _mm256_mul_ps(key_sums(a), _mm256_set1_ps(scale)), n);
    store(s1 + t0, _mm256_mul_ps(key_sums(b), _mm256_set1_ps(scale)), n);
  }
}

// weigh() of two rows over one block of 32 dims (or 16: NB = 2), each value row widened once for both; each
// dim's sum over t in key order, as weigh() has it.
template <int NB>
inline void weigh2(const float* p0, const float* p1, const uint16_t* v, int64_t stride, int64_t w, int64_t d0, float* acc0,
                   float* acc1) {
  __m256 o[NB], u[NB];
  for (int i = 0; i < NB; i++) o[i] = u[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < w; t++) {
    const __m256 x = _mm256_set1_ps(p0[t]), y = _mm256_set1_ps(p1[t]);
    const uint16_t* vr = v + t * stride + d0;
    for (int i = 0; i < NB; i++) {
      const __m256 vv = widen(vr + 8 * i);
      o[i] = _mm256_fmadd_ps(x, vv, o[i]);
      u[i] = _mm256_fmadd_ps(y, vv, u[i]);
    }
  }
  for (int i = 0; i < NB; i++) _mm256_storeu_ps(acc0 + d0 + 8 * i, o[i]), _mm256_storeu_ps(acc1 + d0 + 8 * i, u[i]);
}

// Softmax numerators of one row's scores s[0, w) in place (e^(s - m), masked past w); its (max, sum).
inline Partial exps(float* s, int64_t w) {
  float m = -INFINITY;
  for (int64_t t = 0; t < w; t++) m = std::max(m, s[t]);
  __m256 l = _mm256_setzero_ps();
  for (int64_t t = 0; t < w; t += 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load(s + t, w - t), _mm256_set1_ps(m))),
                                   _mm256_castsi256_ps(lanes(std::min<int64_t>(8, w - t))));
    store(s + t, e, w - t);
    l = _mm256_add_ps(l, e);
  }
  return {m, hsum(l)};
}

// One item: each of `rows` query rows over keys [0, w) of k, v (rows `stride` apart): part[r] = (max, sum),
// acc[r] (D) = the unnormalized sum of e^(s_t - m) v_t. Rows go two at a time (a question's tokens, a batch
// on one prefix: each key and value widened once for the pair), a last odd row alone; a row's bits are the
// same either way.
void item(const float* const* q, int64_t rows, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t w, int64_t D,
          float scale, Partial* part, float* const* acc) {
  alignas(32) float s[C], s1[C];
  int64_t r = 0;
  for (; r + 1 < rows; r += 2) {
    scores2(q[r], q[r + 1], k, stride, w, D, scale, s, s1);
    part[r] = exps(s, w);
    part[r + 1] = exps(s1, w);
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) weigh2<4>(s, s1, v, stride, w, d0, acc[r], acc[r + 1]);
    if (D - d0 == 16) weigh2<2>(s, s1, v, stride, w, d0, acc[r], acc[r + 1]);
  }
  for (; r < rows; r++) {
    scores(q[r], k, stride, w, D, scale, s);
    part[r] = exps(s, w);
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) weigh<8>(s, v, stride, w, d0, acc[r]);
    if (D - d0 == 32) weigh<4>(s, v, stride, w, d0, acc[r]);
    else if (D - d0 == 16) weigh<2>(s, v, stride, w, d0, acc[r]);
  }
}

// q (B, H, R, D) float32: request b, K/V head h, row r (the query heads sharing h); kp, vp (H, n, D) bf16:
// the prefix the requests share (n may be 0); ks, vs (S, H, room, D) bf16: the request slots; slots (B,),
// lens (B,) int64: request b reads keys [0, lens[b]) of slot slots[b]. -> (B, H, R, D) float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& ks,
                            const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale_) {
  cagk::check_attention_q(q);
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  const int64_t most = cagk::check_attention(B, H, D, kp, vp, ks, vs, slots, lens, false);  // suffix chunks of the longest suffix
  const int64_t n = kp.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t np = (n + C - 1) / C, chunks = np + most;  // per row: prefix chunks, then suffix chunks
  std::vector<int64_t> items;                             // prefix items (h, c), then suffix items (b, h, c)
  for (int64_t h = 0; h < H; h++)
    for (int64_t c = 0; c < np; c++) items.push_back(h * np + c);
  const int64_t n_pre = (int64_t)items.size();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t c = 0; c < (len[b] + C - 1) / C; c++) items.push_back((b * H + h) * most + c);
  std::vector<Partial> part(B * H * R * chunks);
  std::vector<float> acc(B * H * R * chunks * D);
  const float* qd = q.data_ptr<float>();
  const float scale = (float)scale_;
  auto at_ = [&](int64_t b, int64_t h, int64_t r, int64_t c) { return ((b * H + h) * R + r) * chunks + c; };
  const uint16_t* kpd = reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>());
  const uint16_t* vpd = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>());
  const uint16_t* ksd = reinterpret_cast<const uint16_t*>(ks.data_ptr<at::BFloat16>());
  const uint16_t* vsd = reinterpret_cast<const uint16_t*>(vs.data_ptr<at::BFloat16>());
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> qs(B * R);
    std::vector<float*> accs(B * R);
    std::vector<Partial> ps(B * R);
    for (int64_t i = i0; i < i1; i++) {
      if (i < n_pre) {  // a prefix chunk: every request's rows
        const int64_t h = items[i] / np, c = items[i] % np, t0 = c * C;
        for (int64_t b = 0; b < B; b++)
          for (int64_t r = 0; r < R; r++) {
            qs[b * R + r] = qd + ((b * H + h) * R + r) * D;
            accs[b * R + r] = acc.data() + at_(b, h, r, c) * D;
          }
        item(qs.data(), B * R, kpd + h * kp.stride(0) + t0 * kp.stride(1), vpd + h * vp.stride(0) + t0 * vp.stride(1), kp.stride(1),
             std::min(C, n - t0), D, scale, ps.data(), accs.data());
        for (int64_t b = 0; b < B; b++)
          for (int64_t r = 0; r < R; r++) part[at_(b, h, r, c)] = ps[b * R + r];
      } else {  // a suffix chunk: one request's rows
        const int64_t f = items[i], c = f % most, b = f / most / H, h = (f / most) % H, t0 = c * C;
        for (int64_t r = 0; r < R; r++) {
          qs[r] = qd + ((b * H + h) * R + r) * D;
          accs[r] = acc.data() + at_(b, h, r, np + c) * D;
        }
        const int64_t off_k = slot[b] * ks.stride(0) + h * ks.stride(1) + t0 * ks.stride(2);
        const int64_t off_v = slot[b] * vs.stride(0) + h * vs.stride(1) + t0 * vs.stride(2);
        item(qs.data(), R, ksd + off_k, vsd + off_v, ks.stride(2), std::min(C, len[b] - t0), D, scale, ps.data(), accs.data());
        for (int64_t r = 0; r < R; r++) part[at_(b, h, r, np + c)] = ps[r];
      }
    }
  });
  at::Tensor out = at::empty(q.sizes(), q.options());
  float* od = out.data_ptr<float>();
  std::vector<float> ev(chunks);
  for (int64_t b = 0; b < B; b++)  // each row's chunks merged in a fixed order: prefix, then suffix
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++) {
        const int64_t k0 = at_(b, h, r, 0), kn = np + (len[b] + C - 1) / C;
        float m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < kn; c++) m = std::max(m, part[k0 + c].m);
        for (int64_t c = 0; c < kn; c++) { ev[c] = std::exp(part[k0 + c].m - m); l += part[k0 + c].l * ev[c]; }
        float* dst = od + ((b * H + h) * R + r) * D;
        for (int64_t j = 0; j < D; j += 8) {
          __m256 o = _mm256_setzero_ps();
          for (int64_t c = 0; c < kn; c++) o = _mm256_fmadd_ps(_mm256_set1_ps(ev[c]), _mm256_loadu_ps(acc.data() + (k0 + c) * D + j), o);
          _mm256_storeu_ps(dst + j, _mm256_div_ps(o, _mm256_set1_ps(l)));
        }
      }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag_avx2, m) {
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("rms_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rms_f32(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, Tensor slots, Tensor pos, int H) -> Tensor");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag_avx2, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("rms_bf16", rms_bf16);
  m.impl("rms_f32", rms_f32);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul_bf16", silu_mul_bf16);
}
