// What the AVX2 library's files share (arch/avx2/): one attention item (attention_item.cpp), run by the
// attention op (attention.cpp).
#pragma once
#include <cstdint>

#include "common/attention_plan.h"

namespace cagk {

// One item: each of `rows` query rows q[r] (D floats) over keys [0, w) of k, v (bf16 rows `stride` apart, w <=
// CHUNK): part[r] = (max, sum), acc[r] (D floats) = the unnormalized sum of e^(s_t - m) v_t. from, to (null: none):
// per row, the keys before from[r] (a sliding window's) and from to[r] on (a row shorter than the item) masked too,
// probability exactly 0 (common/attention_plan.h), so a row's bits are the same in an item of any w.
void item_avx2(const float* const* q, int64_t rows, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t w, int64_t D,
               float scale, Partial* part, float* const* acc, const int64_t* from = nullptr, const int64_t* to = nullptr);

}  // namespace cagk
