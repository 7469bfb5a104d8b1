// Decode attention over a resident prefix held in 8 bits (an int8 snapshot, CAG_KV_DTYPE=int8): the
// prefix items of cagk::Attention read the snapshot's codes and scales as stored (GGUF Q8_0's blocks of
// 32 along head_dim, one float16 scale each; one block a head where head_dim is not a multiple of 32,
// 80; store/kv_int8.py) instead of bf16 K/V, about half the bytes a decode step reads at long prefixes.
//
// Scores by integer dot products (AVX512-VNNI, llama.cpp's q8_0 x q8_0): each query row is quantized to
// int8 codes per block of 32 (step = max|q| / 127, round to nearest even; a width of 32 g + 16 ends with a
// block of 16), multiplied with the keys' codes into exact int32 sums per query block, then scaled in
// float32 by the query block's step and the scale of the key block holding it (a head of 80: three query
// blocks, 32 + 32 + 16 dims, in one key block). Values in float32: each key's codes converted
// once and added into every row with weight p_t x its block's scale (p rounded to bf16 once, as the bf16
// kernel does, and the row's probability sum uses the rounded values). A row's bits depend on its own
// query and keys only, and the order of every sum is fixed: the same as alone in any batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <tuple>

#include "arch/avx512/kernels.h"

namespace {

constexpr int64_t C = cagk::CHUNK;
constexpr int64_t B32 = 32;  // the query's block along head_dim (and the keys' where D is a multiple of it)

struct Scratch8 {  // an item's working memory, per thread
  alignas(64) int8_t qc[16 * cagk::MAXD];            // (16, D) query rows' codes
  alignas(64) float qd[16 * cagk::MAXD / B32];       // (16, QB) their steps per query block
  alignas(64) int32_t qz[16 * cagk::MAXD / B32];     // (16, QB) 128 x the sum of their codes (the keys' offset)
  alignas(64) float s[16 * C];                       // (16, C) scores
  alignas(64) uint16_t pb[16 * C];                   // (16, C) probabilities in bf16
  alignas(64) float wv[4 * (cagk::MAXD / B32) * C];  // (4, NB, C) p_t x V's block scale, 4 rows at a time
};
thread_local Scratch8 scratch8;

// Row q (D floats) -> codes, steps and offsets per block of 32; a width of 32 g + 16 ends with a block of 16.
void quantize_row(const float* q, int64_t D, int8_t* qc, float* qd, int32_t* qz) {
  for (int64_t b = 0; b < D / B32; b++) {
    const __m512 x0 = _mm512_loadu_ps(q + b * B32), x1 = _mm512_loadu_ps(q + b * B32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));  // nearest even (MXCSR default)
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + b * B32), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + b * B32 + 16), _mm512_cvtsepi32_epi8(c1));
    qd[b] = d;
    qz[b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
  }
  if (D % B32) {  // the last 16 dims: a half block, quantized as the whole ones are
    const int64_t b = D / B32, j = b * B32;
    const __m512 x0 = _mm512_loadu_ps(q + j);
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(x0));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + j), _mm512_cvtsepi32_epi8(c0));
    qd[b] = d;
    qz[b] = 128 * _mm512_reduce_add_epi32(c0);
  }
}

template <int64_t D>
void item_int8_d(const float* const* q, int64_t rows, const uint8_t* kc, const uint8_t* vc, int64_t w, cagk::Scaling scale,
                 cagk::Partial* part, float* const* acc, const char* nk, const char* nv, const int64_t* from) {
  constexpr int64_t QB = (D + B32 - 1) / B32;    // the query's blocks (quantize_row): of 32, the last of 32 g + 16 a half
  constexpr int64_t NB = cagk::int8_blocks(D);    // the keys' and values' blocks: of 32, or one a head of 80
  constexpr int64_t BW = D / NB;                  // their width
  constexpr int64_t KB = cagk::int8_item_bytes(D), VB = KB;  // an item's bytes (pair_kv8)
  const int64_t wp = (w + 63) / 64 * 64;
  const uint32_t* kd = reinterpret_cast<const uint32_t*>(kc);      // (D/4, C): 4 dims of a key, codes + 128
  const uint16_t* ksc = reinterpret_cast<const uint16_t*>(kc + D * C);  // (NB, C) float16
  const int8_t* vd = reinterpret_cast<const int8_t*>(vc);          // (C, D) codes
  const uint16_t* vsc = reinterpret_cast<const uint16_t*>(vc + C * D);  // (NB, C) float16
  Scratch8& sc = scratch8;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    for (int64_t r = 0; r < nr; r++) quantize_row(q[r0 + r], D, sc.qc + r * D, sc.qd + r * QB, sc.qz + r * QB);
    for (int64_t g0 = 0; g0 < nr; g0 += 4) {  // scores of 4 rows x 32 keys at a time
      const int64_t ng = std::min<int64_t>(4, nr - g0);
      const int64_t per = nk && r0 == 0 && g0 == 0 ? KB / (wp / 32) : 0;  // the next item's K, spread over the steps
      for (int64_t b = 0; b < wp / 16; b += 2) {
        for (int64_t off = (b / 2) * per; off < (b / 2 + 1) * per; off += 64) _mm_prefetch(nk + off, _MM_HINT_T1);
        __m512 sf[4][2];
        for (auto& row : sf) row[0] = row[1] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < QB; blk++) {  // query block blk: dwords [8 blk, 8 blk + 8) of a key, or its last 4
          __m512i ai[4][2];
          for (auto& row : ai) row[0] = row[1] = _mm512_setzero_si512();
          for (int64_t i = blk * 8; i < std::min<int64_t>(blk * 8 + 8, D / 4); i++) {
            const __m512i k0 = _mm512_load_si512(kd + i * C + b * 16), k1 = _mm512_load_si512(kd + i * C + b * 16 + 16);
            for (int64_t g = 0; g < 4; g++) {
              if (g >= ng) break;
              const __m512i qq = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(sc.qc + (g0 + g) * D + 4 * i));
              ai[g][0] = _mm512_dpbusd_epi32(ai[g][0], k0, qq);
              ai[g][1] = _mm512_dpbusd_epi32(ai[g][1], k1, qq);
            }
          }
          const int64_t kb = blk * B32 / BW;  // the keys' block holding it
          const __m512 ks0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ksc + kb * C + b * 16)));
          const __m512 ks1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ksc + kb * C + b * 16 + 16)));
          for (int64_t g = 0; g < 4; g++) {
            if (g >= ng) break;
            const __m512i z = _mm512_set1_epi32(sc.qz[(g0 + g) * QB + blk]);
            const __m512 f = _mm512_set1_ps(sc.qd[(g0 + g) * QB + blk]);
            sf[g][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai[g][0], z)), _mm512_mul_ps(ks0, f), sf[g][0]);
            sf[g][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai[g][1], z)), _mm512_mul_ps(ks1, f), sf[g][1]);
          }
        }
        for (int64_t g = 0; g < 4; g++) {
          if (g >= ng) break;
          _mm512_store_ps(sc.s + (g0 + g) * C + b * 16, sf[g][0]);
          _mm512_store_ps(sc.s + (g0 + g) * C + b * 16 + 16, sf[g][1]);
        }
      }
    }
    cagk::softmax_block(sc.s, sc.pb, nr, w, wp, scale, part + r0, from ? from + r0 : nullptr);
    for (int64_t g0 = 0; g0 < nr; g0 += 4) {  // values, 4 rows at a time
      const int64_t ng = std::min<int64_t>(4, nr - g0);
      for (int64_t g = 0; g < ng; g++)  // each key's weight per block: p_t x scale
        for (int64_t blk = 0; blk < NB; blk++)
          for (int64_t t = 0; t < wp; t += 16) {
            const __m512 p = _mm512_cvtpbh_ps((__m256bh)_mm256_load_si256(reinterpret_cast<const __m256i*>(sc.pb + (g0 + g) * C + t)));
            const __m512 s = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(vsc + blk * C + t)));
            _mm512_store_ps(sc.wv + (g * NB + blk) * C + t, _mm512_mul_ps(p, s));
          }
      const int64_t per = nv && r0 == 0 && g0 == 0 ? (VB + w - 1) / w : 0;  // the next item's V, spread over the keys
      __m512 a[4][D / 16];
      for (auto& row : a) for (auto& x : row) x = _mm512_setzero_ps();
      for (int64_t t = 0; t < w; t++) {
        for (int64_t off = t * per / 64 * 64; off < (t + 1) * per; off += 64) _mm_prefetch(nv + off, _MM_HINT_T1);
        const int8_t* vr = vd + t * D;
        for (int64_t j = 0; j < D / 16; j++) {
          const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(vr + 16 * j))));
          for (int64_t g = 0; g < 4; g++) {
            if (g >= ng) break;
            a[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(sc.wv[(g * NB + 16 * j / BW) * C + t]), x, a[g][j]);
          }
        }
      }
      for (int64_t g = 0; g < ng; g++)
        for (int64_t j = 0; j < D / 16; j++) _mm512_storeu_ps(acc[r0 + g0 + g] + 16 * j, a[g][j]);
    }
  }
}

// k, v (H, n, D) int8 codes and ks, vs (H, n, NB) float16 scales (NB = int8_blocks(D): D/32, or 1 for a head of 80)
// -> kt (H, nc, KB) uint8: per chunk of C keys the keys' codes + 128 as (D/4, C) dwords (4 dims of a key each)
// then their scales (NB, C); vt (H, nc, VB) uint8: the values' codes (C, D) then their scales (NB, C). Zero past n.
// Done once for a resident prefix.
std::tuple<at::Tensor, at::Tensor> pair_kv8(const at::Tensor& k, const at::Tensor& ks, const at::Tensor& v, const at::Tensor& vs) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kChar && v.scalar_type() == at::kChar &&
              k.is_contiguous() && v.is_contiguous(), "k, v: (H, n, D) int8, contiguous");
  const int64_t H = k.size(0), n = k.size(1), D = k.size(2), nc = (n + C - 1) / C;
  TORCH_CHECK(cagk::head_dim_ok(D), "int8 K/V: head dim 64, 80, 96, 128 or 256");
  const int64_t NB = cagk::int8_blocks(D);
  for (const at::Tensor* s : {&ks, &vs})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->is_contiguous() && s->sizes() == at::IntArrayRef({H, n, NB}),
                "ks, vs: (H, n, blocks) float16, contiguous (blocks of 32 along D; one a head of 80)");
  const int64_t KB = cagk::int8_item_bytes(D), VB = KB;
  at::Tensor kt = at::zeros({H, nc, KB}, k.options().dtype(at::kByte)), vt = at::zeros({H, nc, VB}, k.options().dtype(at::kByte));
  const int8_t *kd = k.data_ptr<int8_t>(), *vd = v.data_ptr<int8_t>();
  const uint16_t *ksd = reinterpret_cast<const uint16_t*>(ks.data_ptr<at::Half>()), *vsd = reinterpret_cast<const uint16_t*>(vs.data_ptr<at::Half>());
  uint8_t *ktd = kt.data_ptr<uint8_t>(), *vtd = vt.data_ptr<uint8_t>();
  at::parallel_for(0, H * nc, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t h = i / nc, c = i % nc, w = std::min(C, n - c * C);
      uint8_t* ko = ktd + i * KB;
      uint16_t* kso = reinterpret_cast<uint16_t*>(ko + D * C);
      uint8_t* vo = vtd + i * VB;
      uint16_t* vso = reinterpret_cast<uint16_t*>(vo + C * D);
      uint32_t* ko32 = reinterpret_cast<uint32_t*>(ko);
      for (int64_t t = 0; t < w; t++) {
        const int64_t src = (h * n + c * C + t);
        const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kd + src * D);
        for (int64_t i = 0; i < D / 4; i++) ko32[i * C + t] = k32[i] ^ 0x80808080u;  // each byte's code + 128
        std::memcpy(vo + t * D, vd + src * D, D);
        for (int64_t b = 0; b < NB; b++) {
          kso[b * C + t] = ksd[src * NB + b];
          vso[b * C + t] = vsd[src * NB + b];
        }
      }
    }
  });
  return {kt, vt};
}

}  // namespace

namespace cagk {

void item_int8(const float* const* q, int64_t rows, const uint8_t* kc, const uint8_t* vc, int64_t w, int64_t D, Scaling scale,
               Partial* part, float* const* acc, const char* nk, const char* nv, const int64_t* from) {
  switch (D) {
    case 64: item_int8_d<64>(q, rows, kc, vc, w, scale, part, acc, nk, nv, from); break;
    case 80: item_int8_d<80>(q, rows, kc, vc, w, scale, part, acc, nk, nv, from); break;
    case 96: item_int8_d<96>(q, rows, kc, vc, w, scale, part, acc, nk, nv, from); break;
    case 128: item_int8_d<128>(q, rows, kc, vc, w, scale, part, acc, nk, nv, from); break;
    default: item_int8_d<256>(q, rows, kc, vc, w, scale, part, acc, nk, nv, from);
  }
}

}  // namespace cagk

TORCH_LIBRARY_FRAGMENT(cag, m) {
  m.def("pair_kv8(Tensor k, Tensor ks, Tensor v, Tensor vs) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("pair_kv8", pair_kv8);
}
