// One decoder layer of a decode step (one new token per request, int4 weights, float32 compute) in one
// parallel region, for cag/step.py.
//
// Why: the same layer as separate ops costs ~13 torch calls, 5 OpenMP regions and ~15 allocations;
// at ~4 us each that was ~2 ms of a ~6 ms step on a short prefix (2 cores). Here the threads stay in
// one region and meet at barriers: the products and the attention are split over them, and the small
// row work between (norm, rope, residual, silu) runs on thread 0 in microseconds.
//
// Same pieces, same order, same bits as the ops cag/step.py calls otherwise (rms_bf16, int4_mm,
// rope_write, decode_attention_avx512 over a pre-paired prefix, silu_mul_bf16, the float32 adds):
// tests/test_native.py checks the two ways give equal tensors.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>
#include <algorithm>
#include <vector>

#include "kernels.h"

namespace {

struct Int4 {  // a packed product: qw (N, K/2) uint8, dm (N, 2, K/32) float16 (cag.weights.pack_int4)
  const uint8_t* q;
  const uint16_t* d;
  int64_t N, K;
};

Int4 int4_of(const at::Tensor& qw, const at::Tensor& dm, int64_t K, const char* name) {
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.size(1) * 2 == K && K % 64 == 0 &&
              dm.dim() == 3 && dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.size(0) == qw.size(0) &&
              dm.size(1) == 2 && dm.size(2) == K / 32, name, ": int4 weights (N, K/2) uint8 and (N, 2, K/32) float16 for K inputs");
  return {qw.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), qw.size(0), K};
}

// Thread p of nt: its outputs of w, in whole blocks of 16, for the R rows prepared in xp, xs.
inline void share(const Int4& w, int64_t R, const uint16_t* xp, const float* xs, float* y, int64_t p, int64_t nt) {
  const int64_t blocks = (w.N + 15) / 16;
  const int64_t n0 = std::min(w.N, blocks * p / nt * 16), n1 = std::min(w.N, blocks * (p + 1) / nt * 16);
  cagk::int4_outputs(w.q, w.d, w.K, R, xp, xs, y, w.N, n0, n1);
}

// h (R, hidden) float32, updated in place: one row per request. w: the layer's [input norm (hidden,),
// q/k/v (stacked, int4 pair), o, post-attention norm, gate/up (stacked), down]; eps: the two norms'.
// cos, sin (R, D) as rope_write takes them; K, V (S, Hk, room, D) bf16 slots, row r's k/v written at
// [slot[r], :, pos[r]]; H query heads. prefix: [kp, vp, kt, vt] as decode_attention_avx512 takes them
// (pair_kv's kt, vt); slots, lens (R,): as it takes them; scale: 1/sqrt(D).
void decode_layer(at::Tensor h, at::TensorList w, at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor K, at::Tensor V, const at::Tensor& rows_slot, const at::Tensor& rows_pos, int64_t H,
                  at::TensorList prefix, const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h: (R, hidden) float32, contiguous");
  TORCH_CHECK(w.size() == 10 && eps.size() == 2 && prefix.size() == 4, "w: 10 tensors, eps: 2 values, prefix: kp, vp, kt, vt");
  TORCH_CHECK(K.dim() == 4 && K.scalar_type() == at::kBFloat16 && K.is_contiguous() && V.sizes() == K.sizes() &&
              V.scalar_type() == at::kBFloat16 && V.is_contiguous(), "K, V: (S, Hk, room, D) bfloat16, contiguous");
  const int64_t R = h.size(0), hid = h.size(1), Hk = K.size(1), D = K.size(3), room = K.size(2);
  TORCH_CHECK(H % Hk == 0 && D % 32 == 0, "query heads a multiple of K/V heads, head dim a multiple of 32");
  for (int j : {0, 5})
    TORCH_CHECK(w[j].dim() == 1 && w[j].scalar_type() == at::kFloat && w[j].is_contiguous() && w[j].size(0) == hid, "norm weights: (hidden,) float32");
  const Int4 qkv = int4_of(w[1], w[2], hid, "q/k/v"), o = int4_of(w[3], w[4], H * D, "o"),
             gu = int4_of(w[6], w[7], hid, "gate/up");
  TORCH_CHECK(qkv.N == (H + 2 * Hk) * D && o.N == hid && gu.N % 2 == 0, "q/k/v, o or gate/up widths disagree with the heads");
  const int64_t I = gu.N / 2;
  const Int4 dn = int4_of(w[8], w[9], I, "down");
  TORCH_CHECK(dn.N == hid, "down's width is not the hidden size");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R * D, "cos, sin: (R, D) float32");
  for (const at::Tensor* t : {&rows_slot, &rows_pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == R, "rows_slot, rows_pos: (R,) int64");
  const int64_t* sl = rows_slot.data_ptr<int64_t>();
  const int64_t* ps = rows_pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; r++)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < K.size(0) && ps[r] >= 0 && ps[r] < room, "slot or position outside the buffers");

  const int64_t wide = std::max({hid, H * D, I});  // the widest product input
  std::vector<uint16_t> xb(R * wide), xp(R * wide);   // a product's input in bf16, and as the kernel reads it
  std::vector<float> xs(R * wide / 32), yqkv(R * qkv.N), q(R * H * D), att(R * H * D), yo(R * hid), ygu(R * gu.N), ydn(R * hid);
  // checked here, on the calling thread: nothing may throw inside the region
  cagk::Attention a(q.data(), R, Hk, H / Hk, D, prefix[0], prefix[1], K, V, slots, lens, scale, prefix[2], prefix[3], false);
  float* hd = h.data_ptr<float>();
  const float *w1 = w[0].data_ptr<float>(), *w2 = w[5].data_ptr<float>();
  uint16_t* kd = reinterpret_cast<uint16_t*>(K.data_ptr<at::BFloat16>());
  uint16_t* vd = reinterpret_cast<uint16_t*>(V.data_ptr<at::BFloat16>());
  const float *cd = cos.data_ptr<float>(), *sd = sin.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());

#pragma omp parallel num_threads(threads)
  {
    const int64_t p = omp_get_thread_num(), nt = omp_get_num_threads();
    if (p == 0) {
      cagk::rms_rows(hd, w1, R, hid, (float)eps[0], xb.data());
      cagk::int4_prepare(xb.data(), R, hid, xp.data(), xs.data());
    }
#pragma omp barrier
    share(qkv, R, xp.data(), xs.data(), yqkv.data(), p, nt);
#pragma omp barrier
    if (p == 0) cagk::rope_rows(yqkv.data(), qkv.N, cd, sd, R, H, Hk, D, room, sl, ps, q.data(), kd, vd);
#pragma omp barrier
    a.work<false>(p, nt);
#pragma omp barrier
    if (p == 0) {
      a.merge(att.data());  // (R, Hk, H/Hk, D) = (R, H D), head-major as o_proj reads it
      cagk::to_bf16(att.data(), R * H * D, xb.data());
      cagk::int4_prepare(xb.data(), R, H * D, xp.data(), xs.data());
    }
#pragma omp barrier
    share(o, R, xp.data(), xs.data(), yo.data(), p, nt);
#pragma omp barrier
    if (p == 0) {
      for (int64_t j = 0; j < R * hid; j++) hd[j] = hd[j] + yo[j];
      cagk::rms_rows(hd, w2, R, hid, (float)eps[1], xb.data());
      cagk::int4_prepare(xb.data(), R, hid, xp.data(), xs.data());
    }
#pragma omp barrier
    share(gu, R, xp.data(), xs.data(), ygu.data(), p, nt);
#pragma omp barrier
    if (p == 0) {
      cagk::silu_mul_rows(ygu.data(), R, I, xb.data());
      cagk::int4_prepare(xb.data(), R, I, xp.data(), xs.data());
    }
#pragma omp barrier
    share(dn, R, xp.data(), xs.data(), ydn.data(), p, nt);
#pragma omp barrier
    if (p == 0)
      for (int64_t j = 0; j < R * hid; j++) hd[j] = hd[j] + ydn[j];
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag, m) {
  m.def("decode_layer(Tensor(a!) h, Tensor[] w, float[] eps, Tensor cos, Tensor sin, Tensor(b!) K, Tensor(c!) V, "
        "Tensor rows_slot, Tensor rows_pos, int H, Tensor[] prefix, Tensor slots, Tensor lens, float scale) -> ()");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("decode_layer", decode_layer);
}
