// One item of the AVX2 decode attention (arch/avx2/attention.cpp): the rows of a call over C keys of bf16 K/V,
// all in float32 (the keys and values widen exactly from bf16; q and the probabilities are not rounded). Each
// key's score is summed in one order wherever it falls in its block of 8, each value dim over the keys in key
// order: a row's result depends on its own query and keys only, whatever the rows beside it.
#include <immintrin.h>
#include <algorithm>
#include <cmath>

#include "arch/avx2/kernels.h"
#include "arch/avx2/vec.h"

namespace {

constexpr int64_t C = cagk::CHUNK;  // keys per attention item: its K and V (64 KB at D = 64) stay in L2
using cagk::Partial;

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

// Softmax numerators of one row's scores s[0, w) in place (e^(s - m) for keys [f, e), every other key exactly 0);
// its (max, sum). Blocks of zeros add nothing: a row's bits are the same for any w >= e. `cap`: the scores soft-capped
// first (cap * tanh(s / cap), each its own), 0 for none.
inline Partial exps(float* s, int64_t w, int64_t f, int64_t e_, float cap) {
  for (int64_t t = 0; cap != 0.0f && t < w; t += 8) store(s + t, softcap8(load(s + t, w - t), cap), w - t);
  float m = -INFINITY;
  for (int64_t t = f; t < e_; t++) m = std::max(m, s[t]);
  __m256 l = _mm256_setzero_ps();
  for (int64_t t = 0; t < w; t += 8) {
    const __m256i keep = _mm256_andnot_si256(lanes(std::clamp<int64_t>(f - t, 0, 8)), lanes(std::clamp<int64_t>(e_ - t, 0, 8)));
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(load(s + t, w - t), _mm256_set1_ps(m))), _mm256_castsi256_ps(keep));
    store(s + t, e, w - t);
    l = _mm256_add_ps(l, e);
  }
  return {m, hsum(l)};
}

}  // namespace

namespace cagk {

// One item: each of `rows` query rows over keys [0, w) of k, v (rows `stride` apart): part[r] = (max, sum),
// acc[r] (D) = the unnormalized sum of e^(s_t - m) v_t. Rows go two at a time (a question's tokens, a batch
// on one prefix: each key and value widened once for the pair), a last odd row alone; a row's bits are the
// same either way.
void item_avx2(const float* const* q, int64_t rows, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t w, int64_t D,
               Scaling scale, Partial* part, float* const* acc, const int64_t* from, const int64_t* to) {
  alignas(32) float s[C], s1[C];
  int64_t r = 0;
  for (; r + 1 < rows; r += 2) {
    scores2(q[r], q[r + 1], k, stride, w, D, scale.scale, s, s1);
    part[r] = exps(s, w, from ? from[r] : 0, to ? to[r] : w, scale.cap);
    part[r + 1] = exps(s1, w, from ? from[r + 1] : 0, to ? to[r + 1] : w, scale.cap);
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) weigh2<4>(s, s1, v, stride, w, d0, acc[r], acc[r + 1]);
    if (D - d0 == 16) weigh2<2>(s, s1, v, stride, w, d0, acc[r], acc[r + 1]);
  }
  for (; r < rows; r++) {
    scores(q[r], k, stride, w, D, scale.scale, s);
    part[r] = exps(s, w, from ? from[r] : 0, to ? to[r] : w, scale.cap);
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) weigh<8>(s, v, stride, w, d0, acc[r]);
    if (D - d0 == 32) weigh<4>(s, v, stride, w, d0, acc[r]);
    else if (D - d0 == 16) weigh<2>(s, v, stride, w, d0, acc[r]);
  }
}

}  // namespace cagk
