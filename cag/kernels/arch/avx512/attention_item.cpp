// One item of the AVX-512 library's decode attention by AVX512-BF16 dot products (attention.cpp runs the items):
// the query rows of the requests on it over C keys of bf16 K/V, products of bf16 pairs with float32 sums (q and
// the probabilities rounded to bf16, as in torch's flash kernel), softmax in float32. AMX's item (arch/amx/)
// shares its helpers (items.h) and its softmax (softmax_block); the two differ in the last bits. Also here:
// `pair_kv`, the same pairing done once for a resident prefix. A row's result depends on its own query and
// keys only: each output element comes from its own row, and nothing else mixes rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <tuple>

#include "arch/avx512/items.h"
#include "arch/avx512/kernels.h"
#include "arch/avx512/vec.h"

namespace cagk {

thread_local Scratch scratch;

}  // namespace cagk

namespace {

constexpr int64_t C = cagk::CHUNK;  // keys per item: its K (transposed) and V (paired) stay in L2
constexpr int64_t MAXD = cagk::MAXD;
using cagk::Partial;
using cagk::Scaling;
using cagk::Scratch;
using cagk::scratch;

// The softmax of `nr` rows of scores s (rows C apart, keys [0, w) of wp), keys past w masked, and before
// from[r] (a sliding window's) and from to[r] on (a row shorter than the item) where given: writes the
// probabilities rounded to bf16 to pb (rows C apart) and part[r] = (max, sum of the rounded values). A masked
// key's probability is exactly 0 (e^-88 is subnormal, which the bf16 rounding flushes), so blocks of masked keys
// add exact zeros: a row's bits are the same in an item of any w >= its keys.
void softmax_rows(float* s, uint16_t* pb, int64_t nr, int64_t w, int64_t wp, Scaling scale, Partial* part,
                  const int64_t* from, const int64_t* to) {
  const __m512 neg = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < nr; r++) {
    float* sr = s + r * C;
    const int64_t f = from ? from[r] : 0, wr = to ? to[r] : w;
    __m512 mx = neg;
    for (int64_t b = 0; b < wp / 16; b++) {
      const int64_t left = std::max<int64_t>(0, wr - b * 16), before = std::clamp<int64_t>(f - b * 16, 0, 16);
      __m512 x = _mm512_mul_ps(_mm512_load_ps(sr + b * 16), _mm512_set1_ps(scale.scale));
      if (scale.cap != 0.0f) x = softcap16(x, scale.cap);
      if (left < 16) x = _mm512_mask_blend_ps((__mmask16)((1u << left) - 1), neg, x);
      if (before) x = _mm512_mask_blend_ps((__mmask16)(0xFFFFu << before), neg, x);
      _mm512_store_ps(sr + b * 16, x);
      mx = _mm512_max_ps(mx, x);
    }
    const float m = _mm512_reduce_max_ps(mx);
    __m512 tot = _mm512_setzero_ps();
    for (int64_t b = 0; b < wp / 16; b++) {
      const __m256bh e = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_load_ps(sr + b * 16), _mm512_set1_ps(m))));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * C + b * 16), (__m256i)e);
      tot = _mm512_add_ps(tot, _mm512_cvtpbh_ps(e));
    }
    part[r] = {m, _mm512_reduce_add_ps(tot)};
  }
}

// r[0..15] (16 rows of 16 dwords) transposed in registers: r[i] becomes dword i of every row.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44); r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44); r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88); t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88); t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; i++) { r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88); r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD); }
}

// Keys [16 b, 16 b + 16) of k (rows `stride` apart; a key at or past w reads as zeros), their dword
// pairs 16 h .. 16 h + 15 transposed in registers into pair rows of kt, `ld` dwords apart:
// kt[(16 h + i) ld + 16 b + u] = pair 16 h + i of key 16 b + u (the paired K layout: sc.kt, pair_kv's kt).
// Pairs at or past D/2 (the last group of a width 32 g + 16: 8 pairs) are neither read nor written.
inline void pair_keys(const at::BFloat16* k, int64_t stride, int64_t w, int64_t b, int64_t h, uint32_t* kt, int64_t ld,
                      int64_t D) {
  const int64_t np = std::min<int64_t>(16, D / 2 - 16 * h);
  const __mmask16 m = (__mmask16)((1u << np) - 1);
  __m512 r[16];
  for (int64_t u = 0; u < 16; u++) {
    const int64_t t = b * 16 + u;
    r[u] = t < w ? _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(k + t * stride) + 16 * h) : _mm512_setzero_ps();
  }
  transpose16(r);
  for (int64_t i = 0; i < np; i++) _mm512_storeu_ps(reinterpret_cast<float*>(kt + (16 * h + i) * ld + b * 16), r[i]);
}

// One item by AVX512-BF16 dot products (cagk::item_avx512; CPUs without AMX: AMD Zen 4 and later, Intel before
// Sapphire Rapids with avx512_bf16; on AMX CPUs too). Gathers are slow on some of these (Zen 4):
// K's pairs are transposed in registers instead, and V's pairs interleaved in registers as they are
// used. Scores: per block of 4 rows, 4 chains of 16 keys each, one q pair per step; values: per block of 4 rows, the D
// dims in D/16 chains, one pair of probabilities per step (dims come out permuted within 128-bit
// lanes by the interleave, put back at the end).
//
// A resident prefix comes pre-paired (`pair_kv`, once per prefix): kpre is the item's K as (D/2, C)
// pairs, vpre its V as (w/2, D) pairs, and neither is rearranged here; the products and their order
// are the same, so are the bits.
template <int64_t D>
void item_avx512_d(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
                 int64_t w, Scaling scale, Partial* part, float* const* acc, const int64_t* from, const int64_t* to,
                 const uint32_t* kpre, const uint32_t* vpre, const char* nk, int64_t nkb, const char* nv, int64_t nvb) {
  const int64_t wp = (w + 63) / 64 * 64;
  Scratch& sc = scratch;
  const uint32_t* kt = kpre ? kpre : sc.kt;  // (D/2, ld) as for AMX
  const int64_t ld = kpre ? C : wp;
  float* s = sc.s;
  uint16_t* pb = sc.pb;
  constexpr int64_t nd = D / 32;  // whole zmm per K/V row (32 dims); a width 32 nd + 16 has a half group after them
  constexpr bool tail = D % 32 != 0;
  for (int64_t b = 0; !kpre && b < wp / 16; b++) {
    for (int64_t h = 0; h < nd + tail; h++) {  // dword pairs 16h .. 16h + 15 of 16 keys
      if (h == 0) prefetch_keys(k, b + 1, w, stride, D);  // the next block's keys into L1 while this one is paired
      pair_keys(k, stride, w, b, h, sc.kt, wp, D);
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {  // blocks of 16 rows: the scratch holds 16 rows of scores
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    uint16_t* qb = sc.qb;
    round_q(q + r0, nr, nr, D, qb);
    for (int64_t g0 = 0; g0 < nr; g0 += 4) {  // scores of 4 rows x 64 keys at a time: 16 chains, K read once for the 4
      const int64_t ng = std::min<int64_t>(4, nr - g0);
      const int64_t kper = nk && g0 == 0 ? (nkb / 64 + wp / 64 - 1) / (wp / 64) : 0;  // lines per 64 keys
      for (int64_t b = 0; b < wp / 16; b += 4) {
        for (int64_t l = 0; l < kper; l++) {  // and its K, likewise
          const int64_t off = ((b / 4) * kper + l) * 64;
          if (off < nkb) _mm_prefetch(nk + off, _MM_HINT_T1);
        }
        __m512 a[4][4];
        for (auto& row : a) for (auto& x : row) x = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / 2; i++) {
          const uint32_t* kr = kt + i * ld + b * 16;
          const __m512bh k0 = (__m512bh)_mm512_load_si512(kr), k1 = (__m512bh)_mm512_load_si512(kr + 16);
          const __m512bh k2 = (__m512bh)_mm512_load_si512(kr + 32), k3 = (__m512bh)_mm512_load_si512(kr + 48);
          for (int64_t g = 0; g < 4; g++) {
            if (g >= ng) break;
            const __m512bh qq = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qb + (g0 + g) * D + 2 * i));
            a[g][0] = _mm512_dpbf16_ps(a[g][0], k0, qq);
            a[g][1] = _mm512_dpbf16_ps(a[g][1], k1, qq);
            a[g][2] = _mm512_dpbf16_ps(a[g][2], k2, qq);
            a[g][3] = _mm512_dpbf16_ps(a[g][3], k3, qq);
          }
        }
        for (int64_t g = 0; g < 4; g++)
          if (g < ng)
            for (int j = 0; j < 4; j++) _mm512_store_ps(s + (g0 + g) * C + b * 16 + 16 * j, a[g][j]);
      }
    }
    softmax_rows(s, pb, nr, w, wp, scale, part + r0, from ? from + r0 : nullptr, to ? to + r0 : nullptr);
    for (int64_t g0 = 0; vpre && g0 < nr; g0 += 4) {  // values over pre-paired V: each zmm 16 dims of a key pair
      const int64_t ng = std::min<int64_t>(4, nr - g0);
      __m512 a[4][D / 16];
      for (auto& row : a) for (auto& x : row) x = _mm512_setzero_ps();
      const int64_t per = nv && g0 == 0 ? (nvb / 64 + (w + 1) / 2 - 1) / ((w + 1) / 2) : 0;  // lines a pair
      for (int64_t t = 0; t < w; t += 2) {
        const uint32_t* vu = vpre + (t / 2) * D;
        for (int64_t l = 0; l < per; l++) {  // the thread's next item's V on its way to L2 as this one computes
          const int64_t off = ((t / 2) * per + l) * 64;
          if (off < nvb) _mm_prefetch(nv + off, _MM_HINT_T1);
        }
        __m512bh pp[4];
        for (int64_t g = 0; g < 4; g++)
          pp[g] = (__m512bh)_mm512_set1_epi32(g < ng ? *reinterpret_cast<const int32_t*>(pb + (g0 + g) * C + t) : 0);
        for (int64_t j = 0; j < D / 16; j++) {
          const __m512bh vv = (__m512bh)_mm512_loadu_si512(vu + 16 * j);
          for (int64_t g = 0; g < 4; g++)
            if (g < ng) a[g][j] = _mm512_dpbf16_ps(a[g][j], vv, pp[g]);
        }
      }
      for (int64_t g = 0; g < 4; g++)
        if (g < ng)
          for (int64_t j = 0; j < D / 16; j++) _mm512_storeu_ps(acc[r0 + g0 + g] + 16 * j, a[g][j]);
    }
    for (int64_t g0 = 0; !vpre && g0 < nr; g0 += 4) {  // values, 4 rows at a time
      const int64_t ng = std::min<int64_t>(4, nr - g0);
      __m512 a[4][2 * MAXD / 32];  // [row][lo/hi half of each zmm of V; then a width 32 nd + 16's last 16 dims]
      for (auto& row : a) for (auto& x : row) x = _mm512_setzero_ps();
      for (int64_t t = 0; t < w; t += 2) {
        const at::BFloat16* v0 = v + t * stride;
        const bool two = t + 1 < w;
        if (g0 == 0 && t + 16 < w)  // 16 keys ahead
          for (int64_t off = 0; off < D * 4; off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(v0 + 16 * stride) + off, _MM_HINT_T0);
        for (int64_t h = 0; h < nd; h++) {
          const __m512i x0 = _mm512_loadu_si512(v0 + 32 * h);
          const __m512i x1 = two ? _mm512_loadu_si512(v0 + stride + 32 * h) : _mm512_setzero_si512();
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
          for (int64_t g = 0; g < ng; g++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(pb + (g0 + g) * C + t));
            a[g][2 * h] = _mm512_dpbf16_ps(a[g][2 * h], lo, pp);
            a[g][2 * h + 1] = _mm512_dpbf16_ps(a[g][2 * h + 1], hi, pp);
          }
        }
        if (tail) {  // the last 16 dims, paired as pair_dims pairs them (lanes in dim order)
          const __m512bh vv = (__m512bh)pair_dims(v, stride, t, w, 32 * nd);
          for (int64_t g = 0; g < ng; g++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(pb + (g0 + g) * C + t));
            a[g][2 * nd] = _mm512_dpbf16_ps(a[g][2 * nd], vv, pp);
          }
        }
      }
      // lane 4L + j of lo holds dim 8L + j of its 32 (j < 4), of hi dim 8L + 4 + j: back in order
      const __m512i i0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
      const __m512i i1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
      for (int64_t g = 0; g < ng; g++) {
        for (int64_t h = 0; h < nd; h++) {
          _mm512_storeu_ps(acc[r0 + g0 + g] + 32 * h, _mm512_permutex2var_ps(a[g][2 * h], i0, a[g][2 * h + 1]));
          _mm512_storeu_ps(acc[r0 + g0 + g] + 32 * h + 16, _mm512_permutex2var_ps(a[g][2 * h], i1, a[g][2 * h + 1]));
        }
        if (tail) _mm512_storeu_ps(acc[r0 + g0 + g] + 32 * nd, a[g][2 * nd]);
      }
    }
  }
}

// k, v (H, n, D) bf16, rows contiguous -> kt (H, nc, D/2, C) int32, kt[h][c][i][t] = (K[cC + t][2i],
// K[cC + t][2i + 1]), and vt (H, ceil(n/2), D) int32, vt[h][u][d] = (V[2u][d], V[2u + 1][d]); zero past n.
// What item_avx512 arranges per item and step, done once for a resident prefix.
std::tuple<at::Tensor, at::Tensor> pair_kv(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
              k.stride(2) == 1 && v.stride(2) == 1, "k, v: (H, n, D) bfloat16, rows contiguous");
  const int64_t H = k.size(0), n = k.size(1), D = k.size(2), nc = (n + C - 1) / C, nu = (n + 1) / 2;
  TORCH_CHECK(cagk::head_dim_ok(D), "head dim 64, 80, 96, 128 or 256");
  at::Tensor kt = at::zeros({H, nc, D / 2, C}, k.options().dtype(at::kInt));
  at::Tensor vt = at::empty({H, nu, D}, k.options().dtype(at::kInt));
  const at::BFloat16* kd = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vd = v.data_ptr<at::BFloat16>();
  uint32_t* ktd = reinterpret_cast<uint32_t*>(kt.data_ptr<int32_t>());
  uint32_t* vtd = reinterpret_cast<uint32_t*>(vt.data_ptr<int32_t>());
  at::parallel_for(0, H * nc, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t h = i / nc, c = i % nc, w = std::min(C, n - c * C);
      for (int64_t b = 0; b * 16 < w; b++)
        for (int64_t hh = 0; hh < (D + 31) / 32; hh++)  // groups of 16 pairs, the last of a width 32 g + 16 a half
          pair_keys(kd + h * k.stride(0) + c * C * k.stride(1), k.stride(1), w, b, hh, ktd + i * (D / 2) * C, C, D);
    }
  });
  at::parallel_for(0, H * nu, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t h = i / nu, t = 2 * (i % nu);
      for (int64_t j = 0; j < D; j += 16) _mm512_storeu_si512(vtd + i * D + j, pair_dims(vd + h * v.stride(0), v.stride(1), t, n, j));
    }
  });
  return {kt, vt};
}

}  // namespace

namespace cagk {

void softmax_block(float* s, uint16_t* pb, int64_t nr, int64_t w, int64_t wp, Scaling scale, Partial* part,
                   const int64_t* from, const int64_t* to) {
  softmax_rows(s, pb, nr, w, wp, scale, part, from, to);
}

// item_avx512_d for the head width at hand (a compile-time D keeps the accumulators in registers).
void item_avx512(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
                 int64_t w, int64_t D, Scaling scale, Partial* part, float* const* acc, const int64_t* from,
                 const int64_t* to, const uint32_t* kpre, const uint32_t* vpre, const char* nk, int64_t nkb,
                 const char* nv, int64_t nvb) {
  switch (D) {
    case 64: item_avx512_d<64>(q, rows, k, v, stride, w, scale, part, acc, from, to, kpre, vpre, nk, nkb, nv, nvb); break;
    case 80: item_avx512_d<80>(q, rows, k, v, stride, w, scale, part, acc, from, to, kpre, vpre, nk, nkb, nv, nvb); break;
    case 96: item_avx512_d<96>(q, rows, k, v, stride, w, scale, part, acc, from, to, kpre, vpre, nk, nkb, nv, nvb); break;
    case 128: item_avx512_d<128>(q, rows, k, v, stride, w, scale, part, acc, from, to, kpre, vpre, nk, nkb, nv, nvb); break;
    default: item_avx512_d<256>(q, rows, k, v, stride, w, scale, part, acc, from, to, kpre, vpre, nk, nkb, nv, nvb);
  }
}

}  // namespace cagk

TORCH_LIBRARY_FRAGMENT(cag, m) {
  m.def("pair_kv(Tensor k, Tensor v) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("pair_kv", pair_kv);
}
