// What an item of the AVX-512 library's decode attention works with, written once for the AVX512-BF16 item
// (arch/avx512/attention_item.cpp) and the AMX one (arch/amx/attention_item.cpp): its scratch memory, the
// query rows rounded to bf16 and K and V laid out in dword pairs of bf16 (the operands of both dot products).
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <cstdint>

#include "common/attention_plan.h"

namespace cagk {

// An item's working memory (~165 KB), per thread: not on the stack of a pool thread.
struct Scratch {
  alignas(64) uint32_t kt[(MAXD / 2) * CHUNK];  // (D/2, wp): kt[i][t] = (K[t][2i], K[t][2i+1]), AMX's B for scores
  alignas(64) uint32_t vp[(CHUNK / 2) * MAXD];  // (wp/2, D): vp[u][d] = (V[2u][d], V[2u+1][d]), AMX's B for values
  alignas(64) uint16_t qb[16 * MAXD];           // (16, D) a block of query rows in bf16
  alignas(64) float s[16 * CHUNK];              // (16, C) scores
  alignas(64) uint16_t pb[16 * CHUNK];          // (16, C) probabilities in bf16
  alignas(64) float out[16 * MAXD];             // (16, D)
};
extern thread_local Scratch scratch;  // defined in arch/avx512/attention_item.cpp

}  // namespace cagk

namespace {

// Keys [16 b, 16 b + 16) of an item (rows of D bf16, `stride` apart; those past w skipped) on their way
// to L1 while the block before them is worked on.
inline void prefetch_keys(const at::BFloat16* k, int64_t b, int64_t w, int64_t stride, int64_t D) {
  for (int64_t u = 0; u < 16 && b * 16 + u < w; u++)
    for (int64_t off = 0; off < D * 2; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(k + (b * 16 + u) * stride) + off, _MM_HINT_T0);
}

// q rows (fp32, D floats each) rounded to bf16 into qb (rows D apart); rows past nr (up to `to`) zero.
// 32 dims a step; a width of 32 g + 16 ends with 16 (the same rounding per element).
inline void round_q(const float* const* q, int64_t nr, int64_t to, int64_t D, uint16_t* qb) {
  for (int64_t r = 0; r < to; r++) {
    int64_t j = 0;
    for (; j + 32 <= D; j += 32) {
      __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
      if (r < nr) { lo = _mm512_loadu_ps(q[r] + j); hi = _mm512_loadu_ps(q[r] + j + 16); }
      _mm512_storeu_si512(qb + r * D + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    if (j < D) {
      const __m512 lo = r < nr ? _mm512_loadu_ps(q[r] + j) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + r * D + j), (__m256i)_mm512_cvtneps_pbh(lo));
    }
  }
}

// Dims [d, d + 16) of keys t and t + 1 (rows `stride` apart; a key at or past w reads as zeros) as 16
// dword pairs (V[t][d + j], V[t + 1][d + j]): a row of the paired V layout (vp, pair_kv's vt).
inline __m512i pair_dims(const at::BFloat16* v, int64_t stride, int64_t t, int64_t w, int64_t d) {
  const __m256i a = t < w ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t * stride + d)) : _mm256_setzero_si256();
  const __m256i c = t + 1 < w ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (t + 1) * stride + d)) : _mm256_setzero_si256();
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
}

}  // namespace
