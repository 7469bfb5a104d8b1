// Weight products of decode rows on CPUs with AVX2, FMA and F16C but not the AVX512-BF16 floor of the
// rest of cag's kernels (AMD Zen 2/3, Intel before Cooper Lake): int4 groups (CAG_WEIGHTS=int4) and
// int8 groups (int4's LM head), in the layouts arch/avx512/products.cpp takes (cag.model.layouts:
// pack_int4_native, pack_q8). Built with the rest of arch/avx2/ into a library of its own by
// cag/kernels/native.py (CAG_DECODE_KERNELS=avx2); called by cag/model/packed.py (Avx2Packed) for a pass's rows.
//
// int4 multiplies 8-bit activations, as the AVX-512 library does and as llama.cpp's AVX2 path does: each row's
// x to int8 codes per group of 32 (scale max |x| / 127), and per block of 8 outputs (half a block of 16 of the
// layout) VPMADDUBSW of the weights' nibbles (unsigned) with 4 codes broadcast (signed): 16-bit sums of two
// products, 8 of them added per lane (16 products of at most 15 x 127: no overflow), then VPMADDWD by ones to a
// 32-bit sum per output, exact; then one float multiply-add per row, group and 8 outputs applies d_w d_x. A lone
// row (a decode step's) takes a whole block of 16 at a time, each 64-byte run of the weights read once.
//
// Every row runs the same sequence of operations whatever the other rows of its call and whichever
// thread takes its outputs: a row's bits are its own (tests/test_avx2_products.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "arch/avx2/kernels.h"
#include "arch/avx2/vec.h"
#include "common/product_args.h"

namespace {

constexpr int MB = 4;  // rows held in registers at a time (16 ymm: 4 weight vectors, a sum and a total per row)

// x (M, K) bf16 -> per row and group of 32: codes qx (M, K) int8 = round(x * (127 / max|x|)) (to nearest even,
// within -127..127), scale dx (M, K/32) = max |x| / 127, and the codes' sum sx (M, K/32).
void prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx) {
  const int64_t G = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < G; g++) {
      const uint16_t* xg = x + r * K + g * 32;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int k = 0; k < 4; k++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k] = widen(xg + 8 * k)));
      alignas(32) float l[8];
      _mm256_store_ps(l, m);
      float amax = 0.0f;
      for (float f : l) amax = amax > f ? amax : f;  // max is exact: any order
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      alignas(32) int32_t c[32];
      for (int k = 0; k < 4; k++)
        _mm256_store_si256(reinterpret_cast<__m256i*>(c + 8 * k),
                           _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id))), lim), nlim));
      int32_t s = 0;
      for (int i = 0; i < 32; i++) { qx[r * K + g * 32 + i] = (int8_t)c[i]; s += c[i]; }
      dx[r * G + g] = amax / 127.0f;
      sx[r * G + g] = s;
    }
}

// Rows [r0, r0 + NR) (codes K apart, scales and sums G apart) times outputs [n, n + 8) of the block layout (8 of the
// 16 of block n / 16: byte offset 32 (n % 16 / 8) in each 64-byte run) into y (N apart), lanes past N not stored.
template <int NR>
inline void int4_half(const uint8_t* q, const uint16_t* d, int64_t S, int64_t G, int64_t N, int64_t n, const int8_t* qx,
                      const float* dx, const int32_t* sx, int64_t K, float* y) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t left = std::min<int64_t>(8, N - n);
  const uint8_t* qb = q + (n / 16) * G * 256 + (n % 16 / 8) * 32;
  __m256 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256i lo[4], hi[4];
    for (int k = 0; k < 4; k++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 256 + 64 * k));
      lo[k] = _mm256_and_si256(v, low);                        // inputs 4k .. 4k + 3 of each of the 8 outputs
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);  // inputs 16 + 4k ..
    }
    __m256 dv, mv = _mm256_setzero_ps();  // the 8 outputs' steps (and mins) of group g
    if (left == 8) {  // straight from the scales (a call to memcpy a group cost as much as its products)
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * N + n)));
      if (S == 2) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + (G + g) * N + n)));
    } else {  // the last outputs of N: the same values, the lanes past N zero
      alignas(16) uint16_t dh[8] = {0, 0, 0, 0, 0, 0, 0, 0}, mh[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(dh, d + g * N + n, 2 * left);
      if (S == 2) std::memcpy(mh, d + (G + g) * N + n, 2 * left);
      dv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
      mv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(mh)));
    }
    for (int r = 0; r < NR; r++) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(qx + r * K + g * 32);  // 4 codes a dword
      __m256i t = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(xr[0]));
      t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(xr[4])));
      for (int k = 1; k < 4; k++) {
        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(lo[k], _mm256_set1_epi32(xr[k])));
        t = _mm256_add_epi16(t, _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32(xr[4 + k])));
      }
      const int32_t s = sx[r * G + g];
      __m256i t32 = _mm256_madd_epi16(t, ones);  // per output: its 32 products
      if (S == 1) t32 = _mm256_add_epi32(t32, _mm256_set1_epi32(-8 * s));  // d (q - 8)
      const float xd = dx[r * G + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t32), _mm256_mul_ps(dv, _mm256_set1_ps(xd)), acc[r]);
      if (S == 2) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xd * (float)s), acc[r]);
    }
  }
  for (int r = 0; r < NR; r++) store(y + r * N + n, acc[r], left);
}

// One row times outputs [n, n + 16) (a whole block of the layout, n a multiple of 16, all 16 within N): both halves
// of each group's 256 bytes in one pass, each 64-byte run read once and its row's 8 broadcast codes used for both.
// Each output's sums run as int4_half's (the same integer sums, the same float multiply-adds in the same order):
// the same bits.
inline void int4_block(const uint8_t* q, const uint16_t* d, int64_t S, int64_t G, int64_t N, int64_t n, const int8_t* qx,
                       const float* dx, const int32_t* sx, float* y) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* qb = q + (n / 16) * G * 256;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const int32_t* xr = reinterpret_cast<const int32_t*>(qx + g * 32);  // 4 codes a dword
    __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 256 + 64 * k));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 256 + 64 * k + 32));
      const __m256i xl = _mm256_set1_epi32(xr[k]), xh = _mm256_set1_epi32(xr[4 + k]);
      const __m256i l0 = _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xl);
      const __m256i l1 = _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xl);
      const __m256i h0 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xh);
      const __m256i h1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xh);
      t0 = k == 0 ? _mm256_add_epi16(l0, h0) : _mm256_add_epi16(_mm256_add_epi16(t0, l0), h0);
      t1 = k == 0 ? _mm256_add_epi16(l1, h1) : _mm256_add_epi16(_mm256_add_epi16(t1, l1), h1);
    }
    const int32_t s = sx[g];
    __m256i u0 = _mm256_madd_epi16(t0, ones), u1 = _mm256_madd_epi16(t1, ones);
    if (S == 1) {
      u0 = _mm256_add_epi32(u0, _mm256_set1_epi32(-8 * s));
      u1 = _mm256_add_epi32(u1, _mm256_set1_epi32(-8 * s));
    }
    const float xd = dx[g];
    const __m256 dx8 = _mm256_set1_ps(xd);
    const uint16_t* dg = d + g * N + n;
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u0), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg))), dx8), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u1), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + 8))), dx8), acc1);
    if (S == 2) {
      const uint16_t* mg = d + (G + g) * N + n;
      const __m256 xs = _mm256_set1_ps(xd * (float)s);
      acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg))), xs, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + 8))), xs, acc1);
    }
  }
  _mm256_storeu_ps(y + n, acc0);
  _mm256_storeu_ps(y + n + 8, acc1);
}

// Rows [r, r + NR) times output n's int8 weights (w = d q per group of 32).
template <int NR>
inline void q8_out(const int8_t* qw, const uint16_t* dd, int64_t K, const float* xf, float* y, int64_t N, int64_t n) {
  const int8_t* qn = qw + n * K;
  const uint16_t* dn = dd + n * (K / 32);
  __m256 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / 32; g++) {
    __m256 w[4];
    for (int k = 0; k < 4; k++) w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qn + 32 * g + 8 * k))));
    const __m256 dg = _mm256_set1_ps(_cvtsh_ss(dn[g]));
    for (int r = 0; r < NR; r++) {
      const float* xr = xf + r * K + 32 * g;
      __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
      for (int k = 1; k < 4; k++) s = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xr + 8 * k), s);
      acc[r] = _mm256_fmadd_ps(s, dg, acc[r]);
    }
  }
  for (int r = 0; r < NR; r++) y[r * N + n] = hsum(acc[r]);
}

// f(NR, r) over the rows in blocks of MB, then the rest: each row's sequence is the same in any block.
template <class F>
inline void blocks(int64_t M, F f) {
  int64_t r = 0;
  for (; r + MB <= M; r += MB) f(std::integral_constant<int, MB>{}, r);
  for (; r < M; r++) f(std::integral_constant<int, 1>{}, r);
}

}  // namespace

namespace cagk::avx2 {

void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx) { prepare(x, M, K, qx, dx, sx); }

// Outputs [n0, n1) in halves of the layout's blocks of 16, 8 outputs each.
void int4_outputs(const uint8_t* q, const uint16_t* d, int64_t K, int64_t M, const int8_t* qx, const float* dx,
                  const int32_t* sx, float* y, int64_t N, int64_t n0, int64_t n1, int64_t S) {
  const int64_t G = K / 32;
  const auto whole = [&](int64_t m) { return m >= n0 && m % 16 == 0 && m + 16 <= n1 && m + 16 <= N; };
  for (int64_t n = n0; n < n1; n += 8)
    blocks(M, [&](auto nr, int64_t r) {
      constexpr int NR = decltype(nr)::value;
      if (NR == 1 && whole(n))  // a lone row over a whole block: both halves at once
        int4_block(q, d, S, G, N, n, qx + r * K, dx + r * G, sx + r * G, y + r * N);
      else if (NR > 1 || !whole(n - 8))  // (a whole block's second half was done with its first)
        int4_half<NR>(q, d, S, G, N, n, qx + r * K, dx + r * G, sx + r * G, K, y + r * N);
    });
}

}  // namespace cagk::avx2

namespace {

// x (M, K) bf16, qw (N16, K/32, 256) uint8, dm (S, K/32, N) float16 (pack_int4_native) -> (M, N) float32: the
// layout's blocks of 16 outputs over the threads (a lone row a whole block at a time, blocks of rows a half).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  return cagk::int4_product(x, qw, dm, 16, prepare,
                            [](const uint8_t* q, const uint16_t* d, int64_t S, int64_t K, int64_t N, int64_t M, const int8_t* qx,
                               const float* dx, const int32_t* sx, float* y, int64_t n0, int64_t n1) {
                              cagk::avx2::int4_outputs(q, d, K, M, qx, dx, sx, y, N, n0, n1, S);
                            });
}

// x (M, K) bf16, qw (N, K) int8, d (N, K/32) float16 -> (M, N) float32 (common/product_args.h's q8_product).
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d) {
  return cagk::q8_product(x, qw, d, [](const int8_t* q, const uint16_t* dd, int64_t K, int64_t M, const float* xf, float* yd,
                                       int64_t N, int64_t n) {
    blocks(M, [&](auto nr, int64_t r) { q8_out<decltype(nr)::value>(q, dd, K, xf + r * K, yd + r * N, N, n); });
  });
}

}  // namespace

TORCH_LIBRARY(cag_avx2, m) {
  m.def("int4_mm(Tensor x, Tensor qw, Tensor dm) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor qw, Tensor d) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag_avx2, CPU, m) {
  m.impl("int4_mm", int4_mm);
  m.impl("q8_mm", q8_mm);
}
