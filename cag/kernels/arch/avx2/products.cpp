// Weight products of decode rows on CPUs with AVX2, FMA and F16C but not the AVX512-BF16 floor of the
// rest of cag's kernels (AMD Zen 2/3, Intel before Cooper Lake): int4 groups (CAG_WEIGHTS=int4) and
// int8 groups (int4's LM head), the layouts arch/avx512/products.cpp takes (cag.model.layouts: pack_int4, pack_q8).
// Built with the rest of arch/avx2/ into a library of its own by cag/kernels/native.py (CAG_DECODE_KERNELS=avx2);
// called by cag/model/packed.py (Avx2Packed) for a pass's rows, decode and question rows alike.
//
// torch's int4 kernel for one row runs at a fraction of the read rate (bench/bench_models.py shows
// the step beside its bound). Here a group's dot product of q (exact in float32) with x, times its
// step d, plus its min m times the group's sum of x, is sum_i w_i x_i, with w = m + q d as the layout
// holds it (GGUF Q4_1's shape and precision).
//
// Every row runs the same sequence of operations whatever the other rows of its call and whichever
// thread takes its outputs: a row's bits are its own (tests/test_avx2_products.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

#include "arch/avx2/vec.h"
#include "common/product_args.h"

namespace {

constexpr int MB = 4;  // rows held in registers at a time (16 ymm: 4 weight vectors, a sum and a total per row)

// xf (M, K) float32 -> xs (M, K/32): each group's sum, in one fixed order.
void group_sums(const float* xf, int64_t M, int64_t K, float* xs) {
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < K / 32; g++) {
      const float* p = xf + r * K + 32 * g;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      xs[r * (K / 32) + g] = hsum(s);
    }
}

// Rows [r, r + NR) times output n's int4 weights: y[r][n].
template <int NR>
inline void int4_out(const uint8_t* qw, const uint16_t* dm, int64_t K, const float* xf, const float* xs, float* y, int64_t N, int64_t n) {
  const int64_t G = K / 32;
  const uint8_t* qn = qw + n * (K / 2);
  const uint16_t* dn = dm + n * 2 * G;
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 acc[NR], cst[NR];
  for (int r = 0; r < NR; r++) acc[r] = cst[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < G; g0 += 8) {  // 8 groups' steps and mins at a time
    alignas(32) float d8[8];
    const int64_t ng = G - g0 < 8 ? G - g0 : 8;
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
    if (ng == 8) {
      dh = _mm_loadu_si128((const __m128i*)(dn + g0));
      mh = _mm_loadu_si128((const __m128i*)(dn + G + g0));
    } else {  // a last block of fewer groups: lanes past ng are 0
      std::memcpy(&dh, dn + g0, 2 * ng);
      std::memcpy(&mh, dn + G + g0, 2 * ng);
    }
    _mm256_store_ps(d8, _mm256_cvtph_ps(dh));
    const __m256 c = _mm256_cvtph_ps(mh);
    for (int r = 0; r < NR; r++) {  // m . group sums, 8 groups a vector (lanes past ng: 0 . 0)
      __m256 sums;
      if (ng == 8) {
        sums = _mm256_loadu_ps(xs + r * G + g0);
      } else {
        alignas(32) float s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::memcpy(s8, xs + r * G + g0, 4 * ng);
        sums = _mm256_load_ps(s8);
      }
      cst[r] = _mm256_fmadd_ps(c, sums, cst[r]);
    }
    for (int64_t g = 0; g < ng; g++) {
      const uint8_t* b = qn + (g0 + g) * 16;  // byte j: input j (low nibble), j + 16 (high)
      const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)b));
      const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8)));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));  // q of inputs 0-7
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));  // 8-15
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));   // 16-23
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));   // 24-31
      const __m256 dg = _mm256_broadcast_ss(d8 + g);
      for (int r = 0; r < NR; r++) {  // two half sums: a shorter chain of dependent products
        const float* xr = xf + r * K + (g0 + g) * 32;
        __m256 s0 = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
        __m256 s1 = _mm256_mul_ps(w2, _mm256_loadu_ps(xr + 16));
        s0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), s0);
        s1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), s1);
        acc[r] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), dg, acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; r++) y[r * N + n] = hsum(acc[r]) + hsum(cst[r]);
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

// x (M, K) bf16, qw (N, K/2) uint8, dm (N, 2, K/32) float16 -> (M, N) float32.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  const int64_t K = cagk::check_int4(x, qw, dm).K, N = qw.size(0), M = x.size(0), G = K / 32;
  std::vector<float> xf(M * K), xs(M * G);
  cagk::bf16_to_float(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M * K, xf.data());
  group_sums(xf.data(), M, K, xs.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      blocks(M, [&](auto nr, int64_t r) { int4_out<decltype(nr)::value>(q, d, K, xf.data() + r * K, xs.data() + r * G, yd + r * N, N, n); });
  });
  return y;
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
