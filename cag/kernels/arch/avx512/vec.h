// The AVX-512 library's vector helpers (16 float lanes), written once for its attention (arch/avx512/,
// arch/amx/) and glue: e^x and torch's float -> bf16 rounding.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace {

// e^x for x <= 0 (-inf gives 0): x = n ln2 + f, e^f by a degree-6 polynomial, scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap) (attention logit soft-capping): tanh |y| = (1 - e) / (1 + e), e = e^(-2 |y|), the sign put
// back; |y| past 44 gives 1 exactly.
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 y = _mm512_div_ps(x, _mm512_set1_ps(cap));
  const __m512 a = _mm512_abs_ps(y);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 signed_t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
      _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u))));
  return _mm512_mul_ps(signed_t, _mm512_set1_ps(cap));
}

// torch's float -> bf16: round to nearest even by adding 0x7FFF plus the lowest kept bit; NaN -> 0x7FC0.
inline __m256i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The mask of lanes [j, n) of a row of n, at most 16: a row's last, partial vector.
inline __mmask16 tail16(int64_t n, int64_t j) { return (__mmask16)(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1); }

}  // namespace
