// Decode attention on AVX512-BF16, or on Intel AMX tiles where the compiler targets them: the query
// rows of each request (one new token: its heads that share a K/V head) over the prefix the requests
// share and each request's own suffix, in one call. Built and loaded by cag/kernels/native.py (the AVX-512
// library: arch/avx512/ and arch/amx/); used by cag/runtime/attention.py for decode rows over bf16 K/V or an
// int8 snapshot's codes, and inside layer.cpp's one call.
//
// Work: keys are read in items of C keys (a prefix chunk for all rows of every request on it, or a
// suffix chunk for one request's rows, or for rows of one slot that read keys of it, each row as far as its own
// length, as a knowledge prefill's decode rows do: common/attention_plan.h), spread over the threads; each item leaves
// per row its max score m, its probability sum l and sum_t p_t v_t (unnormalized), merged per row in chunk
// order. An item runs on AMX tiles (`decode_attention`: arch/amx/attention_item.cpp), by AVX512-BF16 dot
// products (`decode_attention_avx512`: attention_item.cpp; the two differ in the last bits), or over int8
// codes (int8_attention.cpp). A row's result depends on its own query and keys only: each output element
// comes from its own row, and nothing else mixes rows. So a request's bits never depend on which other
// requests share its step.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "arch/amx/kernels.h"
#include "arch/avx512/kernels.h"
#include "common/step_args.h"

namespace {

constexpr int64_t C = cagk::CHUNK;
// A pre-paired prefix item prefetches the one its thread takes AHEAD items later into L2 as it computes
// (1 to 3 ahead measured alike, 4 slower: bench/bench_decode.py's attention rows).
constexpr int64_t AHEAD = 1;

}  // namespace

namespace cagk {

// q (B, H, R, D) float32: request b, K/V head h, row r (the query heads sharing h); kp, vp (H, n, D)
// bf16: the shared prefix (n may be 0); ks, vs (S, H, room, D) bf16: the request slots; slots (B,),
// lens (B,) int64: request b reads keys [0, lens[b]) of slot slots[b].
// kt, vt (avx512 only): the prefix as pair_kv gives it, read in place of kp and vp's rows; or as pair_kv8 gives
// it (uint8: an int8 snapshot's codes), kp and vp then read for their shapes only. window: a sliding window's W
// (each row reads its last W keys: common/attention_plan.h), 0 for none. softcap: Gemma 2's attention logit
// soft-capping (scores cap * tanh(score / cap), common/attention_plan.h's Scaling), 0 for none.
Attention::Attention(const float* q, int64_t B, int64_t H, int64_t R, int64_t D, const at::Tensor& kp_,
                     const at::Tensor& vp_, const at::Tensor& ks_, const at::Tensor& vs_, const at::Tensor& slots,
                     const at::Tensor& lens, double scale_, const std::optional<at::Tensor>& kt,
                     const std::optional<at::Tensor>& vt, bool amx, int64_t window, double softcap)
    : qd(q), kp(kp_), vp(vp_), ks(ks_), vs(vs_), scale((float)scale_, (float)softcap) {
#ifndef CAG_AMX
  TORCH_CHECK(!amx, "this library was built for a CPU without AMX: use decode_attention_avx512");
#endif
  TORCH_CHECK(!amx || amx_permitted(), "the kernel refused to start: Linux did not grant AMX tile state to this process");
  TORCH_CHECK(!amx || D % 64 == 0, "the AMX attention takes heads of 64, 128 or 256 (it sums values 64 dims a tile group)");
  const int64_t most_ = cagk::check_attention(B, H, D, kp, vp, ks, vs, slots, lens, true);  // suffix chunks of the longest suffix
  TORCH_CHECK(window >= 0, "window: 0 (none) or a sliding window's width");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap: 0 (none) or a soft cap on the scores");
  lay_out(B, H, R, D, kp.size(1), most_, slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), window);  // its items
  TORCH_CHECK(kt.has_value() == vt.has_value() && (!kt || !amx), "kt and vt: both or neither, and for the avx512 kernel");
  if (kt && kt->scalar_type() == at::kByte) {
    TORCH_CHECK(vt->scalar_type() == at::kByte && kt->is_contiguous() && vt->is_contiguous() &&
                kt->sizes() == at::IntArrayRef({H, np, cagk::int8_item_bytes(D)}) && vt->sizes() == kt->sizes(),
                "kt, vt: the prefix as pair_kv8 gives it");
    k8 = kt->data_ptr<uint8_t>();
    v8 = vt->data_ptr<uint8_t>();
  } else if (kt) {
    TORCH_CHECK(kt->scalar_type() == at::kInt && vt->scalar_type() == at::kInt && kt->is_contiguous() && vt->is_contiguous() &&
                kt->sizes() == at::IntArrayRef({H, np, D / 2, C}) && vt->sizes() == at::IntArrayRef({H, (n + 1) / 2, D}),
                "kt, vt: the prefix as pair_kv gives it");
    ktd = reinterpret_cast<const uint32_t*>(kt->data_ptr<int32_t>());
    vtd = reinterpret_cast<const uint32_t*>(vt->data_ptr<int32_t>());
  }
  part.resize(B * H * R * chunks);
  acc.resize(B * H * R * chunks * D);
}

template <bool AMX>
void Attention::work(int64_t p, int64_t nt) {
  [[maybe_unused]] std::conditional_t<AMX, Tiles, int> tiles{};
  std::vector<const float*> qs(B * R);
  std::vector<float*> accs(B * R);
  std::vector<Partial> ps(B * R);
  std::vector<int64_t> fr(B * R), who(B * R), to(B * R);  // per row of an item: its keys [fr, to), its request
  const int64_t n_items = items_n();
  for (int64_t i = p; i < n_items; i += nt) {  // share p takes items p, p + nt, ...: prefix and suffix spread evenly
    if (i < n_pre) {
      const int64_t h = items[i] / np, c = items[i] % np, t0 = c * C;
      // the rows of every request that reads this chunk (all of them without a window)
      const int64_t nr = prefix_rows(i, qd, acc.data(), qs.data(), accs.data(), fr.data(), who.data());
      const at::BFloat16* k0 = kp.data_ptr<at::BFloat16>() + h * kp.stride(0) + t0 * kp.stride(1);
      const at::BFloat16* v0 = vp.data_ptr<at::BFloat16>() + h * vp.stride(0) + t0 * vp.stride(1);
#ifdef CAG_AMX
      if (AMX) item_amx(qs.data(), nr, k0, v0, kp.stride(1), std::min(C, n - t0), D, scale, ps.data(), accs.data(), fr.data());
      else
#endif
      if (k8) {
        const int64_t kb = cagk::int8_item_bytes(D), vb = kb;
        const bool next = i + AHEAD * nt < n_pre;  // a prefix item this thread takes later: prefetched as this one runs
        const int64_t j = next ? items[i + AHEAD * nt] : 0;
        cagk::item_int8(qs.data(), nr, k8 + items[i] * kb, v8 + items[i] * vb, std::min(C, n - t0), D, scale, ps.data(),
                        accs.data(), next ? reinterpret_cast<const char*>(k8 + j * kb) : nullptr,
                        next ? reinterpret_cast<const char*>(v8 + j * vb) : nullptr, fr.data());
      } else {
        const char *nk = nullptr, *nv = nullptr;  // a prefix item this thread takes later, if any
        int64_t nkb = 0, nvb = 0;
        if (ktd && i + AHEAD * nt < n_pre) {
          const int64_t h2 = items[i + AHEAD * nt] / np, c2 = items[i + AHEAD * nt] % np;
          nk = reinterpret_cast<const char*>(ktd + (h2 * np + c2) * (D / 2) * C), nkb = (D / 2) * C * 4;
          nv = reinterpret_cast<const char*>(vtd + (h2 * ((n + 1) / 2) + c2 * C / 2) * D);
          nvb = (std::min(C, n - c2 * C) + 1) / 2 * D * 4;
        }
        item_avx512(qs.data(), nr, k0, v0, kp.stride(1), std::min(C, n - t0), D, scale, ps.data(), accs.data(), fr.data(),
                    nullptr, ktd ? ktd + (h * np + c) * (D / 2) * C : nullptr, vtd ? vtd + (h * ((n + 1) / 2) + t0 / 2) * D : nullptr,
                    nk, nkb, nv, nvb);
      }
      for (int64_t j = 0; j < nr; j++) part[at(who[j], h, j % R, c)] = ps[j];
    } else {
      const SuffixItem& it = suffix[i - n_pre];
      const int64_t b0 = it.b0, nb = it.nb, h = it.h, c = it.c, t0 = c * C;
      const int64_t w = suffix_rows(it, qd, acc.data(), qs.data(), accs.data(), fr.data(), to.data());
      const at::BFloat16* k0 = ks.data_ptr<at::BFloat16>() + slot[b0] * ks.stride(0) + h * ks.stride(1) + t0 * ks.stride(2);
      const at::BFloat16* v0 = vs.data_ptr<at::BFloat16>() + slot[b0] * vs.stride(0) + h * vs.stride(1) + t0 * vs.stride(2);
#ifdef CAG_AMX
      if (AMX) item_amx(qs.data(), nb * R, k0, v0, ks.stride(2), w, D, scale, ps.data(), accs.data(), fr.data(), to.data());
      else
#endif
      item_avx512(qs.data(), nb * R, k0, v0, ks.stride(2), w, D, scale, ps.data(), accs.data(), fr.data(), to.data());
      for (int64_t j = 0; j < nb * R; j++) part[at(b0 + j / R, h, j % R, np + c)] = ps[j];
    }
  }
}
template void Attention::work<false>(int64_t, int64_t);
#ifdef CAG_AMX
template void Attention::work<true>(int64_t, int64_t);
#endif

void Attention::merge(float* od) const {
  std::vector<float> ev(chunks);
  for (int64_t b = 0; b < B; b++)  // each row's chunks merged in a fixed order: prefix, then suffix
    for (int64_t h = 0; h < H; h++)
      for (int64_t r = 0; r < R; r++) {
        const int64_t k0 = at(b, h, r, first_chunk(b)), kn = row_chunks(b) - first_chunk(b);
        const float l = merge_weights(part.data() + k0, kn, ev.data());
        float* dst = od + ((b * H + h) * R + r) * D;
        for (int64_t j = 0; j < D; j += 16) {
          __m512 o = _mm512_setzero_ps();
          for (int64_t c = 0; c < kn; c++)
            o = _mm512_fmadd_ps(_mm512_set1_ps(ev[c]), _mm512_loadu_ps(acc.data() + (k0 + c) * D + j), o);
          _mm512_storeu_ps(dst + j, _mm512_div_ps(o, _mm512_set1_ps(l)));
        }
      }
}

}  // namespace cagk

namespace {

// Returns (B, H, R, D) float32 (Attention's shapes), its items spread over torch's threads.
template <bool AMX>
at::Tensor attend(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& ks,
                  const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                  const std::optional<at::Tensor>& kt = std::nullopt, const std::optional<at::Tensor>& vt = std::nullopt,
                  int64_t window = 0, double softcap = 0) {
  cagk::check_attention_q(q);
  cagk::Attention a(q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), q.size(3), kp, vp, ks, vs, slots, lens, scale, kt, vt, AMX,
                    window, softcap);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), a.items_n()));
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) a.work<AMX>(p, nt);
  });
  at::Tensor out = at::empty(q.sizes(), q.options());
  a.merge(out.data_ptr<float>());
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vpre, const at::Tensor& ks,
                            const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                            int64_t window, double softcap) {
  return attend<true>(q, kp, vpre, ks, vs, slots, lens, scale, std::nullopt, std::nullopt, window, softcap);
}

at::Tensor decode_attention_avx512(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vpre, const at::Tensor& ks,
                                   const at::Tensor& vs, const at::Tensor& slots, const at::Tensor& lens, double scale,
                                   const std::optional<at::Tensor>& kt, const std::optional<at::Tensor>& vt, int64_t window,
                                   double softcap) {
  return attend<false>(q, kp, vpre, ks, vs, slots, lens, scale, kt, vt, window, softcap);
}

}  // namespace

TORCH_LIBRARY(cag, m) {
  m.def("decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("decode_attention_avx512(Tensor q, Tensor kp, Tensor vp, Tensor ks, Tensor vs, Tensor slots, Tensor lens, float scale, Tensor? kt=None, Tensor? vt=None, int window=0, float softcap=0.0) -> Tensor");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_avx512", decode_attention_avx512);
}
