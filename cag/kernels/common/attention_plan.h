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

// How a row's raw scores q.k become the softmax's input: times `scale`, then, where `cap` is set (Gemma 2's
// attention logit soft-capping), cap * tanh(x / cap), elementwise (a score's value depends on itself alone).
struct Scaling {
  float scale, cap = 0.0f;
  Scaling(float s, float c = 0.0f) : scale(s), cap(c) {}  // NOLINT: a plain scale converts implicitly
};

// A suffix item: rows b0 .. b0 + nb - 1 (one request's, or consecutive requests reading one slot, as a knowledge
// prefill's decode rows do), K/V head h, suffix chunk c. Its rows share its K/V reads (and on AVX-512 its pairing
// of K) and each row's sums run as they would alone: an item reads keys [0, w) of its chunk, w its longest row's
// count, and a row's keys past its own count (`to`: the chunk on the diagonal, where row t sees t + 1 keys) score
// -inf, so their probabilities are exactly 0 and they add exact zeros to the row's sums: the bits of the row alone.
struct SuffixItem { int64_t b0, nb, h, c; };

// One call's work: q (B, H, R, D) (request b, K/V head h, row r: the query heads sharing h) over a prefix of n
// keys the requests share and request b's own suffix of len[b] keys in slot slot[b]. Keys go in items of CHUNK:
// the prefix items (h, c) first, for the rows of every request on them, then the suffix items (SuffixItem), run
// by run of consecutive requests on one slot, per head and chunk; `most` is the longest suffix's count of items.
// Each item leaves per row a Partial and the unnormalized sum of p_t v_t, at index `at(b, h, r, c)` (c: prefix
// chunks, then suffix chunks).
// A sliding window W (a window layer: cag/model/windows.py) hides from request b's row, at absolute position
// n + len[b] - 1, every key before lo[b] = n + len[b] - W (prefix key j at j, suffix key t at n + t): an item
// wholly before a row's lo leaves that row out (and an item before every row's lo is not laid out), and inside
// an item the keys before lo score -inf (`from`), probability exactly 0. Which keys a row reads and how its
// chunks merge depend on its position alone, so the window keeps a row's bits independent of its neighbours.
struct AttentionPlan {
  static constexpr int64_t GROUP = 64;  // rows of one slot an item takes at most (items stay many for the threads)

  // `partial`: rows that read part of a chunk (the diagonal) join its item too, where sharing the item's K
  // pairing pays for their masked keys (AVX-512, AMX); else only rows that read all of it share an item (AVX2,
  // whose items pair nothing: measured 0.88x at 256 rows over 256 keys with them)
  void lay_out(int64_t B_, int64_t H_, int64_t R_, int64_t D_, int64_t n_, int64_t most_, const int64_t* slot_,
               const int64_t* len_, int64_t window = 0, bool partial = true) {
    B = B_, H = H_, R = R_, D = D_, n = n_, most = most_, slot = slot_, len = len_;
    np = (n + CHUNK - 1) / CHUNK, chunks = np + most;  // per row: prefix chunks, then suffix chunks
    lo.assign(B, 0);
    int64_t low = 0;  // the lowest lo: prefix chunks wholly before it are read by no row
    for (int64_t b = 0; b < B; b++) {
      if (window > 0) lo[b] = std::max<int64_t>(0, n + len[b] - window);
      low = b == 0 ? lo[b] : std::min(low, lo[b]);
    }
    items.clear();
    suffix.clear();
    for (int64_t h = 0; h < H; h++)
      for (int64_t c = low / CHUNK; c < np; c++) items.push_back(h * np + c);
    n_pre = (int64_t)items.size();
    for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {  // runs [b0, b1) of requests on one slot
      int64_t top = 0;
      for (b1 = b0; b1 < B && slot[b1] == slot[b0]; b1++) top = std::max(top, len[b1]);
      for (int64_t h = 0; h < H; h++)
        for (int64_t c = 0; c * CHUNK < top; c++)
          for (int64_t b = b0; b < b1;) {
            if (!sees(b, c)) { b++; continue; }  // no key of this chunk
            int64_t e = b + 1;  // rows reading keys of the chunk (all of them: `partial` off) go together, up to GROUP
            if (partial || whole(b, c))
              while (e < b1 && e - b < GROUP && (partial ? sees(e, c) : whole(e, c))) e++;
            suffix.push_back({b, e - b, h, c});
            b = e;
          }
    }
  }
  int64_t at(int64_t b, int64_t h, int64_t r, int64_t c) const { return ((b * H + h) * R + r) * chunks + c; }
  // request b's row reads its chunks first_chunk(b) .. row_chunks(b) - 1 (prefix chunks, then suffix chunks)
  int64_t row_chunks(int64_t b) const { return np + (len[b] + CHUNK - 1) / CHUNK; }
  int64_t first_chunk(int64_t b) const { return lo[b] < n ? lo[b] / CHUNK : np + (lo[b] - n) / CHUNK; }
  int64_t items_n() const { return n_pre + (int64_t)suffix.size(); }
  // whether request b's row reads keys of prefix chunk c; of suffix chunk c (some of them; all of them)
  bool sees_prefix(int64_t b, int64_t c) const { return lo[b] < std::min(n, (c + 1) * CHUNK); }
  bool sees(int64_t b, int64_t c) const { return len[b] > c * CHUNK && lo[b] < n + (c + 1) * CHUNK; }
  bool whole(int64_t b, int64_t c) const { return len[b] >= (c + 1) * CHUNK && lo[b] <= n + c * CHUNK; }
  // the keys request b's row reads of its suffix chunk c: [from, to(b, c)) of the chunk's C
  int64_t to(int64_t b, int64_t c) const { return std::min(CHUNK, len[b] - c * CHUNK); }
  // the first key request b's row reads in an item whose first key is at absolute position t0 (0: all of them)
  int64_t from(int64_t b, int64_t t0) const { return std::max<int64_t>(0, lo[b] - t0); }

  // The rows of prefix item i (head h, chunk c: every request's that reads it): per row its query (q (B, H, R, D)),
  // its accumulator (acc: D floats at each at()), its first key and its request. Returns their count.
  int64_t prefix_rows(int64_t i, const float* q, float* acc, const float** qs, float** accs, int64_t* fr,
                      int64_t* who) const {
    const int64_t h = items[i] / np, c = items[i] % np;
    int64_t nr = 0;
    for (int64_t b = 0; b < B; b++)
      for (int64_t r = 0; r < R && sees_prefix(b, c); r++, nr++) {
        qs[nr] = q + ((b * H + h) * R + r) * D;
        accs[nr] = acc + at(b, h, r, c) * D;
        fr[nr] = from(b, c * CHUNK), who[nr] = b;
      }
    return nr;
  }
  // The nb R rows of suffix item `it` (row r of request b0 + j / R at j): their queries, accumulators and keys
  // [fr, to) of the chunk. Returns the item's width: its longest row's keys.
  int64_t suffix_rows(const SuffixItem& it, const float* q, float* acc, const float** qs, float** accs, int64_t* fr,
                      int64_t* to_) const {
    int64_t w = 0;
    for (int64_t j = 0; j < it.nb * R; j++) {
      const int64_t b = it.b0 + j / R;
      qs[j] = q + ((b * H + it.h) * R + j % R) * D;
      accs[j] = acc + at(b, it.h, j % R, np + it.c) * D;
      fr[j] = from(b, n + it.c * CHUNK), to_[j] = to(b, it.c), w = std::max(w, to_[j]);
    }
    return w;
  }

  int64_t B = 0, H = 0, R = 0, D = 0, n = 0, np = 0, most = 0, chunks = 0, n_pre = 0;
  const int64_t *slot = nullptr, *len = nullptr;
  std::vector<int64_t> lo;  // per request: its row's first visible key (0 without a window)
  std::vector<int64_t> items;  // prefix items (h, c): h * np + c
  std::vector<SuffixItem> suffix;  // then these, item n_pre + j being suffix[j]
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
