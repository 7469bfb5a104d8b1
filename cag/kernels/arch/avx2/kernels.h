// What the AVX2 library's files share (arch/avx2/): one attention item (attention_item.cpp), run by the
// attention (attention.cpp), and the pieces of a decode step that layer.cpp runs inside one parallel region (each
// piece also serves its own op in the file that defines it, with the same bits).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

#include "common/attention_plan.h"

namespace cagk {

// One item: each of `rows` query rows q[r] (D floats) over keys [0, w) of k, v (bf16 rows `stride` apart, w <=
// CHUNK): part[r] = (max, sum), acc[r] (D floats) = the unnormalized sum of e^(s_t - m) v_t. from, to (null: none):
// per row, the keys before from[r] (a sliding window's) and from to[r] on (a row shorter than the item) masked too,
// probability exactly 0 (common/attention_plan.h), so a row's bits are the same in an item of any w.
void item_avx2(const float* const* q, int64_t rows, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t w, int64_t D,
               Scaling scale, Partial* part, float* const* acc, const int64_t* from = nullptr, const int64_t* to = nullptr);

}  // namespace cagk

namespace cagk::avx2 {

// products.cpp. int4: x (M, K) bf16 -> per row and group of 32 its int8 codes qx (M, K), scale dx (M, K/32) and
// code sum sx (M, K/32); then outputs [n0, n1) (n0 a multiple of 8) of y (M, N) float32 from qw (N16, K/32, 256),
// dm (S, K/32, N) (cag.model.layouts.pack_int4_native).
void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx);
void int4_outputs(const uint8_t* qw, const uint16_t* dm, int64_t K, int64_t M, const int8_t* qx, const float* dx,
                  const int32_t* sx, float* y, int64_t N, int64_t n0, int64_t n1, int64_t S);

// step.cpp: the step's glue, row by row (the ops rms_bf16, rms_f32, rope_write, silu_mul_bf16 run these).
// LlamaRMSNorm of x (R, N) float32 with weight w, rounded once to bf16.
void rms_rows(const float* x, const float* w, int64_t R, int64_t N, float eps, uint16_t* out);
// The same norm in place over R rows of N floats, ld apart, not rounded: q/k norms, post-norms.
void rms_rows_f32(float* x, int64_t ld, const float* w, int64_t R, int64_t N, float eps);
// rope on q and k of qkv (R, (H + 2 Hk) D, rows ld apart), q to q (R, H, D) float32, k and v as bf16 into K, V
// (S, Hk, room, D) at [slot[r], :, pos[r]].
void rope_rows(const float* qkv, int64_t ld, const float* cos, const float* sin, int64_t R, int64_t H, int64_t Hk,
               int64_t D, int64_t room, const int64_t* slot, const int64_t* pos, float* q, uint16_t* K, uint16_t* V);
// silu(g) * u of gu (R, 2 I) = [g | u] per row, rounded to bf16 into y (R, I).
void silu_mul_rows(const float* gu, int64_t R, int64_t I, uint16_t* y);
// float32 -> bf16 as torch rounds (to nearest even, NaN to 0x7FC0).
void to_bf16(const float* x, int64_t n, uint16_t* y);

// attention.cpp: one decode attention call (the op decode_attention's): checked and laid out by the constructor
// (its items: common/attention_plan.h), its items run by `work(p, nt)` on each of nt threads (items p, p + nt,
// ...), merged by `merge`. q is read when the items run, so it may be filled after construction.
struct Attention : AttentionPlan {
  Attention(const float* q, int64_t B, int64_t H, int64_t R, int64_t D, const at::Tensor& kp, const at::Tensor& vp,
            const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
            int64_t window = 0, double softcap = 0);
  void work(int64_t p, int64_t nt);
  void merge(float* out) const;  // (B, H, R, D) float32

  const float* qd;
  at::Tensor kp, vp, ks, vs;
  Scaling scale;  // and Gemma 2's soft cap on the scores, where set
  std::vector<Partial> part;
  std::vector<float> acc;
};

}  // namespace cagk::avx2
