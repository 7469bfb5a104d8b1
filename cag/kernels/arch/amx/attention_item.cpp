// Decode attention's item on Intel AMX tiles (CAG_DECODE_KERNELS=amx), part of the AVX-512 library: the same
// items, softmax and merge as the AVX512-BF16 item (arch/avx512/attention_item.cpp, whose helpers it shares:
// arch/avx512/items.h), the scores and values as tile products of bf16 pairs with float32 sums. The two
// differ in the last bits. Compiled to its stubs where the compiler does not target AMX (amx/kernels.h).
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>

#include "arch/amx/kernels.h"
#include "arch/avx512/items.h"
#include "arch/avx512/kernels.h"

namespace cagk {

bool amx_permitted() {  // Linux hands out AMX tile state on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

#ifdef CAG_AMX
void item_amx(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
              int64_t w, int64_t D, Scaling scale, Partial* part, float* const* acc, const int64_t* from,
              const int64_t* to) {
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
      _tile_stored(0, s + b * 16, CHUNK * 4);
    }
    softmax_block(s, pb, nr, w, wp, scale, part + r0, from ? from + r0 : nullptr, to ? to + r0 : nullptr);
    for (int64_t r = nr; r < 16; r++) std::memset(pb + r * CHUNK, 0, wp * 2);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // values: 16 rows x 64 dims (t4-t7), keys in steps of 32
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t t = 0; t < wp; t += 32) {
        _tile_loadd(1, pb + t, CHUNK * 2);
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

}  // namespace cagk
