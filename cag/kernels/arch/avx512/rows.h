// How the AVX-512 products (products.cpp, int4_many.cpp) block a call's rows and sum their lanes. Every row
// runs the same sequence of operations in a block of any size, so its bits do not depend on how many rows
// the call has or which thread takes its outputs.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int MB = 8;  // rows held in registers at a time (a call of more rows runs blocks of MB, then the rest)
// int4's: a block's rows of x are read again for every output, and 8 rows of 3,072 inputs (48 KiB) do not
// stay in L1 where 4 (24 KiB) do (bench/JOURNAL.md, 2026-12-04).
constexpr int MB4 = 4;
// From this many rows a call's int4 products unpack each block of weights once for many rows (int4_many.cpp)
constexpr int64_t MANY = 16;

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

// Outputs taken together: one for a single row (a decode step reads the weights as one stream; several
// weight rows read side by side were slower), 4 for several (a question's rows: each unpack and x load
// serves more dot products).
template <int NR>
constexpr int int4_outs() { return NR == 1 ? 1 : 4; }

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
