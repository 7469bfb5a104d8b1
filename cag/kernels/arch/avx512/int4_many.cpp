// int4 products of many rows (a prefill's pieces: cag.runtime.knowledge_kv, a question's rows), the same bits
// as products.cpp's int4_acc / int4_rows for each (row, output), faster: the nibbles and steps a block of
// weights unpacks to are made once per block of up to RB rows and read by every 4 rows of it, instead of
// unpacked again for each 4 (~6 of int4_acc's ~18 vector ops a (row, output) pair of groups at 4 rows a block).
// Layouts as products.cpp says.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "arch/avx512/kernels.h"
#include "arch/avx512/rows.h"

namespace {

// One panel's 16 outputs unpacked, per output o and group pair j (NP = GP / 2 pairs, NC = GP / 16 rounded up):
// w[(o NP + j) 2] 128 + q as bf16 (inputs 0-15 of both groups), w[.. + 1] (inputs 16-31); dv[o NP + j] the
// steps (lanes 0-7 group 2j's, 8-15 group 2j + 1's); c[o NC + k] m - 128 d of groups 16k on: the very values
// int4_acc computes in registers.
struct Unpacked {
  std::vector<__m512i> w;
  std::vector<__m512> dv, c;
};

void unpack(const uint8_t* q, const uint16_t* d, int64_t S, int64_t GP, int64_t n, int64_t no, Unpacked& u) {
  const int64_t NP = GP / 2, NC = (GP + 15) / 16;
  u.w.resize(16 * NP * 2), u.dv.resize(16 * NP), u.c.resize(16 * NC);
  const __m512i low = _mm512_set1_epi16(0x000F), one28 = _mm512_set1_epi16(0x4300);
  for (int64_t o = 0; o < no; o++) {
    const uint16_t* dn = d + (n + o) * S * GP;
    for (int64_t g0 = 0; g0 < GP; g0 += 16) {
      const int64_t ng = std::min<int64_t>(16, GP - g0);
      const __mmask16 gm = (__mmask16)((1u << ng) - 1);
      const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, dn + g0));
      const __m512 m16 = S == 2 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, dn + GP + g0)) : _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f));
      u.c[o * NC + g0 / 16] = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d16, m16);
      __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      for (int64_t g = 0; g < ng; g += 2, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {
        const int64_t j = (g0 + g) / 2;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + (n + o) * GP * 16 + (g0 + g) * 16)));
        u.w[(o * NP + j) * 2] = _mm512_or_si512(_mm512_and_si512(w, low), one28);
        u.w[(o * NP + j) * 2 + 1] = _mm512_or_si512(_mm512_srli_epi16(w, 4), one28);
        u.dv[o * NP + j] = _mm512_permutexvar_ps(idx, d16);
      }
    }
  }
}

// int4_acc over unpacked outputs [o0, o0 + NO): per (row, output) the same operations on the same values.
template <int NR, int NO>
inline void int4_acc_many(const Unpacked& u, int64_t GP, const uint16_t* xp, int64_t K, const float* xs, int64_t G,
                          int64_t o0, __m512* acc) {
  const int64_t NP = GP / 2, NC = (GP + 15) / 16;
  __m512 a[NR][NO];
  for (int r = 0; r < NR; r++)
    for (int o = 0; o < NO; o++) a[r][o] = acc[r * 16 + o];
  for (int64_t g0 = 0; g0 < GP; g0 += 16) {
    const int64_t ng = std::min<int64_t>(16, GP - g0);
    const __mmask16 gm = (__mmask16)((1u << ng) - 1);
    for (int o = 0; o < NO; o++) {
      const __m512 c16 = u.c[(o0 + o) * NC + g0 / 16];
      for (int r = 0; r < NR; r++) a[r][o] = _mm512_fmadd_ps(c16, _mm512_maskz_loadu_ps(gm, xs + r * G + g0), a[r][o]);
    }
    for (int64_t g = 0; g < ng; g += 2) {
      const int64_t j = (g0 + g) / 2;
      __m512bh x0[NR], x1[NR];
      for (int r = 0; r < NR; r++) {
        const uint16_t* xr = xp + r * K + (g0 + g) * 32;
        x0[r] = (__m512bh)_mm512_loadu_si512(xr), x1[r] = (__m512bh)_mm512_loadu_si512(xr + 32);
      }
      for (int o = 0; o < NO; o++) {
        const __m512bh lo = (__m512bh)u.w[((o0 + o) * NP + j) * 2], hi = (__m512bh)u.w[((o0 + o) * NP + j) * 2 + 1];
        const __m512 dv = u.dv[(o0 + o) * NP + j];
        for (int r = 0; r < NR; r++) {
          __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, x0[r]);
          s = _mm512_dpbf16_ps(s, hi, x1[r]);
          a[r][o] = _mm512_fmadd_ps(s, dv, a[r][o]);
        }
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int o = 0; o < NO; o++) acc[r * 16 + o] = a[r][o];
}

// int4_rows over a panel's unpacked outputs [n, n + no).
template <int NR>
void int4_rows_many(const Unpacked& u, int64_t GP, const uint16_t* xp, int64_t K, const float* xs, float* y, int64_t N,
                    int64_t n, int64_t no, __m512* carry, bool first, bool last) {
  constexpr int NO = int4_outs<NR>();
  const int64_t G = K / 32;
  __m512 acc[NR][16];
  for (int r = 0; r < NR; r++)
    for (int64_t o = 0; o < no; o++) acc[r][o] = first ? _mm512_setzero_ps() : carry[r * 16 + o];
  int64_t o = 0;
  for (; o + NO <= no; o += NO) int4_acc_many<NR, NO>(u, GP, xp, K, xs, G, o, &acc[0][o]);
  for (; o < no; o++) int4_acc_many<NR, 1>(u, GP, xp, K, xs, G, o, &acc[0][o]);
  for (int r = 0; r < NR; r++) {
    if (!last) for (int64_t j = 0; j < no; j++) carry[r * 16 + j] = acc[r][j];
    else if (no == 16) _mm512_storeu_ps(y + r * N + n, hsum16(acc[r]));
    else for (int64_t j = 0; j < no; j++) y[r * N + n + j] = hsum(acc[r][j]);
  }
}

}  // namespace

namespace cagk {

void int4_outputs_many(const uint8_t* q, const uint16_t* d, int64_t K, int64_t M, const uint16_t* xp, const float* xs,
                       float* y, int64_t N, int64_t n0, int64_t n1, int64_t S, int64_t P) {
  const int64_t G = K / 32, GP = G / P;
  // Blocks of rows whose x of a panel stays in L2 (~256 KiB), each unpacking the weights once per 16 outputs.
  const int64_t RB = std::max<int64_t>(16, std::min<int64_t>(128, 131072 / (K / P) / 4 * 4));
  thread_local Unpacked u;
  std::vector<__m512> carry(P > 1 ? RB * 16 : 0);  // rows [r, r + NR)'s sums at r * 16 on, from panel to panel
  for (int64_t r0 = 0; r0 < M; r0 += RB)
    for (int64_t n = n0; n < n1; n += 16)
      for (int64_t p = 0; p < P; p++) {
        const int64_t no = std::min<int64_t>(16, n1 - n);
        unpack(q + p * N * GP * 16, d + p * N * S * GP, S, GP, n, no, u);
        blocks<MB4>(std::min(RB, M - r0), [&](auto nr, int64_t r) {
          const int64_t row = r0 + r;
          int4_rows_many<decltype(nr)::value>(u, GP, xp + row * K + p * GP * 32, K, xs + row * G + p * GP, y + row * N, N, n, no,
                                              carry.data() + r * 16, p == 0, p == P - 1);
        });
      }
}

}  // namespace cagk
