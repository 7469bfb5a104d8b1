// The AMX attention item (arch/amx/attention_item.cpp): compiled into the AVX-512 library (arch/avx512/), whose
// attention op `decode_attention` runs it (attention.cpp), where the compiler targets Intel AMX tiles for bf16
// (-march=native on a CPU with amx_tile and amx_bf16: CAG_AMX); elsewhere only its stubs, and the op refuses.
#pragma once
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <cstdint>

#include "common/attention_plan.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CAG_AMX 1
#endif

namespace cagk {

#ifdef CAG_AMX
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

// Whether Linux granted this process AMX tile state (asked once).
bool amx_permitted();

#ifdef CAG_AMX
// One item on AMX tiles: `rows` query rows (fp32, D floats at q[r]) over keys [0, w) whose K and V rows
// (bf16, D each) start at k and v, `stride` elements apart. Writes part[r] = (max score, probability
// sum) and acc[r] (D floats) = sum_t p_t V[t]; the probabilities are rounded to bf16 once and both the
// sum and the products use the rounded values. from, to: per row, its keys [from[r], to[r]) (softmax_block), or null.
void item_amx(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
              int64_t w, int64_t D, Scaling scale, Partial* part, float* const* acc, const int64_t* from = nullptr,
              const int64_t* to = nullptr);
#endif

}  // namespace cagk
