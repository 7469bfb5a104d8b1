// What the decode attention of every instruction set shares (arch/*/attention.cpp): the head widths, the
// items a call's keys are cut into and the order in which their partial results merge. No intrinsics here.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace cagk {

constexpr int64_t CHUNK = 256;  // keys per attention item: its K and V stay in L2
constexpr int64_t MAXD = 256;   // the widest head
// The head widths the attention kernels are compiled for (each a template instance: accumulators in registers).
// A width of 32 g + 16 (80) takes its last 16 dims as a half group (masked loads, no lane past the row).
constexpr bool head_dim_ok(int64_t D) { return D == 64 || D == 80 || D == 96 || D == 128 || D == 256; }
// The int8 prefix (arch/avx512/int8_attention.cpp) takes the same widths and reads the snapshot's blocks as
// store/kv_int8.py makes them: of 32 along D, or one a head where D is not a multiple of 32 (80: 80 codes and
// one scale per key, per K and per V).
constexpr int64_t int8_blocks(int64_t D) { return D % 32 == 0 ? D / 32 : 1; }  // per key (kv_int8.block_for)

// An item's result for one row: its max score m and the sum l of its probabilities.
struct Partial { float m, l; };

// One call's work: q (B, H, R, D) (request b, K/V head h, row r: the query heads sharing h) over a prefix of n
// keys the requests share and request b's own suffix of len[b] keys in slot slot[b]. Keys go in items of CHUNK:
// the prefix items (h, c) first, for the rows of every request on them, then the suffix items (b, h, c), for one
// request's rows; `most` is the longest suffix's count of items. Each item leaves per row a Partial and the
// unnormalized sum of p_t v_t, at index `at(b, h, r, c)` (c: prefix chunks, then suffix chunks).
struct AttentionPlan {
  void lay_out(int64_t B_, int64_t H_, int64_t R_, int64_t D_, int64_t n_, int64_t most_, const int64_t* slot_,
               const int64_t* len_) {
    B = B_, H = H_, R = R_, D = D_, n = n_, most = most_, slot = slot_, len = len_;
    np = (n + CHUNK - 1) / CHUNK, chunks = np + most;  // per row: prefix chunks, then suffix chunks
    items.clear();
    for (int64_t h = 0; h < H; h++)
      for (int64_t c = 0; c < np; c++) items.push_back(h * np + c);
    n_pre = (int64_t)items.size();
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c < (len[b] + CHUNK - 1) / CHUNK; c++) items.push_back((b * H + h) * most + c);
  }
  int64_t at(int64_t b, int64_t h, int64_t r, int64_t c) const { return ((b * H + h) * R + r) * chunks + c; }
  int64_t row_chunks(int64_t b) const { return np + (len[b] + CHUNK - 1) / CHUNK; }  // a row of request b's items

  int64_t B = 0, H = 0, R = 0, D = 0, n = 0, np = 0, most = 0, chunks = 0, n_pre = 0;
  const int64_t *slot = nullptr, *len = nullptr;
  std::vector<int64_t> items;  // prefix items (h, c), then suffix items (b, h, c)
};

// The merge's weights for one row's kn partials, in chunk order: ev[c] = e^(m_c - m), m the largest m_c; returns
// the probability sum l = sum_c l_c ev[c]. The row's output is then sum_c ev[c] acc_c / l (arch/*/attention.cpp).
inline float merge_weights(const Partial* part, int64_t kn, float* ev) {
  float m = -INFINITY, l = 0.f;
  for (int64_t c = 0; c < kn; c++) m = std::max(m, part[c].m);
  for (int64_t c = 0; c < kn; c++) { ev[c] = std::exp(part[c].m - m); l += part[c].l * ev[c]; }
  return l;
}

}  // namespace cagk
