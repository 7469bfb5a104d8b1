// Decode attention on AVX512-BF16, or on Intel AMX tiles where the compiler targets them: the query
// rows of each request (one new token: its heads that share a K/V head) over the prefix the requests
// share and each request's own suffix, in one call.
// Built and loaded by cag/kernels/native.py; used by cag/runtime/cascade.py for decode rows over bf16 K/V. At the end of
// the file, the step's glue (rms_bf16, rope_write) that cag/runtime/step.py calls in the same configuration.
//
// Work: keys are read in items of C keys (a prefix chunk for all rows of every request on it, or a
// suffix chunk for one request's rows), spread over the threads; each item leaves per row its max
// score m, its probability sum l and sum_t p_t v_t (unnormalized), merged per row in chunk order.
// Products are bf16 pairs with float32 sums (q and the probabilities rounded to bf16, as in torch's
// flash kernel): on AMX tiles (`decode_attention`) or by AVX512-BF16 dot products
// (`decode_attention_avx512`; the two differ in the last bits); softmax in float32 on AVX-512. A row's
// result depends on its own query and keys only: each output element comes from its own row, and
// nothing else mixes rows. So a request's bits never depend on which other requests share its step.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "step_args.h"

namespace {

constexpr int64_t C = cagk::CHUNK;  // keys per item: its K (transposed) and V (paired) stay in L2
constexpr int64_t MAXD = cagk::MAXD;
// A pre-paired prefix item prefetches the one its thread takes AHEAD items later into L2 as it computes
// (1 to 3 ahead measured alike, 4 slower: bench/bench_decode.py's attention rows).
constexpr int64_t AHEAD = 1;

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CAG_AMX 1
struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles t0-t7, each 16 rows x 64 bytes: t0 scores (16 rows x 16 keys, fp32), t1 the A operand (16
// rows x 32 bf16 of q or of probabilities), t2 the B operand (16 pair rows), t4-t7 values (16 rows x
// 16 dims each). oneDNN keeps its own tile configuration per thread and may rely on it between
// calls: it is saved here and put back afterwards.
struct Tiles {
  TileConfig saved, mine;
  Tiles() {
    _tile_storeconfig(&saved);
    mine.palette = 1;
    for (int i = 0; i < 8; i++) { mine.colsb[i] = 64; mine.rows[i] = 16; }
    _tile_loadconfig(&mine);
  }
  ~Tiles() {
    if (saved.palette) _tile_loadconfig(&saved); else _tile_release();
  }
};
#else
struct Tiles {};  // built for a CPU without AMX: only the AVX512-BF16 kernel
#endif

using cagk::Partial;

// An item's working memory (~165 KB), per thread: not on the stack of a pool thread.
struct Scratch {
  alignas(64) uint32_t kt[(MAXD / 2) * C];  // (D/2, wp): kt[i][t] = (K[t][2i], K[t][2i+1]), AMX's B for scores
  alignas(64) uint32_t vp[(C / 2) * MAXD];  // (wp/2, D): vp[u][d] = (V[2u][d], V[2u+1][d]), AMX's B for values
  alignas(64) uint16_t qb[16 * MAXD];       // (16, D) a block of query rows in bf16
  alignas(64) float s[16 * C];              // (16, C) scores
  alignas(64) uint16_t pb[16 * C];          // (16, C) probabilities in bf16
  alignas(64) float out[16 * MAXD];         // (16, D)
};
thread_local Scratch scratch;

// The softmax of `nr` rows of scores s (rows C apart, keys [0, w) of wp), keys past w masked: writes the
// probabilities rounded to bf16 to pb (rows C apart) and part[r] = (max, sum of the rounded values).
void softmax_rows(float* s, uint16_t* pb, int64_t nr, int64_t w, int64_t wp, float scale, Partial* part) {
  const __m512 neg = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < nr; r++) {
    float* sr = s + r * C;
    __m512 mx = neg;
    for (int64_t b = 0; b < wp / 16; b++) {
      const int64_t left = std::max<int64_t>(0, w - b * 16);
      __m512 x = _mm512_mul_ps(_mm512_load_ps(sr + b * 16), _mm512_set1_ps(scale));
      if (left < 16) x = _mm512_mask_blend_ps((__mmask16)((1u << left) - 1), neg, x);
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

// Keys [16 b, 16 b + 16) of an item (rows of D bf16, `stride` apart; those past w skipped) on their way
// to L1 while the block before them is worked on.
inline void prefetch_keys(const at::BFloat16* k, int64_t b, int64_t w, int64_t stride, int64_t D) {
  for (int64_t u = 0; u < 16 && b * 16 + u < w; u++)
    for (int64_t off = 0; off < D * 2; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(k + (b * 16 + u) * stride) + off, _MM_HINT_T0);
}

// q rows (fp32, D floats each) rounded to bf16 into qb (rows D apart); rows past nr (up to `to`) zero.
// 32 dims a step; a width of 32 g + 16 ends with 16 (the same rounding per element).
void round_q(const float* const* q, int64_t nr, int64_t to, int64_t D, uint16_t* qb) {
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

#ifdef CAG_AMX
// One item on AMX tiles: `rows` query rows (fp32, D floats at q[r]) over keys [0, w) whose K and V rows
// (bf16, D each) start at k and v, `stride` elements apart. Writes part[r] = (max score, probability
// sum) and acc[r] (D floats) = sum_t p_t V[t]; the probabilities are rounded to bf16 once and both the
// sum and the products use the rounded values.
void item_amx(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
              int64_t w, int64_t D, float scale, Partial* part, float* const* acc) {
  const int64_t wp = (w + 63) / 64 * 64;  // keys padded to whole blocks (zeros, masked)
  Scratch& sc = scratch;
  uint32_t* kt = sc.kt;
  uint32_t* vp = sc.vp;
  uint16_t* qb = sc.qb;
  float* s = sc.s;
  uint16_t* pb = sc.pb;
  float* out = sc.out;
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k);
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)(stride / 2)));
  for (int64_t b = 0; b < wp / 16; b++) {  // 16 keys at a time: pair i of each key into row i
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, w - b * 16));
    const __mmask16 mask = (__mmask16)((1u << left) - 1);
    prefetch_keys(k, b + 1, w, stride, D);  // the next block while this one is gathered (gathers defeat the prefetcher)
    for (int64_t i = 0; i < D / 2; i++)
      _mm512_store_si512(kt + i * wp + b * 16,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, lanes, k32 + b * 16 * (stride / 2) + i, 4));
  }
  for (int64_t t = 0; t < wp; t += 2)  // consecutive keys interleaved per dim
    for (int64_t j = 0; j < D / 16; j++) _mm512_store_si512(vp + (t / 2) * D + 16 * j, pair_dims(v, stride, t, w, 16 * j));
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {  // blocks of 16 rows (the last padded with zeros)
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    round_q(q + r0, nr, 16, D, qb);
    for (int64_t b = 0; b < wp / 16; b++) {  // scores: 16 rows x 16 keys, d in steps of 32
      _tile_zero(0);
      for (int64_t g = 0; g < D / 32; g++) {
        _tile_loadd(1, qb + 32 * g, D * 2);
        _tile_loadd(2, kt + 16 * g * wp + b * 16, wp * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s + b * 16, C * 4);
    }
    softmax_rows(s, pb, nr, w, wp, scale, part + r0);
    for (int64_t r = nr; r < 16; r++) std::memset(pb + r * C, 0, wp * 2);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // values: 16 rows x 64 dims (t4-t7), keys in steps of 32
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t t = 0; t < wp; t += 32) {
        _tile_loadd(1, pb + t, C * 2);
        const uint32_t* vb = vp + (t / 2) * D + d0;
        _tile_loadd(2, vb, D * 4); _tile_dpbf16ps(4, 1, 2);
        _tile_loadd(2, vb + 16, D * 4); _tile_dpbf16ps(5, 1, 2);
        _tile_loadd(2, vb + 32, D * 4); _tile_dpbf16ps(6, 1, 2);
        _tile_loadd(2, vb + 48, D * 4); _tile_dpbf16ps(7, 1, 2);
      }
      _tile_stored(4, out + d0, D * 4); _tile_stored(5, out + d0 + 16, D * 4);
      _tile_stored(6, out + d0 + 32, D * 4); _tile_stored(7, out + d0 + 48, D * 4);
    }
    for (int64_t r = 0; r < nr; r++) std::memcpy(acc[r0 + r], out + r * D, D * 4);
  }
}
#endif

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

// The same item by AVX512-BF16 dot products (CPUs without AMX: AMD Zen 4 and later, Intel before
// Sapphire Rapids with avx512_bf16). Gathers are slow on some of these (Zen 4):
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
                 int64_t w, float scale, Partial* part, float* const* acc,
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
    softmax_rows(s, pb, nr, w, wp, scale, part + r0);
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

// item_avx512_d for the head width at hand (a compile-time D keeps the accumulators in registers).
void item_avx512(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
                 int64_t w, int64_t D, float scale, Partial* part, float* const* acc,
                 const uint32_t* kpre = nullptr, const uint32_t* vpre = nullptr,
                 const char* nk = nullptr, int64_t nkb = 0, const char* nv = nullptr, int64_t nvb = 0) {
  switch (D) {
    case 64: item_avx512_d<64>(q, rows, k, v, stride, w, scale, part, acc, kpre, vpre, nk, nkb, nv, nvb); break;
    case 80: item_avx512_d<80>(q, rows, k, v, stride, w, scale, part, acc, kpre, vpre, nk, nkb, nv, nvb); break;
    case 96: item_avx512_d<96>(q, rows, k, v, stride, w, scale, part, acc, kpre, vpre, nk, nkb, nv, nvb); break;
    case 128: item_avx512_d<128>(q, rows, k, v, stride, w, scale, part, acc, kpre, vpre, nk, nkb, nv, nvb); break;
    default: item_avx512_d<256>(q, rows, k, v, stride, w, scale, part, acc, kpre, vpre, nk, nkb, nv, nvb);
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


bool amx_permitted() {  // Linux hands out AMX tile state on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

}  // namespace

namespace cagk {

void softmax_block(float* s, uint16_t* pb, int64_t nr, int64_t w, int64_t wp, float scale, Partial* part) {
  softmax_rows(s, pb, nr, w, wp, scale, part);
}

// q (B, H, R, D) float32: request b, K/V head h, row r (the query heads sharing h); kp, vp (H, n, D)
// bf16: the shared prefix (n may be 0); ks, vs (S, H, room, D) bf16: the request slots; slots (B,),
// lens (B,) int64: request b reads keys [0, lens[b]) of slot slots[b].
// kt, vt (avx512 only): the prefix as pair_kv gives it, read in place of kp and vp's rows; or as pair_kv8 gives
// it (uint8: an int8 snapshot's codes), kp and vp then read for their shapes only.
Attention::Attention(const float* q, int64_t B, int64_t H, int64_t R, int64_t D, const at::Tensor& kp_,
                     const at::Tensor& vp_, const at::Tensor& ks_, const at::Tensor& vs_, const at::Tensor& slots,
                     const at::Tensor& lens, double scale_, const std::optional<at::Tensor>& kt,
                     const std::optional<at::Tensor>& vt, bool amx)
    : qd(q), B(B), H(H), R(R), D(D), kp(kp_), vp(vp_), ks(ks_), vs(vs_), scale((float)scale_) {
#ifndef CAG_AMX
  TORCH_CHECK(!amx, "this library was built for a CPU without AMX: use decode_attention_avx512");
#endif
  TORCH_CHECK(!amx || amx_permitted(), "the kernel refused to start: Linux did not grant AMX tile state to this process");
  TORCH_CHECK(!amx || D % 64 == 0, "the AMX attention takes heads of 64, 128 or 256 (it sums values 64 dims a tile group)");
  most = cagk::check_attention(B, H, D, kp, vp, ks, vs, slots, lens, true);  // suffix chunks of the longest suffix
  n = kp.size(1);
  slot = slots.data_ptr<int64_t>();
  len = lens.data_ptr<int64_t>();
  np = (n + C - 1) / C, chunks = np + most;  // per row: prefix chunks, then suffix chunks
  TORCH_CHECK(kt.has_value() == vt.has_value() && (!kt || !amx), "kt and vt: both or neither, and for the avx512 kernel");
  if (kt && kt->scalar_type() == at::kByte) {
    TORCH_CHECK(vt->scalar_type() == at::kByte && kt->is_contiguous() && vt->is_contiguous() &&
                kt->sizes() == at::IntArrayRef({H, np, cagk::int8_item_bytes(D)}) && vt->sizes() == kt->sizes(),
                "kt, vt: the prefix as pair_kv8 gives it");
    k8 = kt->data_ptr<uint8_t>();
    v8 = vt->data_ptr<uint8_t>();
  } else if (kt) {
    TORCH_CHECK(kt->scalar_type() == at::kInt && vt->scalar_type() == at::kInt && kt->is_contiguous() && vt->is_contiguous() &&
                kt->sizes() == at::IntArrayRef({H, np, D / 2, C}) && vt->sizes() == at::IntArrayRef({H, (n + 1) / 2, D}),
                "kt, vt: the prefix as pair_kv gives it");
    ktd = reinterpret_cast<const uint32_t*>(kt->data_ptr<int32_t>());
    vtd = reinterpret_cast<const uint32_t*>(vt->data_ptr<int32_t>());
  }
  part.resize(B * H * R * chunks);
  acc.resize(B * H * R * chunks * D);
  for (int64_t h = 0; h < H; h++)
    for (int64_t c = 0; c < np; c++) items.push_back(h * np + c);
  n_pre = (int64_t)items.size();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t c = 0; c < (len[b] + C - 1) / C; c++) items.push_back((b * H + h) * most + c);
}

template <bool AMX>
void Attention::work(int64_t p, int64_t nt) {
  [[maybe_unused]] std::conditional_t<AMX, Tiles, int> tiles{};
  std::vector<const float*> qs(B * R);
  std::vector<float*> accs(B * R);
  std::vector<Partial> ps(B * R);
  auto at = [&](int64_t b, int64_t h, int64_t r, int64_t c) { return ((b * H + h) * R + r) * chunks + c; };
  const int64_t n_items = (int64_t)items.size();
  for (int64_t i = p; i < n_items; i += nt) {  // share p takes items p, p + nt, ...: prefix and suffix spread evenly
    if (i < n_pre) {
      const int64_t h = items[i] / np, c = items[i] % np, t0 = c * C;
      for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < R; r++) {
          qs[b * R + r] = qd + ((b * H + h) * R + r) * D;
          accs[b * R + r] = acc.data() + at(b, h, r, c) * D;
        }
      const at::BFloat16* k0 = kp.data_ptr<at::BFloat16>() + h * kp.stride(0) + t0 * kp.stride(1);
      const at::BFloat16* v0 = vp.data_ptr<at::BFloat16>() + h * vp.stride(0) + t0 * vp.stride(1);
#ifdef CAG_AMX
      if (AMX) item_amx(qs.data(), B * R, k0, v0, kp.stride(1), std::min(C, n - t0), D, scale, ps.data(), accs.data());
      else
#endif
      if (k8) {
        const int64_t kb = cagk::int8_item_bytes(D), vb = kb;
        const bool next = i + AHEAD * nt < n_pre;  // a prefix item this thread takes later: prefetched as this one runs
        const int64_t j = next ? items[i + AHEAD * nt] : 0;
        cagk::item_int8(qs.data(), B * R, k8 + items[i] * kb, v8 + items[i] * vb, std::min(C, n - t0), D, scale, ps.data(),
                        accs.data(), next ? reinterpret_cast<const char*>(k8 + j * kb) : nullptr,
                        next ? reinterpret_cast<const char*>(v8 + j * vb) : nullptr);
      } else {
        const char *nk = nullptr, *nv = nullptr;  // a prefix item this thread takes later, if any
        int64_t nkb = 0, nvb = 0;
        if (ktd && i + AHEAD * nt < n_pre) {
          const int64_t h2 = items[i + AHEAD * nt] / np, c2 = items[i + AHEAD * nt] % np;
          nk = reinterpret_cast<const char*>(ktd + (h2 * np + c2) * (D / 2) * C), nkb = (D / 2) * C * 4;
          nv = reinterpret_cast<const char*>(vtd + (h2 * ((n + 1) / 2) + c2 * C / 2) * D);
          nvb = (std::min(C, n - c2 * C) + 1) / 2 * D * 4;
        }
        item_avx512(qs.data(), B * R, k0, v0, kp.stride(1), std::min(C, n - t0), D, scale, ps.data(), accs.data(),
                    ktd ? ktd + (h * np + c) * (D / 2) * C : nullptr, vtd ? vtd + (h * ((n + 1) / 2) + t0 / 2) * D : nullptr,
                    nk, nkb, nv, nvb);
      }
      for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < R; r++) part[at(b, h, r, c)] = ps[b * R + r];
    } else {
      const int64_t f = items[i], c = f % most, b = f / most / H, h = (f / most) % H, t0 = c * C;
      for (int64_t r = 0; r < R; r++) {
        qs[r] = qd + ((b * H + h) * R + r) * D;
        accs[r] = acc.data() + at(b, h, r, np + c) * D;
      }
      const at::BFloat16* k0 = ks.data_ptr<at::BFloat16>() + slot[b] * ks.stride(0) + h * ks.stride(1) + t0 * ks.stride(2);
      const at::BFloat16* v0 = vs.data_ptr<at::BFloat16>() + slot[b] * vs.stride(0) + h * vs.stride(1) + t0 * vs.stride(2);
#ifdef CAG_AMX
      if (AMX) item_amx(qs.data(), R, k0, v0, ks.stride(2), std::min(C, len[b] - t0), D, scale, ps.data(), accs.data());
      else
#endif
      item_avx512(qs.data(), R, k0, v0, ks.stride(2), std::min(C, len[b] - t0), D, scale, ps.data(), accs.data());
      for (int64_t r = 0; r < R; r++) part[at(b, h, r, np + c)] = ps[r];
    }
  }
}
template void Attention::work<false>(int64_t, int64_t);
#ifdef CAG_AMX
template void Attention::work<true>(int64_t, int64_t);
#endif

void Attention::merge(float* od) const {
  for (int64_t b = 0; b < B; b++)  // each row's chunks merged in a fixed order: prefix, then suffix
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++) {
        const int64_t k0 = ((b * H + h) * R + r) * chunks, kn = np + (len[b] + C - 1) / C;
        float m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < kn; c++) m = std::max(m, part[k0 + c].m);
        std::vector<float> ev(kn);
        for (int64_t c = 0; c < kn; c++) { ev[c] = std::exp(part[k0 + c].m - m); l += part[k0 + c].l * ev[c]; }
        float* dst = od + ((b * H + h) * R + r) * D;
        for (int64_t j = 0; j < D; j += 16) {
          __m512 o = _mm512_setzero_ps();
          for (int64_t c = 0; c < kn; c++)
            o = _mm512_fmadd_ps(_mm512_set1_ps(ev[c]), _mm512_loadu_ps(acc.data() + (k0 + c) * D + j), o);
          _mm512_storeu_ps(dst + j, _mm512_div_ps(o, _mm512_set1_ps(l)));
        }
      }
}

}  // namespace cagk

namespace {

// Returns (B, H, R, D) float32 (Attention's shapes), its items spread over torch's threads.
template <bool AMX>
at::Tensor attend(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& ks,
                  const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                  const std::optional<at::Tensor>& kt = std::nullopt, const std::optional<at::Tensor>& vt = std::nullopt) {
  cagk::check_attention_q(q);
  cagk::Attention a(q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), q.size(3), kp, vp, ks, vs, slots, lens, scale, kt, vt, AMX);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), a.items_n()));
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) a.work<AMX>(p, nt);
  });
  at::Tensor out = at::empty(q.sizes(), q.options());
  a.merge(out.data_ptr<float>());
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vpre, const at::Tensor& ks,
                            const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale) {
  return attend<true>(q, kp, vpre, ks, vs, slots, lens, scale);
}

at::Tensor decode_attention_avx512(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vpre, const at::Tensor& ks,
                                   const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                                   const std::optional<at::Tensor>& kt, const std::optional<at::Tensor>& vt) {
  return attend<false>(q, kp, vpre, ks, vs, slots, lens, scale, kt, vt);
}

}  // namespace

// The step's glue around the products, one call each instead of ~8 and ~14 small torch ops a layer.

namespace cagk {

// 1 / sqrt(mean(x^2) + eps) of one row x (N,) float32: the sum of squares in 16 lanes, then across them in a
// fixed order, so a row's bits are its own (rms_rows and rms_rows_f32 share it).
static float rms_inv(const float* xr, int64_t N, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 m = (__mmask16)(N - j >= 16 ? 0xFFFF : (1u << (N - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, xr + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)N + eps);
}

void rms_rows(const float* xd, const float* wd, int64_t R, int64_t N, float eps, uint16_t* od) {
  for (int64_t r = 0; r < R; r++) {
    const float* xr = xd + r * N;
    const float inv = rms_inv(xr, N, eps);
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = (__mmask16)(N - j >= 16 ? 0xFFFF : (1u << (N - j)) - 1);
      const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wd + j), _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), _mm512_set1_ps(inv)));
      _mm256_mask_storeu_epi16(od + r * N + j, m, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

void rms_rows_f32(float* x, int64_t ld, const float* wd, int64_t R, int64_t N, float eps) {
  for (int64_t r = 0; r < R; r++) {
    float* xr = x + r * ld;
    const float inv = rms_inv(xr, N, eps);
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 m = (__mmask16)(N - j >= 16 ? 0xFFFF : (1u << (N - j)) - 1);
      _mm512_mask_storeu_ps(xr + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wd + j),
                                                     _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), _mm512_set1_ps(inv))));
    }
  }
}

// rope is x * cos + roll(x, D/2) * sin with a rounding after each product and the sum, as torch computes it.
// Each half of a head runs in steps of 16 (the last one masked where D/2 is not a multiple of 16: 40 of
// a head of 80), so a step's rolled operand is one run of x: roll(x, D/2)[j] = x[j + D/2] in the first
// half, x[j - D/2] in the second.
void rope_rows(const float* qkv, int64_t ld, const float* cd, const float* sd, int64_t R, int64_t H, int64_t Hk,
               int64_t D, int64_t room, const int64_t* sl, const int64_t* ps, float* qd, uint16_t* kd, uint16_t* vd) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; r++) {
    const float* row = qkv + r * ld;
    const float* c = cd + r * D;
    const float* sn = sd + r * D;
    for (int64_t h = 0; h < H + Hk; h++) {  // q heads, then k heads
      const float* x = row + h * D;
      for (int64_t j0 : {(int64_t)0, half})
        for (int64_t j = j0; j < j0 + half; j += 16) {
          const int64_t o = j0 ? j - half : j + half;
          const __mmask16 m = (__mmask16)(j0 + half - j >= 16 ? 0xFFFF : (1u << (j0 + half - j)) - 1);
          const __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_maskz_loadu_ps(m, c + j)),
                                         _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + o), _mm512_maskz_loadu_ps(m, sn + j)));
          if (h < H) _mm512_mask_storeu_ps(qd + (r * H + h) * D + j, m, y);
          else _mm256_mask_storeu_epi16(kd + ((sl[r] * Hk + (h - H)) * room + ps[r]) * D + j, m, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
    for (int64_t h = 0; h < Hk; h++)
      for (int64_t j = 0; j < D; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(vd + ((sl[r] * Hk + h) * room + ps[r]) * D + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + (H + Hk + h) * D + j)));
  }
}

// torch's float -> bf16: round to nearest even by adding 0x7FFF plus the lowest kept bit; NaN -> 0x7FC0.
inline __m256i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

void to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
    _mm256_mask_storeu_epi16(y + j, m, bf16_rne(_mm512_maskz_loadu_ps(m, x + j)));
  }
}

// silu(g) = g * sigmoid(g), sigmoid from e = e^-|g| (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
void silu_mul_rows(const float* gu, int64_t R, int64_t I, uint16_t* y) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < I; j += 16) {
      const __mmask16 m = (__mmask16)(I - j >= 16 ? 0xFFFF : (1u << (I - j)) - 1);
      const __m512 g = _mm512_maskz_loadu_ps(m, gu + r * 2 * I + j), u = _mm512_maskz_loadu_ps(m, gu + r * 2 * I + I + j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
      const __m512 one = _mm512_set1_ps(1.0f), den = _mm512_add_ps(one, e);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, one), den);
      _mm256_mask_storeu_epi16(y + r * I + j, m, bf16_rne(_mm512_mul_ps(_mm512_mul_ps(g, sig), u)));
    }
}

}  // namespace cagk

namespace {

// x (R, N) float32, w (N,) float32 -> (R, N) bfloat16: LlamaRMSNorm in float32, w * (x * rsqrt(mean(x^2)
// + eps)), rounded once to bf16 (the packed products' input).
at::Tensor rms_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  cagk::check_rms_bf16(x, w);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kBFloat16));
  cagk::rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), (float)eps,
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// x (..., N) float32, w (N,) float32 -> x's shape float32: the same norm as rms_bf16 (LlamaRMSNorm's order),
// not rounded: the step's q/k norms (per head or over the projection) and post-norms.
at::Tensor rms_f32(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = cagk::check_rms_f32(x, w);
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  cagk::rms_rows_f32(out.data_ptr<float>(), N, w.data_ptr<float>(), N ? out.numel() / N : 0, N, (float)eps);
  return out;
}

// gu (R, 2 I) float32, each row gate ++ up -> (R, I) bfloat16: silu(gate) * up, rounded once (torch's rounding).
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  cagk::check_silu_mul(gu);
  at::Tensor out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options().dtype(at::kBFloat16));
  cagk::silu_mul_rows(gu.data_ptr<float>(), gu.size(0), gu.size(1) / 2, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// qkv (R, (H + 2 Hk) D) float32: each row's q, k and v; cos, sin (R, D) float32 (sin's first half
// negated, cag.runtime.step). Writes roped k and v as bf16 to K, V (S, Hk, room, D) at [slot[r], :, pos[r]]
// and returns roped q (R, H, D) float32: the same bits as the formula in torch.
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor K, at::Tensor V,
                      const at::Tensor& slots, const at::Tensor& pos, int64_t H) {
  cagk::check_rope_write(qkv, cos, sin, K, V, slots, pos, H);
  const int64_t R = qkv.size(0), Hk = K.size(1), D = K.size(3);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  at::Tensor q = at::empty({R, H, D}, qkv.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  cagk::rope_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), R, H, Hk, D, K.size(2),
                  sl, ps, q.data_ptr<float>(), reinterpret_cast<uint16_t*>(K.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(V.data_ptr<at::BFloat16>()));
  return q;
}

}  // namespace

TORCH_LIBRARY(cag, m) {
  m.def("rms_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, Tensor slots, Tensor pos, int H) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("decode_attention_avx512(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale, Tensor? kt=None, Tensor? vt=None) -> Tensor");
  m.def("pair_kv(Tensor k, Tensor v) -> (Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
  m.def("rms_f32(Tensor x, Tensor w, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_avx512", decode_attention_avx512);
  m.impl("rms_bf16", rms_bf16);
  m.impl("pair_kv", pair_kv);
  m.impl("rope_write", rope_write);
  m.impl("silu_mul_bf16", silu_mul_bf16);
  m.impl("rms_f32", rms_f32);
}
