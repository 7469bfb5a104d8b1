// The decoder layers of a decode step (one new token per request, int4 or bf16 weights, float32 compute) in one
// call and one parallel region, for cag/runtime/step.py (cag/runtime/all_layers.py), over an instruction set's
// pieces: each library's layer.cpp names them in a struct A (arch/avx512/layer.cpp, arch/avx2/layer.cpp) and
// registers DecodeWeights<A> and decode_layers<A> in its namespace (`define`).
//
// Why: as separate ops a layer costs about 13 torch calls, 5 OpenMP regions and 15 allocations, whose
// fixed costs are a large share of a step on a short prefix (bench/bench_decode.py), and a call per
// layer still pays argument passing, allocation and fork/join. Here the threads stay in one region for all
// layers and meet at barriers: the products and the attention are split over them, and the small row
// work between (norm, rope, residual, silu) runs on thread 0.
//
// Same pieces, same order, same bits as the ops cag/runtime/step.py calls otherwise (rms_bf16, the int4 or bf16
// product, rms_f32 for q/k norms and post-norms, rope_write, the library's decode attention, silu_mul_bf16, the
// float32 multiplies and adds): Llama's layer and the differences of Qwen3, Granite and OLMo-2
// (cag.model.families), window layers through the attention's window; tests/test_native.py checks the two ways
// give equal tensors.
//
// A provides: BF16 (whether it has bf16 products), PREFIX (tensors per prefix layer: [kp, vp] or with pair_kv's
// [kt, vt]), int4_prepare, int4_outputs, bf16_outputs, rms_rows, rms_rows_f32, rope_rows, silu_mul_rows, to_bf16
// (the signatures of arch/avx512/kernels.h), and Attention with attention(att, q, B, H, R, D, prefix, K, V, slots,
// lens, scale, window) (one more call in att) and work(a, p, nt).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>
#include <algorithm>
#include <string>
#include <vector>

#include "common/attention_plan.h"
#include "common/product_args.h"

namespace cagk::layers {

struct Product {  // a packed product: int4 (q: (N16, K/32, 256) uint8, d: (S, K/32, N) float16;
  const uint8_t* q;   // cag.model.layouts.pack_int4_native) or bf16 (w: (N, K))
  const uint16_t* d;
  const uint16_t* w;
  int64_t N, K, S;
};

// [qw, dm] for int4, or [w, anything] for bf16 (where the library has bf16 products).
template <class A>
Product product_of(const at::Tensor& a, const at::Tensor& b, int64_t K, const char* name) {
  if (a.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(A::BF16, name, ": bf16 weights, which this library's products do not take (int4 only)");
    TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == K && K % 32 == 0, name, ": bf16 weights (N, K) for K inputs");
    return {nullptr, nullptr, reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()), a.size(0), K, 0};
  }
  const cagk::Int4Shape sh = cagk::int4_blocks_shape(a, b, name);
  TORCH_CHECK(sh.K == K, name, ": int4 weights for ", K, " inputs");
  return {a.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(b.data_ptr<at::Half>()), nullptr, sh.N, K, sh.S};
}

// The R rows of a product's input as int4 reads them (int4_prepare): codes, scales and code sums per group of 32.
template <class A>
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  Q8Rows(int64_t R, int64_t K) : q(R * K), d(R * K / 32), s(R * K / 32) {}
  void of(const uint16_t* x, int64_t R, int64_t K) { A::int4_prepare(x, R, K, q.data(), d.data(), s.data()); }
};

// Thread p of nt: its outputs of w, in whole blocks of 16, for the R rows x (bf16; int4 reads them as prepared in xq).
template <class A>
inline void share(const Product& w, int64_t R, const uint16_t* x, const Q8Rows<A>& xq, float* y, int64_t p, int64_t nt) {
  const int64_t blocks = (w.N + 15) / 16;
  const int64_t n0 = std::min(w.N, blocks * p / nt * 16), n1 = std::min(w.N, blocks * (p + 1) / nt * 16);
  if (w.w) A::bf16_outputs(w.w, w.K, R, x, y, w.N, n0, n1);
  else if (n0 < n1) A::int4_outputs(w.q, w.d, w.K, R, xq.q.data(), xq.d.data(), xq.s.data(), y, w.N, n0, n1, w.S);
}

// h += y (R, hidden) float32, y first normed by `norm` (post-norms) where there is one, then x `mult`
// where it is not 1: the separate ops' rms_f32, y * mult and h + y, each rounded (no contraction).
template <class A>
inline void add_branch(float* h, float* y, int64_t R, int64_t hid, const float* norm, float eps, float mult) {
  if (norm) A::rms_rows_f32(y, hid, norm, R, hid, eps);
  if (mult != 1.0f)
    for (int64_t j = 0; j < R * hid; j++) y[j] = y[j] * mult;
  for (int64_t j = 0; j < R * hid; j++) h[j] = h[j] + y[j];
}

struct Layer {  // one layer's weights, as decode_layers reads them
  const float *norm1, *norm2;  // before attention and the MLP; with `post`, on their outputs
  float eps1, eps2;
  Product qkv, o, gu, down;
  const float* qkv_bias = nullptr;  // (N of qkv,) float32 added to the q/k/v product (Qwen2), or nullptr
  const float *q_norm = nullptr, *k_norm = nullptr;  // RMSNorm of q and k before rope (Qwen3, OLMo-2), or nullptr
  float q_eps = 0, k_eps = 0;
  int64_t q_width = 0, k_width = 0;  // what each norms: D (each head) or all of q's H D / k's Hk D
  bool post = false;  // no norms on the inputs, norm1 / norm2 on the attention's / the MLP's outputs (OLMo-2)
  float residual = 1;  // each branch x this before its residual add (Granite); 1: no multiply (the same bits)
  int64_t window = 0;  // a sliding window's W (each row reads its last W keys: common/attention_plan.h), 0: none
};

// All decoder layers' weights of one model, named and checked once when each layer is added (not on
// every step): torch.classes.cag.DecodeWeights(heads, kv_heads, head_dim, hidden, scale), then
// add_layer(...) per layer in order (cag/runtime/all_layers.py builds it). It keeps the tensors alive.
template <class A>
struct DecodeWeights : torch::CustomClassHolder {
  int64_t H, Hk, D, hid, I = 0;
  double scale;
  std::vector<Layer> layers;
  std::vector<at::Tensor> kept;

  DecodeWeights(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, double scale_)
      : H(heads), Hk(kv_heads), D(head_dim), hid(hidden), scale(scale_) {
    TORCH_CHECK(Hk >= 1 && H % Hk == 0 && cagk::head_dim_ok(D),
                "query heads a multiple of K/V heads, a head width the kernels take (64, 80, 96, 128 or 256)");
  }

  // One layer: its norms' weights (hidden,) float32 and epsilons, and its products as product_of takes
  // them (int4: weights and scales; bf16: weights and any tensor): q/k/v stacked, o, gate/up stacked, down;
  // qkv_bias: the q/k/v product's bias as float32 (N,), or an empty tensor for none; q_norm, k_norm: float32
  // weights of RMSNorms of q and k before rope, (D,) for each head's or (H D,) and (Hk D,) for all of q's
  // and k's, or empty for none; post_norms: input_norm and post_norm apply to the attention's and the MLP's
  // outputs instead of their inputs; residual_multiplier: each branch's factor before its residual add;
  // window: the layer's sliding window W, 0 for full attention.
  void add_layer(const at::Tensor& input_norm, double input_eps, const at::Tensor& qkv, const at::Tensor& qkv_scales,
                 const at::Tensor& o, const at::Tensor& o_scales, const at::Tensor& post_norm, double post_eps,
                 const at::Tensor& gate_up, const at::Tensor& gate_up_scales, const at::Tensor& down,
                 const at::Tensor& down_scales, const at::Tensor& qkv_bias, const at::Tensor& q_norm, double q_eps,
                 const at::Tensor& k_norm, double k_eps, bool post_norms, double residual_multiplier,
                 int64_t window) {
    for (const at::Tensor* t : {&input_norm, &post_norm})
      TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == hid,
                  "norm weights: (hidden,) float32");
    Layer y{input_norm.data_ptr<float>(), post_norm.data_ptr<float>(), (float)input_eps, (float)post_eps,
            product_of<A>(qkv, qkv_scales, hid, "q/k/v"), product_of<A>(o, o_scales, H * D, "o"),
            product_of<A>(gate_up, gate_up_scales, hid, "gate/up"), {}};
    TORCH_CHECK(y.qkv.N == (H + 2 * Hk) * D && y.o.N == hid && y.gu.N % 2 == 0 && (layers.empty() || y.gu.N == 2 * I),
                "q/k/v, o or gate/up widths disagree with the heads or the other layers");
    if (qkv_bias.numel()) {
      TORCH_CHECK(qkv_bias.dim() == 1 && qkv_bias.scalar_type() == at::kFloat && qkv_bias.is_contiguous() &&
                  qkv_bias.size(0) == y.qkv.N, "qkv_bias: (N of q/k/v,) float32, or empty for none");
      y.qkv_bias = qkv_bias.data_ptr<float>();
    }
    TORCH_CHECK((q_norm.numel() == 0) == (k_norm.numel() == 0), "q_norm and k_norm: both or neither");
    if (q_norm.numel()) {
      for (const at::Tensor* t : {&q_norm, &k_norm})
        TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->is_contiguous(), "q_norm, k_norm: float32 vectors");
      y.q_width = q_norm.size(0) == H * D ? H * D : D;
      y.k_width = k_norm.size(0) == Hk * D ? Hk * D : D;
      TORCH_CHECK(q_norm.size(0) == y.q_width && k_norm.size(0) == y.k_width,
                  "q_norm, k_norm: (D,) for each head, or (H D,) and (Hk D,) for all of q and k");
      y.q_norm = q_norm.data_ptr<float>();
      y.k_norm = k_norm.data_ptr<float>();
      y.q_eps = (float)q_eps;
      y.k_eps = (float)k_eps;
    }
    y.post = post_norms;
    y.residual = (float)residual_multiplier;
    TORCH_CHECK(window >= 0, "window: 0 (none) or a sliding window's width");
    y.window = window;
    I = y.gu.N / 2;
    y.down = product_of<A>(down, down_scales, I, "down");
    TORCH_CHECK(y.down.N == hid, "down's width is not the hidden size");
    layers.push_back(y);
    kept.insert(kept.end(), {input_norm, qkv, qkv_scales, o, o_scales, post_norm, gate_up, gate_up_scales, down, down_scales,
                             qkv_bias, q_norm, k_norm});
  }

  int64_t size() const { return (int64_t)layers.size(); }
};

// h (R, hidden) float32, updated in place: one row per request, through every layer of `w`. K[l], V[l]
// (S, Hk, room, D) bf16: layer l's slots (row r's k/v written at [slot[r], :, pos[r]]); cos, sin (R, D) as
// rope_write takes them. The rows' requests in G groups, each on one prefix: group g's rows[g] (its row
// numbers, int64), and slots[g], lens[g] as the library's decode attention takes them; prefix[P (l G + g) ..
// + P - 1], P = A::PREFIX: its prefix in layer l as that attention takes it ([kp, vp], and pair_kv's [kt, vt] on
// AVX-512).
template <class A>
void decode_layers(at::Tensor h, const c10::intrusive_ptr<DecodeWeights<A>>& w, const at::Tensor& cos, const at::Tensor& sin,
                   at::TensorList K, at::TensorList V, const at::Tensor& rows_slot, const at::Tensor& rows_pos,
                   at::TensorList prefix, at::TensorList rows, at::TensorList slots, at::TensorList lens) {
  const int64_t L = w->size(), G = (int64_t)rows.size(), H = w->H, Hk = w->Hk, D = w->D, I = w->I;
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous() && h.size(1) == w->hid,
              "h: (R, hidden) float32, contiguous");
  TORCH_CHECK(L >= 1 && (int64_t)K.size() == L && (int64_t)V.size() == L && G >= 1 && (int64_t)slots.size() == G &&
              (int64_t)lens.size() == G && (int64_t)prefix.size() == A::PREFIX * L * G,
              "per layer: K, V and ", A::PREFIX, " prefix tensors a group; per group: rows, slots, lens");
  const int64_t R = h.size(0), hid = h.size(1), room = K[0].size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R * D, "cos, sin: (R, D) float32");
  for (const at::Tensor* t : {&rows_slot, &rows_pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == R, "rows_slot, rows_pos: (R,) int64");
  const int64_t* sl = rows_slot.data_ptr<int64_t>();
  const int64_t* ps = rows_pos.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; l++)
    TORCH_CHECK(K[l].dim() == 4 && K[l].scalar_type() == at::kBFloat16 && K[l].is_contiguous() && V[l].sizes() == K[l].sizes() &&
                V[l].scalar_type() == at::kBFloat16 && V[l].is_contiguous() && K[l].sizes() == K[0].sizes() &&
                K[l].size(1) == Hk && K[l].size(3) == D,
                "K, V: (S, Hk, room, D) bfloat16, contiguous, alike in every layer");
  const std::vector<Layer>& layers = w->layers;
  for (int64_t r = 0; r < R; r++)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < K[0].size(0) && ps[r] >= 0 && ps[r] < room, "slot or position outside the buffers");
  const int64_t wide = std::max({hid, H * D, I});  // the widest product input
  std::vector<uint16_t> xb(R * wide);  // a product's input in bf16
  Q8Rows<A> xq(R, wide);                // and as int4 reads it
  std::vector<float> yqkv(R * (H + 2 * Hk) * D), q(R * H * D), o(R * H * D), yo(R * hid), ygu(R * 2 * I),
      ydn(R * hid);
  std::vector<std::vector<float>> qg(G), og(G);  // each group's rows of q and of the attention, together
  std::vector<const int64_t*> gr(G);
  std::vector<char> seen(R, 0);
  for (int64_t g = 0; g < G; g++) {
    const int64_t n = rows[g].numel();
    TORCH_CHECK(rows[g].scalar_type() == at::kLong && rows[g].is_contiguous() && n >= 1, "rows: (n,) int64 for each group");
    gr[g] = rows[g].data_ptr<int64_t>();
    for (int64_t i = 0; i < n; i++) {
      TORCH_CHECK(gr[g][i] >= 0 && gr[g][i] < R && !seen[gr[g][i]], "the groups' rows must cover the pass, each row once");
      seen[gr[g][i]] = 1;
    }
    qg[g].resize(n * H * D);
    og[g].resize(n * H * D);
  }
  TORCH_CHECK(std::all_of(seen.begin(), seen.end(), [](char c) { return c != 0; }), "the groups' rows must cover the pass, each row once");
  std::vector<typename A::Attention> att;  // checked here, on the calling thread: nothing may throw inside the region
  att.reserve(L * G);
  for (int64_t l = 0; l < L; l++)
    for (int64_t g = 0; g < G; g++)
      A::attention(att, qg[g].data(), rows[g].numel(), Hk, H / Hk, D, prefix.data() + A::PREFIX * (l * G + g), K[l], V[l],
                   slots[g], lens[g], w->scale, layers[l].window);
  const int64_t hd_ = H * D;
  float* hd = h.data_ptr<float>();
  const float *cd = cos.data_ptr<float>(), *sd = sin.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());

#pragma omp parallel num_threads(threads)
  {
    const int64_t p = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t l = 0; l < L; l++) {
      const Layer& y = layers[l];
      // h normed (with post-norms: as it is) to bf16 into xb, the next product's input, prepared for int4 weights
      const auto to_product = [&](const float* norm, float eps, const Product& next) {
        if (y.post) A::to_bf16(hd, R * hid, xb.data());
        else A::rms_rows(hd, norm, R, hid, eps, xb.data());
        if (!next.w) xq.of(xb.data(), R, hid);
      };
      if (p == 0) to_product(y.norm1, y.eps1, y.qkv);
#pragma omp barrier
      share<A>(y.qkv, R, xb.data(), xq, yqkv.data(), p, nt);
#pragma omp barrier
      if (p == 0) {
        if (y.qkv_bias)  // float32 adds, as the separate ops' product + bias
          for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < y.qkv.N; j++) yqkv[r * y.qkv.N + j] += y.qkv_bias[j];
        if (y.q_norm)  // q's rows (R, H D) and k's (R, Hk D) of yqkv, normed per head (width D) or whole
          for (int64_t r = 0; r < R; r++) {
            float* row = yqkv.data() + r * y.qkv.N;
            A::rms_rows_f32(row, y.q_width, y.q_norm, H * D / y.q_width, y.q_width, y.q_eps);
            A::rms_rows_f32(row + H * D, y.k_width, y.k_norm, Hk * D / y.k_width, y.k_width, y.k_eps);
          }
        A::rope_rows(yqkv.data(), y.qkv.N, cd, sd, R, H, Hk, D, room, sl, ps, q.data(),
                        reinterpret_cast<uint16_t*>(K[l].data_ptr<at::BFloat16>()), reinterpret_cast<uint16_t*>(V[l].data_ptr<at::BFloat16>()));
        for (int64_t g = 0; g < G; g++)  // each group's rows of q together, as its attention reads them
          for (int64_t i = 0; i < rows[g].numel(); i++) std::copy_n(q.data() + gr[g][i] * hd_, hd_, qg[g].data() + i * hd_);
      }
#pragma omp barrier
      for (int64_t g = 0; g < G; g++) A::work(att[l * G + g], p, nt);
#pragma omp barrier
      if (p == 0) {
        for (int64_t g = 0; g < G; g++) {  // (n, Hk, H/Hk, D) = (n, H D), head-major as o_proj reads it, to the group's rows
          att[l * G + g].merge(og[g].data());
          for (int64_t i = 0; i < rows[g].numel(); i++) std::copy_n(og[g].data() + i * hd_, hd_, o.data() + gr[g][i] * hd_);
        }
        A::to_bf16(o.data(), R * H * D, xb.data());
        if (!y.o.w) xq.of(xb.data(), R, H * D);
      }
#pragma omp barrier
      share<A>(y.o, R, xb.data(), xq, yo.data(), p, nt);
#pragma omp barrier
      if (p == 0) {
        add_branch<A>(hd, yo.data(), R, hid, y.post ? y.norm1 : nullptr, y.eps1, y.residual);
        to_product(y.norm2, y.eps2, y.gu);
      }
#pragma omp barrier
      share<A>(y.gu, R, xb.data(), xq, ygu.data(), p, nt);
#pragma omp barrier
      if (p == 0) {
        A::silu_mul_rows(ygu.data(), R, I, xb.data());
        if (!y.down.w) xq.of(xb.data(), R, I);
      }
#pragma omp barrier
      share<A>(y.down, R, xb.data(), xq, ydn.data(), p, nt);
#pragma omp barrier
      if (p == 0) add_branch<A>(hd, ydn.data(), R, hid, y.post ? y.norm2 : nullptr, y.eps2, y.residual);
    }
  }
}

// The class and the op in namespace `ns` (a TORCH_LIBRARY_FRAGMENT's m): torch.classes.<ns>.DecodeWeights and
// torch.ops.<ns>.decode_layers.
template <class A>
void define(torch::Library& m, const std::string& ns) {
  m.class_<DecodeWeights<A>>("DecodeWeights")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double>(), "",
           {torch::arg("heads"), torch::arg("kv_heads"), torch::arg("head_dim"), torch::arg("hidden"), torch::arg("scale")})
      .def("add_layer", &DecodeWeights<A>::add_layer, "",
           {torch::arg("input_norm"), torch::arg("input_eps"), torch::arg("qkv"), torch::arg("qkv_scales"), torch::arg("o"),
            torch::arg("o_scales"), torch::arg("post_norm"), torch::arg("post_eps"), torch::arg("gate_up"),
            torch::arg("gate_up_scales"), torch::arg("down"), torch::arg("down_scales"), torch::arg("qkv_bias"),
            torch::arg("q_norm"), torch::arg("q_eps"), torch::arg("k_norm"), torch::arg("k_eps"), torch::arg("post_norms"),
            torch::arg("residual_multiplier"), torch::arg("window") = 0})
      .def("__len__", &DecodeWeights<A>::size);
  const std::string schema = "decode_layers(Tensor(a!) h, __torch__.torch.classes." + ns + ".DecodeWeights w, Tensor cos, "
      "Tensor sin, Tensor(b!)[] K, Tensor(c!)[] V, Tensor rows_slot, Tensor rows_pos, Tensor[] prefix, Tensor[] rows, "
      "Tensor[] slots, Tensor[] lens) -> ()";
  m.def(schema.c_str());  // parsed here: the string need not outlive the call
}

}  // namespace cagk::layers
