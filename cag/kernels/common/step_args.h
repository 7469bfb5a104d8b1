// What the step's glue and decode attention share in both libraries (arch/avx512/ and arch/avx2/: step.cpp,
// attention.cpp): their arguments' checks, so the two ops of a name refuse the same inputs alike.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <cstdint>

#include "attention_plan.h"

namespace cagk {

// rms_bf16: x (R, N) float32, contiguous; w (N,) float32.
inline void check_rms_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: (R, N) float32, contiguous");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1), "w: (N,) float32");
}

// rms_f32: x (..., N) float32; w (N,) float32. Returns N.
inline int64_t check_rms_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "x: (..., N) float32");
  const int64_t N = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == N, "w: (N,) float32");
  return N;
}

// silu_mul_bf16: gu (R, 2 I) float32, contiguous.
inline void check_silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gu: (R, 2 I) float32, contiguous");
}

// rope_write: qkv (R, (H + 2 Hk) D) float32 rows; K, V (S, Hk, room, D) bf16; cos, sin (R, D) float32;
// slots, pos (R,) int64 inside the buffers; heads a multiple of 16 wide.
inline void check_rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& K,
                             const at::Tensor& V, const at::Tensor& slots, const at::Tensor& pos, int64_t H) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1, "qkv: (R, (H + 2 Hk) D) float32");
  TORCH_CHECK(K.dim() == 4 && K.scalar_type() == at::kBFloat16 && K.is_contiguous() && V.sizes() == K.sizes() &&
              V.scalar_type() == at::kBFloat16 && V.is_contiguous(), "K, V: (S, Hk, room, D) bfloat16, contiguous");
  const int64_t R = qkv.size(0), Hk = K.size(1), D = K.size(3);
  TORCH_CHECK(D % 16 == 0 && qkv.size(1) == (H + 2 * Hk) * D, "qkv width and heads disagree (heads a multiple of 16 wide)");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.numel() == R * D && sin.numel() == R * D, "cos, sin: (R, D) float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && slots.numel() == R && pos.numel() == R &&
              slots.is_contiguous() && pos.is_contiguous(), "slots, pos: (R,) int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; r++)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < K.size(0) && ps[r] >= 0 && ps[r] < K.size(2), "slot or position outside the buffers");
}

// decode attention's queries: q (B, H, R, D) float32, contiguous.
inline void check_attention_q(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: (B, H, R, D) float32, contiguous");
}

// decode attention: kp, vp (H, n, D) and ks, vs (S, H, room, D) bf16 with contiguous rows (pair-aligned where
// `pairs`: the AVX-512 kernel reads two keys' dims together); slots, lens (B,) int64, each request's suffix
// inside the slots. Returns the CHUNK-key items of the longest suffix.
inline int64_t check_attention(int64_t B, int64_t H, int64_t D, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& ks,
                               const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, bool pairs) {
  TORCH_CHECK(kp.dim() == 3 && vp.dim() == 3 && ks.dim() == 4 && vs.dim() == 4, "K/V: (H, n, D) prefix and (S, H, room, D) slots");
  TORCH_CHECK(head_dim_ok(D), "head dim 64, 80, 96, 128 or 256");
  for (const at::Tensor* t : {&kp, &vp, &ks, &vs})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(-1) == 1 && (!pairs || t->stride(-2) % 2 == 0) && t->size(-1) == D &&
                t->size(-3) == H, "K/V: bfloat16, H heads of D, rows contiguous");
  TORCH_CHECK(vp.size(1) == kp.size(1) && vs.size(2) == ks.size(2) && vs.size(0) == ks.size(0), "K and V shapes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && slots.numel() == B && lens.numel() == B &&
              slots.is_contiguous() && lens.is_contiguous(), "slots, lens: (B,) int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= ks.size(2) && slot[b] >= 0 && slot[b] < ks.size(0), "suffix outside the slots");
    most = std::max(most, (len[b] + CHUNK - 1) / CHUNK);
  }
  return most;
}

}  // namespace cagk
