// What the AVX-512 library's files share (arch/avx512/, with arch/amx/ compiled in): the pieces of a decode
// step that layer.cpp runs inside one parallel region (each piece also serves its own op in the file that
// defines it, with the same bits), and the attention items attention.cpp runs.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <optional>
#include <vector>

#include "common/attention_plan.h"

namespace cagk {

// products.cpp. int4: x (M, K) bf16 -> per row and group of 32 its int8 codes qx (M, K), scale dx (M, K/32) and
// code sum sx (M, K/32); then outputs [n0, n1) (n0 a multiple of 16) of y (M, N) float32 from qw (N16, K/32, 256),
// dm (S, K/32, N) (cag.model.layouts.pack_int4_native).
void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sx);
void int4_outputs(const uint8_t* qw, const uint16_t* dm, int64_t K, int64_t M, const int8_t* qx, const float* dx,
                  const int32_t* sx, float* y, int64_t N, int64_t n0, int64_t n1, int64_t S);
// bf16: outputs [n0, n1) of y (M, N) float32 from w (N, K) bf16 and x (M, K) bf16.
void bf16_outputs(const uint16_t* w, int64_t K, int64_t M, const uint16_t* x, float* y, int64_t N, int64_t n0, int64_t n1);

// step.cpp: the step's glue, row by row.
// LlamaRMSNorm of x (R, N) float32 with weight w, rounded once to bf16 (rms_bf16).
void rms_rows(const float* x, const float* w, int64_t R, int64_t N, float eps, uint16_t* out);
// The same norm in place over R rows of N floats, ld apart, not rounded (rms_f32): q/k norms, post-norms.
void rms_rows_f32(float* x, int64_t ld, const float* w, int64_t R, int64_t N, float eps);
// rope on q and k of qkv (R, (H + 2 Hk) D), q to q (R, H, D) float32, k and v as bf16 into K, V (S, Hk,
// room, D) at [slot[r], :, pos[r]] (rope_write).
void rope_rows(const float* qkv, int64_t ld, const float* cos, const float* sin, int64_t R, int64_t H, int64_t Hk,
               int64_t D, int64_t room, const int64_t* slot, const int64_t* pos, float* q, uint16_t* K, uint16_t* V);
// silu(g) * u of gu (R, 2 I) = [g | u] per row, rounded to bf16 into y (R, I) (silu_mul_bf16).
void silu_mul_rows(const float* gu, int64_t R, int64_t I, uint16_t* y);
// float32 -> bf16 rounded to nearest even, NaN to 0x7FC0: torch's conversion, bit for bit.
void to_bf16(const float* x, int64_t n, uint16_t* y);

// attention_item.cpp: the softmax of nr rows of scores s (rows CHUNK apart, keys [0, w) of wp, w <= wp <= CHUNK,
// wp a multiple of 64), keys past w masked: the probabilities rounded to bf16 into pb (rows CHUNK apart), and
// part[r] = (max, sum of the rounded values). Scores are scaled first (Scaling: times scale, then the soft cap
// where set). `from`, `to` (null: none):
// per row, the keys before from[r] (a sliding window's) and from to[r] on (a shorter row's) masked too, probability
// exactly 0 (common/attention_plan.h; from[r] < to[r] <= w).
void softmax_block(float* s, uint16_t* pb, int64_t nr, int64_t w, int64_t wp, Scaling scale, Partial* part,
                   const int64_t* from = nullptr, const int64_t* to = nullptr);

// attention_item.cpp: one item by AVX512-BF16 dot products: `rows` query rows (fp32, D floats at q[r]) over keys
// [0, w) whose K and V rows (bf16, D each) start at k and v, `stride` elements apart; part[r] = (max score,
// probability sum), acc[r] (D floats) = sum_t p_t V[t]. kpre, vpre: the item's K and V as pair_kv gives them (then
// read in place of k's and v's rows); nk, nv (nkb, nvb bytes): the item this thread takes next, to prefetch.
// from, to: per row, its keys [from[r], to[r]) (softmax_block), or null.
void item_avx512(const float* const* q, int64_t rows, const at::BFloat16* k, const at::BFloat16* v, int64_t stride,
                 int64_t w, int64_t D, Scaling scale, Partial* part, float* const* acc, const int64_t* from = nullptr,
                 const int64_t* to = nullptr, const uint32_t* kpre = nullptr, const uint32_t* vpre = nullptr,
                 const char* nk = nullptr, int64_t nkb = 0, const char* nv = nullptr, int64_t nvb = 0);

// int8_attention.cpp: a prefix item over int8 codes (pair_kv8's layout; kc, vc the item's bytes), the
// unnormalized sum of p_t V_t per row into acc[r] (D floats) and (max, sum) into part[r]; nk, nv: the
// bytes of the item this thread takes next (to prefetch) or null.
void item_int8(const float* const* q, int64_t rows, const uint8_t* kc, const uint8_t* vc, int64_t w, int64_t D, Scaling scale,
               Partial* part, float* const* acc, const char* nk, const char* nv, const int64_t* from = nullptr);
// An int8 item's K (or V: the same size) bytes in pair_kv8's layout: CHUNK keys' codes, then their float16
// scales per block (int8_blocks).
constexpr int64_t int8_item_bytes(int64_t D) { return D * CHUNK + int8_blocks(D) * CHUNK * 2; }

// attention.cpp: one decode attention call (decode_attention_avx512's, or decode_attention's on AMX tiles): checked
// and laid out by the constructor (its items: common/attention_plan.h), its items run by `work(p, nt)` on each of nt
// threads (items p, p + nt, ...), merged by `merge`. q is read when the items run, so it may be filled after construction.
struct Attention : AttentionPlan {
  Attention(const float* q, int64_t B, int64_t H, int64_t R, int64_t D, const at::Tensor& kp, const at::Tensor& vp,
            const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
            const std::optional<at::Tensor>& kt, const std::optional<at::Tensor>& vt, bool amx, int64_t window = 0,
            double softcap = 0);
  template <bool AMX> void work(int64_t p, int64_t nt);
  void merge(float* out) const;  // (B, H, R, D) float32

  const float* qd;
  at::Tensor kp, vp, ks, vs;
  Scaling scale;  // and Gemma 2's soft cap on the scores, where set
  const uint32_t *ktd = nullptr, *vtd = nullptr;  // a bf16 prefix pre-paired (pair_kv)
  const uint8_t *k8 = nullptr, *v8 = nullptr;     // or an int8 prefix (pair_kv8): kp, vp then give its shape only
  std::vector<Partial> part;
  std::vector<float> acc;
};

}  // namespace cagk
