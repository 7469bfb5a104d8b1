// Decode attention on CPUs with AVX2, FMA and F16C (arch/avx2/): the query rows of each request (one new
// token: its heads that share a K/V head) over the prefix the requests share and each request's own suffix, in
// one call, with the signature of the main library's `decode_attention` (arch/avx512/attention.cpp).
//
// Work: keys in items of C (a prefix chunk for the rows of every request on it, or a suffix chunk for one
// request's rows, or for rows of one slot that all read the whole chunk: common/attention_plan.h),
// spread over torch's threads; each item (attention_item.cpp) leaves
// per row its max score m, its sum l of e^(s - m) and sum_t e^(s_t - m) v_t, merged per row in chunk order. A
// row's result depends on its own query and keys only, in a fixed order of operations: a request's bits never
// depend on its neighbours or on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "arch/avx2/kernels.h"
#include "common/step_args.h"

namespace {

constexpr int64_t C = cagk::CHUNK;
using cagk::Partial;

}  // namespace

namespace cagk::avx2 {

// q (B, H, R, D) float32: request b, K/V head h, row r (the query heads sharing h); kp, vp (H, n, D) bf16:
// the prefix the requests share (n may be 0); ks, vs (S, H, room, D) bf16: the request slots; slots (B,),
// lens (B,) int64: request b reads keys [0, lens[b]) of slot slots[b]; window: a sliding window's W (each row
// reads its last W keys: common/attention_plan.h), 0 for none; softcap: Gemma 2's soft cap on the scores
// (common/attention_plan.h's Scaling), 0 for none.
Attention::Attention(const float* q, int64_t B, int64_t H, int64_t R, int64_t D, const at::Tensor& kp_,
                     const at::Tensor& vp_, const at::Tensor& ks_, const at::Tensor& vs_, const at::Tensor& slots,
                     const at::Tensor& lens, double scale_, int64_t window, double softcap)
    : qd(q), kp(kp_), vp(vp_), ks(ks_), vs(vs_), scale((float)scale_, (float)softcap) {
  const int64_t most_ = cagk::check_attention(B, H, D, kp, vp, ks, vs, slots, lens, false);  // suffix chunks of the longest suffix
  TORCH_CHECK(window >= 0, "window: 0 (none) or a sliding window's width");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap: 0 (none) or a soft cap on the scores");
  lay_out(B, H, R, D, kp.size(1), most_, slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), window, false);
  part.resize(B * H * R * chunks);
  acc.resize(B * H * R * chunks * D);
}

void Attention::work(int64_t p, int64_t nt) {
  std::vector<const float*> qs(B * R);
  std::vector<float*> accs(B * R);
  std::vector<Partial> ps(B * R);
  std::vector<int64_t> fr(B * R), who(B * R), to_(B * R);  // per row of an item: its keys [fr, to), its request
  const uint16_t* kpd = reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>());
  const uint16_t* vpd = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>());
  const uint16_t* ksd = reinterpret_cast<const uint16_t*>(ks.data_ptr<at::BFloat16>());
  const uint16_t* vsd = reinterpret_cast<const uint16_t*>(vs.data_ptr<at::BFloat16>());
  const int64_t n_items = items_n();
  for (int64_t i = p; i < n_items; i += nt) {  // share p takes items p, p + nt, ...: prefix and suffix spread evenly
    if (i < n_pre) {  // a prefix chunk: the rows of every request that reads it (all without a window)
      const int64_t h = items[i] / np, c = items[i] % np, t0 = c * C;
      const int64_t nr = prefix_rows(i, qd, acc.data(), qs.data(), accs.data(), fr.data(), who.data());
      item_avx2(qs.data(), nr, kpd + h * kp.stride(0) + t0 * kp.stride(1), vpd + h * vp.stride(0) + t0 * vp.stride(1),
                kp.stride(1), std::min(C, n - t0), D, scale, ps.data(), accs.data(), fr.data());
      for (int64_t j = 0; j < nr; j++) part[at(who[j], h, j % R, c)] = ps[j];
    } else {  // a suffix chunk: one request's rows, or several on one slot that read all its keys
      const SuffixItem& it = suffix[i - n_pre];
      const int64_t b0 = it.b0, nb = it.nb, h = it.h, c = it.c, t0 = c * C;
      const int64_t w = suffix_rows(it, qd, acc.data(), qs.data(), accs.data(), fr.data(), to_.data());
      const int64_t off_k = slot[b0] * ks.stride(0) + h * ks.stride(1) + t0 * ks.stride(2);
      const int64_t off_v = slot[b0] * vs.stride(0) + h * vs.stride(1) + t0 * vs.stride(2);
      item_avx2(qs.data(), nb * R, ksd + off_k, vsd + off_v, ks.stride(2), w, D, scale, ps.data(), accs.data(), fr.data(),
                to_.data());
      for (int64_t j = 0; j < nb * R; j++) part[at(b0 + j / R, h, j % R, np + c)] = ps[j];
    }
  }
}

void Attention::merge(float* od) const {
  std::vector<float> ev(chunks);
  for (int64_t b = 0; b < B; b++)  // each row's chunks merged in a fixed order: prefix, then suffix
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++) {
        const int64_t k0 = at(b, h, r, first_chunk(b)), kn = row_chunks(b) - first_chunk(b);
        const float l = merge_weights(part.data() + k0, kn, ev.data());
        float* dst = od + ((b * H + h) * R + r) * D;
        for (int64_t j = 0; j < D; j += 8) {
          __m256 o = _mm256_setzero_ps();
          for (int64_t c = 0; c < kn; c++) o = _mm256_fmadd_ps(_mm256_set1_ps(ev[c]), _mm256_loadu_ps(acc.data() + (k0 + c) * D + j), o);
          _mm256_storeu_ps(dst + j, _mm256_div_ps(o, _mm256_set1_ps(l)));
        }
      }
}

}  // namespace cagk::avx2

namespace {

// The op: (B, H, R, D) float32 (Attention's shapes), its items spread over torch's threads.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& ks,
                            const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                            int64_t window, double softcap) {
  cagk::check_attention_q(q);
  cagk::avx2::Attention a(q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), q.size(3), kp, vp, ks, vs, slots, lens,
                          scale, window, softcap);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), a.items_n()));
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) a.work(p, nt);
  });
  at::Tensor out = at::empty(q.sizes(), q.options());
  a.merge(out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cag_avx2, m) {
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale, int window=0, float softcap=0.0) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag_avx2, CPU, m) {
  m.impl("decode_attention", decode_attention);
}
