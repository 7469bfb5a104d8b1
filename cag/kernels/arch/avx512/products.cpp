// Weight products of decode rows on AVX-512 (VNNI and BF16): int4 groups (CAG_WEIGHTS=int4), int8 groups (the
// LM head under int4) and plain bf16 (CAG_WEIGHTS=bf16). Built with the rest of arch/avx512/ into one library
// by cag/kernels/native.py; called by cag/model/packed.py for decode rows and inside layer.cpp's one call.
//
// int4 multiplies 8-bit activations, as GGUF's Q4_0 x Q8_0 does: each row's x is cut into groups of 32, each
// group's codes q_x = round(x / d_x) in -127..127 with d_x = max |x| / 127 (`int4_prepare`), and the weights'
// nibbles meet the codes in integer dot products (VPDPBUSD: 64 byte products a call), whose lanes are 16
// outputs: a group's integer sum per output is exact, then one float multiply-add per row, group and 16
// outputs applies d_w d_x. Per 64 weight inputs that is one integer dot product where bf16 activations took
// two dot products and a multiply-add, for each row (bench/JOURNAL.md, 2026-12-07).
//
// int4 layout (cag.model.layouts.pack_int4_native): qw (N16, G, 256) uint8, N16 = ceil(N / 16) blocks of 16
// outputs, G = K / 32 groups: a block's group is 4 runs of 64 bytes, run k's byte 4 o + b holding output o's
// input 4 k + b (low nibble) and 16 + 4 k + b (high nibble), outputs past N zero; dm (S, G, N) float16: per
// group and output its step d (S = 1: GGUF Q4_0's grid, w = d (q - 8)), then its min m (S = 2: Q4_1's, w = m +
// q d), q in 0..15.
//
// q8 layout (cag.model.layouts.pack_q8, GGUF Q8_0's shape and precision): qw (N, K) int8, d (N, K/32)
// float16, w = d q; the int8 values go to float32 in registers (bf16 cannot hold d q exactly).
//
// Every row runs the same sequence of operations whatever the other rows of its call and whichever
// thread takes its outputs: a row's bits are its own (tests/test_native.py, tests/test_products.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "arch/avx512/kernels.h"
#include "common/product_args.h"

namespace {

constexpr int MB = 8;  // rows held in registers at a time (a call of more rows runs blocks of MB, then the rest)
constexpr int MB4 = 4;  // int4's: 4 rows' integer and float sums for 16 outputs, beside a group's 8 weight vectors

// x (M, K) bf16 -> per row and group of 32: codes qx (M, K) int8 = round(x / d) (to nearest even), scale dx (M, K/32)
// = max |x| / 127 (0 for a group of zeros: codes 0), and the codes' sum sx (M, K/32) int32.
void prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < G; g++) {
      const uint16_t* xg = x + r * K + g * 32;
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)xg)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xg + 16))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);  // within rounding of 127 anyway
      const __m512i ql = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id))), lim), nlim);
      const __m512i qh = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id))), lim), nlim);
      _mm_storeu_si128((__m128i*)(qx + r * K + g * 32), _mm512_cvtepi32_epi8(ql));
      _mm_storeu_si128((__m128i*)(qx + r * K + g * 32 + 16), _mm512_cvtepi32_epi8(qh));
      dx[r * G + g] = d;
      sx[r * G + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    }
}

// Rows [r0, r0 + NR) (their codes K apart, scales and sums G apart) times block nb's 16 outputs (its G groups of
// 256 bytes in q; d: dm's first row, N apart per group and a second row (mins) S = 2 rows on) into y (N apart),
// the last block's lanes past N not stored. Per row and group, in this order: the integer sum of codes times
// nibbles (starting at -8 sx on Q4_0's grid: d (q - 8)), to float32, times (d_w x d_x), added; on Q4_1's grid
// then m_w times (d_x x sx) added. The same sequence for a row whatever NR: its bits are its own.
template <int NR>
inline void int4_tile(const uint8_t* q, const uint16_t* d, int64_t S, int64_t G, int64_t N, int64_t nb, const int8_t* qx,
                      const float* dx, const int32_t* sx, int64_t K, float* y) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t left = std::min<int64_t>(16, N - nb * 16);
  const __mmask16 lm = (__mmask16)((1u << left) - 1);
  __m512 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
  const uint8_t* qb = q + nb * G * 256;
  for (int64_t g = 0; g < G; g++) {
    __m512i lo[4], hi[4];
    for (int k = 0; k < 4; k++) {
      const __m512i v = _mm512_loadu_si512(qb + g * 256 + 64 * k);
      lo[k] = _mm512_and_si512(v, low);                          // inputs 4k .. 4k + 3 of each output
      hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);    // inputs 16 + 4k .. 16 + 4k + 3
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lm, d + g * N + nb * 16));
    const __m512 mv = S == 2 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lm, d + (G + g) * N + nb * 16)) : _mm512_setzero_ps();
    for (int r = 0; r < NR; r++) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(qx + r * K + g * 32);  // 4 codes a dword
      const int32_t s = sx[r * G + g];
      __m512i t = S == 2 ? _mm512_setzero_si512() : _mm512_set1_epi32(-8 * s);
      for (int k = 0; k < 4; k++) {
        t = _mm512_dpbusd_epi32(t, lo[k], _mm512_set1_epi32(xr[k]));
        t = _mm512_dpbusd_epi32(t, hi[k], _mm512_set1_epi32(xr[4 + k]));
      }
      const float xd = dx[r * G + g];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, _mm512_set1_ps(xd)), acc[r]);
      if (S == 2) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xd * (float)s), acc[r]);
    }
  }
  for (int r = 0; r < NR; r++) _mm512_mask_storeu_ps(y + r * N + nb * 16, lm, acc[r]);
}

// Rows [r, r + NR) times outputs [n, n + NO): each weight vector loaded once for NR rows, each row's
// vector once for NO outputs; every (row, output) sum runs the same sequence whatever NR and NO.
template <int NR, int NO>
void bf16_rows(const uint16_t* w, int64_t K, const uint16_t* x, float* y, int64_t N, int64_t n) {
  __m512 acc[NO][NR];
  for (int o = 0; o < NO; o++)
    for (int r = 0; r < NR; r++) acc[o][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NO];
    for (int o = 0; o < NO; o++) wv[o] = (__m512bh)_mm512_loadu_si512(w + (n + o) * K + k);
    for (int r = 0; r < NR; r++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int o = 0; o < NO; o++) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv[o], xv);
    }
  }
  for (int o = 0; o < NO; o++)
    for (int r = 0; r < NR; r++) y[r * N + n + o] = _mm512_reduce_add_ps(acc[o][r]);
}

// Rows [r, r + NR) (float32, K apart) times output n's q8 weights.
template <int NR>
void q8_rows(const int8_t* qw, const uint16_t* dh, int64_t K, const float* xf, float* y, int64_t N, int64_t n) {
  const int64_t G = K / 32;
  const int8_t* qn = qw + n * K;
  alignas(64) float d[16];
  __m512 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t ng = std::min<int64_t>(16, G - g0);
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1), dh + n * G + g0)));
    for (int64_t g = 0; g < ng; g++) {
      const int8_t* qg = qn + (g0 + g) * 32;
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qg)));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qg + 16))));
      const __m512 dv = _mm512_set1_ps(d[g]);
      for (int r = 0; r < NR; r++) {
        const float* xr = xf + r * K + (g0 + g) * 32;
        const __m512 sg = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xr)));
        acc[r] = _mm512_fmadd_ps(sg, dv, acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; r++) y[r * N + n] = _mm512_reduce_add_ps(acc[r]);
}

// Rows in blocks of B (MB, or MB4 for int4), then the rest (fewer than B) as one block of their own, each
// weight read once for the block: f(std::integral_constant<int, NR>, first row). A row's sequence of
// operations is the same in a block of any size, so its bits do not depend on how many rows the call has.
template <int B = MB, typename F>
void blocks(int64_t M, F f) {
  int64_t r = 0;
  for (; r + B <= M; r += B) f(std::integral_constant<int, B>{}, r);
  switch (M - r) {
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 4: if constexpr (B > 4) f(std::integral_constant<int, 4>{}, r); break;
    case 5: if constexpr (B > 5) f(std::integral_constant<int, 5>{}, r); break;
    case 6: if constexpr (B > 6) f(std::integral_constant<int, 6>{}, r); break;
    case 7: if constexpr (B > 7) f(std::integral_constant<int, 7>{}, r); break;
    default: break;
  }
}

}  // namespace

namespace cagk {

void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx) { prepare(x, M, K, qx, dx, sx); }

void int4_outputs(const uint8_t* q, const uint16_t* d, int64_t K, int64_t M, const int8_t* qx, const float* dx, const int32_t* sx,
                  float* y, int64_t N, int64_t n0, int64_t n1, int64_t S) {
  // Per block of 16 outputs (its weights, G x 256 bytes, stay in L2 for every block of rows), rows in blocks of
  // MB4, then the rest as one block.
  const int64_t G = K / 32;
  for (int64_t nb = n0 / 16; nb * 16 < n1; nb++)
    blocks<MB4>(M, [&](auto nr, int64_t r) {
      int4_tile<decltype(nr)::value>(q, d, S, G, N, nb, qx + r * K, dx + r * G, sx + r * G, K, y + r * N);
    });
}

void bf16_outputs(const uint16_t* w, int64_t K, int64_t M, const uint16_t* x, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2)  // pairs of outputs
    blocks(M, [&](auto nr, int64_t r) { bf16_rows<decltype(nr)::value, 2>(w, K, x + r * K, y + r * N, N, n); });
  for (; n < n1; n++)
    blocks(M, [&](auto nr, int64_t r) { bf16_rows<decltype(nr)::value, 1>(w, K, x + r * K, y + r * N, N, n); });
}

}  // namespace cagk

namespace {

// x (M, K) bf16, qw (N16, K/32, 256) uint8, dm (S, K/32, N) float16 (pack_int4_native) -> (M, N) float32.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  return cagk::int4_product(x, qw, dm, 16, cagk::int4_prepare,
                            [](const uint8_t* q, const uint16_t* d, int64_t S, int64_t K, int64_t N, int64_t M, const int8_t* qx,
                               const float* dx, const int32_t* sx, float* y, int64_t n0, int64_t n1) {
                              cagk::int4_outputs(q, d, K, M, qx, dx, sx, y, N, n0, n1, S);
                            });
}

// x (M, K) bf16, qw (N, K) int8, d (N, K/32) float16 -> (M, N) float32 (common/product_args.h's q8_product).
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d) {
  return cagk::q8_product(x, qw, d, [](const int8_t* q, const uint16_t* dd, int64_t K, int64_t M, const float* xf, float* yd,
                                       int64_t N, int64_t n) {
    blocks(M, [&](auto nr, int64_t r) { q8_rows<decltype(nr)::value>(q, dd, K, xf + r * K, yd + r * N, N, n); });
  });
}

// x (M, K) bf16, w (N, K) bf16 -> (M, N) float32.
at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) % 32 == 0, "w: (N, K) bfloat16, K a multiple of 32");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  cagk::check_x(x, K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { cagk::bf16_outputs(wd, K, M, xd, yd, N, n0, n1); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag, m) {
  m.def("int4_mm(Tensor x, Tensor qw, Tensor dm) -> Tensor");
  m.def("bf16_mm(Tensor x, Tensor w) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor qw, Tensor d) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("int4_mm", int4_mm);
  m.impl("bf16_mm", bf16_mm);
  m.impl("q8_mm", q8_mm);
}
