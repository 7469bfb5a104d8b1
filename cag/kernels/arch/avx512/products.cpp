// Weight products of decode rows on AVX512-BF16, at the speed of reading the weights: int4 groups
// (CAG_WEIGHTS=int4), int8 groups (the LM head under int4) and plain bf16 (CAG_WEIGHTS=bf16, and a
// question's rows). Built with the rest of arch/avx512/ into one library by cag/kernels/native.py; called by
// cag/model/packed.py for decode rows.
//
// torch's int4 kernel dequantizes each weight row to float per input row, well below the read rate
// (bench/bench_decode.py measures both); here the nibbles become bf16 in registers with two integer ops and go straight into
// AVX512-BF16 dot products, so one pass over the packed bytes serves every row of the call.
//
// int4 layout (cag.model.weights.pack_int4): qw (N, K/2) uint8, each group of 32 inputs in 16 bytes, byte j
// holding input j (low nibble) and input j + 16 (high nibble); dm (N, 2, K/32) float16: per group its
// step d and its min m, so w = m + q d, q in 0..15 (GGUF Q4_1's shape and precision); or dm (N, 1, K/32),
// the steps alone, where every min is -8 d (GGUF Q4_0's grid: pack_int4_native), 18 bytes a group, not
// 20: the min is then computed as -8 d, exactly the value the two-row layout would hold, so the same bits.
// bf16 (OR 0x4300) is 128 + q exactly, so a group's dot product of (128 + q) with x, times d, plus
// (m - 128 d) times the group's sum of x, is sum_i w_i x_i.
//
// q8 layout (cag.model.weights.pack_q8, GGUF Q8_0's shape and precision): qw (N, K) int8, d (N, K/32)
// float16, w = d q; the int8 values go to float32 in registers (bf16 cannot hold d q exactly).
//
// Every row runs the same sequence of operations whatever the other rows of its call and whichever
// thread takes its outputs: a row's bits are its own (tests/test_native.py).
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
// int4's: a block's rows of x are read again for every output, and 8 rows of 3,072 inputs (48 KiB) do not
// stay in L1 where 4 (24 KiB) do (bench/JOURNAL.md, 2026-12-04).
constexpr int MB4 = 4;

// x (M, K) bf16 -> per row: xp (K) bf16 in the order the unpacked nibbles come out (per 64 inputs:
// 0-15 and 32-47 of group pair's low nibbles, then 16-31 and 48-63), xs (K/32) float32 group sums.
void prepare(const uint16_t* x, int64_t M, int64_t K, uint16_t* xp, float* xs) {
  for (int64_t r = 0; r < M; r++) {
    const uint16_t* xr = x + r * K;
    uint16_t* pr = xp + r * K;
    for (int64_t p = 0; p < K; p += 64) {
      std::memcpy(pr + p, xr + p, 32);            // group g, inputs 0-15
      std::memcpy(pr + p + 16, xr + p + 32, 32);  // group g + 1, inputs 0-15
      std::memcpy(pr + p + 32, xr + p + 16, 32);  // group g, inputs 16-31
      std::memcpy(pr + p + 48, xr + p + 48, 32);  // group g + 1, inputs 16-31
    }
    for (int64_t g = 0; g < K / 32; g++) {
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + 32 * g))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + 32 * g + 16))), 16));
      xs[r * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

// The lanes of v summed as hsum16 sums each of its vectors: ((l0 + l2) + (l1 + l3)) per 4 lanes, then
// (s0 + s1) + (s2 + s3). An output's bits are the same whichever of the two sums it.
inline float hsum(__m512 v) {
  alignas(64) float l[16];
  _mm512_store_ps(l, v);
  float s[4];
  for (int k = 0; k < 4; k++) s[k] = (l[4 * k] + l[4 * k + 2]) + (l[4 * k + 1] + l[4 * k + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// v[o]'s lanes summed into lane o, 16 vectors at once (~3 ops a vector instead of ~9 each).
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; i++) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; i++) w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Rows [r0, r0 + NR) (NR <= MB4) times outputs [n, n + NO)'s int4 weights over the GP groups of a panel
// (q: the panel's N rows of GP * 16 bytes, d: its S rows of GP steps / mins each; xp, xs: the rows' inputs
// from the panel's first, rows K inputs and G group sums apart): per (row, output) a vector whose lanes
// sum to the product, added to acc[r * 16 + o]. Each row's x is loaded once for the NO outputs and each
// output's unpacked weights serve the NR rows; a (row, output)'s sum runs the same sequence whatever NR
// and NO, so the same bits.
template <int NR, int NO>
inline void int4_acc(const uint8_t* q, const uint16_t* d, int64_t S, int64_t GP, const uint16_t* xp, int64_t K, const float* xs,
                     int64_t G, int64_t n, __m512* acc) {
  const __m512i low = _mm512_set1_epi16(0x000F), one28 = _mm512_set1_epi16(0x4300);
  __m512 a[NR][NO];
  for (int r = 0; r < NR; r++)
    for (int o = 0; o < NO; o++) a[r][o] = acc[r * 16 + o];
  for (int64_t g0 = 0; g0 < GP; g0 += 16) {  // 16 groups' steps and mins at a time
    const int64_t ng = std::min<int64_t>(16, GP - g0);
    const __mmask16 gm = (__mmask16)((1u << ng) - 1);
    __m512 d16[NO];
    for (int o = 0; o < NO; o++) {
      const uint16_t* dn = d + (n + o) * S * GP;
      d16[o] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, dn + g0));
      // S: 2 (steps, then mins) or 1 (steps alone, mins -8 d)
      const __m512 m16 = S == 2 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, dn + GP + g0)) : _mm512_mul_ps(d16[o], _mm512_set1_ps(-8.0f));
      const __m512 c16 = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d16[o], m16);  // m - 128 d
      for (int r = 0; r < NR; r++) a[r][o] = _mm512_fmadd_ps(c16, _mm512_maskz_loadu_ps(gm, xs + r * G + g0), a[r][o]);
    }
    __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t g = 0; g < ng; g += 2, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2))) {  // a pair of groups: 64 inputs
      __m512bh x0[NR], x1[NR];
      for (int r = 0; r < NR; r++) {
        const uint16_t* xr = xp + r * K + (g0 + g) * 32;
        x0[r] = (__m512bh)_mm512_loadu_si512(xr), x1[r] = (__m512bh)_mm512_loadu_si512(xr + 32);
      }
      for (int o = 0; o < NO; o++) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + (n + o) * GP * 16 + (g0 + g) * 16)));
        const __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(w, low), one28);  // 128 + q, inputs 0-15 of both
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), one28);   // inputs 16-31 of both
        const __m512 dv = _mm512_permutexvar_ps(idx, d16[o]);  // lanes 0-7: group g's d, 8-15: group g + 1's
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

// Outputs taken together: one for a single row (a decode step reads the weights as one stream; several
// weight rows read side by side were slower), 4 for several (a question's rows: each unpack and x load
// serves more dot products).
template <int NR>
constexpr int int4_outs() { return NR == 1 ? 1 : 4; }

// Rows [r0, r0 + NR) times outputs [n, n + no), no <= 16, over one panel of GP groups (q, d: the panel's,
// N outputs; xp, xs from the panel's first input). The sums start at zero on the first panel (else from
// carry), go on to carry, or on the last panel are reduced into y: a row's sums of a whole block of 16 in
// one reduction, of a shorter block one by one (the same bits).
template <int NR>
void int4_rows(const uint8_t* q, const uint16_t* d, int64_t S, int64_t GP, const uint16_t* xp, int64_t K, const float* xs, float* y,
               int64_t N, int64_t n, int64_t no, __m512* carry, bool first, bool last) {
  constexpr int NO = int4_outs<NR>();
  const int64_t G = K / 32;
  __m512 acc[NR][16];
  for (int r = 0; r < NR; r++)
    for (int64_t o = 0; o < no; o++) acc[r][o] = first ? _mm512_setzero_ps() : carry[r * 16 + o];
  int64_t o = 0;
  for (; o + NO <= no; o += NO) int4_acc<NR, NO>(q, d, S, GP, xp, K, xs, G, n + o, &acc[0][o]);
  for (; o < no; o++) int4_acc<NR, 1>(q, d, S, GP, xp, K, xs, G, n + o, &acc[0][o]);
  for (int r = 0; r < NR; r++) {
    if (!last) for (int64_t j = 0; j < no; j++) carry[r * 16 + j] = acc[r][j];
    else if (no == 16) _mm512_storeu_ps(y + r * N + n, hsum16(acc[r]));
    else for (int64_t j = 0; j < no; j++) y[r * N + n + j] = hsum(acc[r][j]);
  }
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

void int4_prepare(const uint16_t* x, int64_t M, int64_t K, uint16_t* xp, float* xs) { prepare(x, M, K, xp, xs); }

void int4_outputs(const uint8_t* q, const uint16_t* d, int64_t K, int64_t M, const uint16_t* xp, const float* xs,
                  float* y, int64_t N, int64_t n0, int64_t n1, int64_t S, int64_t P) {
  const int64_t G = K / 32, GP = G / P;
  // Per chunk of outputs, one panel after another (pack_int4_native; whole rows: P = 1), each read as one
  // stream of bytes while its rows' x stays in L1; a (row, output)'s sums are carried from panel to panel
  // in order. Within a panel, 16 outputs' weights stay in L1 for every block of rows.
  const int64_t chunk = M <= MB4 ? 256 : 64;
  std::vector<__m512> carry(P > 1 ? M * chunk : 0);  // rows [r, r + NR)'s block at n: r * chunk + (n - c0) * NR on
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t p = 0; p < P; p++) {
      const uint8_t* qp = q + p * N * GP * 16;
      const uint16_t* dp = d + p * N * S * GP;
      for (int64_t n = c0; n < c1; n += 16)
        blocks<MB4>(M, [&](auto nr, int64_t r) {
          int4_rows<decltype(nr)::value>(qp, dp, S, GP, xp + r * K + p * GP * 32, K, xs + r * G + p * GP, y + r * N, N, n,
                                         std::min<int64_t>(16, c1 - n), carry.data() + r * chunk + (n - c0) * decltype(nr)::value, p == 0, p == P - 1);
        });
    }
  }
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

// x (M, K) bf16, qw (N, K/2) uint8, dm (N, 2, K/32) or (N, 1, K/32) float16 (or their P panels) -> (M, N) float32.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  const cagk::Int4Shape sh = cagk::check_int4(x, qw, dm, true);
  const int64_t K = sh.K, N = sh.N, M = x.size(0), G = K / 32;
  std::vector<uint16_t> xp(M * K);
  std::vector<float> xs(M * G);
  cagk::int4_prepare(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xp.data(), xs.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { cagk::int4_outputs(q, d, K, M, xp.data(), xs.data(), yd, N, n0, n1, sh.S, sh.P); });
  return y;
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
