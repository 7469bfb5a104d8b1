// The decoder layers of a decode step in one call (common/layers.h) over the AVX-512 library's pieces: its int4
// (VPDPBUSD) and bf16 products, glue (step.cpp) and decode attention over a pre-paired prefix (attention.cpp):
// torch.classes.cag.DecodeWeights and torch.ops.cag.decode_layers.
#include "arch/avx512/kernels.h"
#include "common/layers.h"

namespace cagk {

struct Avx512Layers {
  static constexpr bool BF16 = true;
  static constexpr int64_t PREFIX = 4;  // [kp, vp, kt, vt]: the prefix and its pairs (pair_kv or pair_kv8)
  using Attention = cagk::Attention;
  static void attention(std::vector<Attention>& att, const float* q, int64_t B, int64_t H, int64_t R, int64_t D,
                        const at::Tensor* pre, const at::Tensor& K, const at::Tensor& V, const at::Tensor& slots,
                        const at::Tensor& lens, double scale, int64_t window) {
    att.emplace_back(q, B, H, R, D, pre[0], pre[1], K, V, slots, lens, scale, pre[2], pre[3], false, window);
  }
  static void work(Attention& a, int64_t p, int64_t nt) { a.work<false>(p, nt); }
  static constexpr auto int4_prepare = cagk::int4_prepare;
  static constexpr auto int4_outputs = cagk::int4_outputs;
  static constexpr auto bf16_outputs = cagk::bf16_outputs;
  static constexpr auto rms_rows = cagk::rms_rows;
  static constexpr auto rms_rows_f32 = cagk::rms_rows_f32;
  static constexpr auto rope_rows = cagk::rope_rows;
  static constexpr auto silu_mul_rows = cagk::silu_mul_rows;
  static constexpr auto to_bf16 = cagk::to_bf16;
};

}  // namespace cagk

TORCH_LIBRARY_FRAGMENT(cag, m) {
  cagk::layers::define<cagk::Avx512Layers>(m, "cag");
}
TORCH_LIBRARY_IMPL(cag, CPU, m) {
  m.impl("decode_layers", cagk::layers::decode_layers<cagk::Avx512Layers>);
}
