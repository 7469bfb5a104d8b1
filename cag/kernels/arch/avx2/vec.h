// The AVX2 library's vector helpers (8 float lanes), written once for its products, attention and glue:
// masked tails, bf16 <-> float32 as torch converts, a lane sum in one fixed order, e^x.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace {

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
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4 .. l3+l7
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                   // (0+2), (1+3)
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

// cap * tanh(x / cap) (attention logit soft-capping), as the AVX-512 library's softcap16 computes it.
inline __m256 softcap8(__m256 x, float cap) {
  const __m256 y = _mm256_div_ps(x, _mm256_set1_ps(cap));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign)), _mm256_set1_ps(cap));
}

}  // namespace
