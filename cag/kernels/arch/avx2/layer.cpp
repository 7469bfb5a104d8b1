// The decoder layers of a decode step in one call (common/layers.h) over the AVX2 library's pieces: its int4
// products (VPMADDUBSW), glue (step.cpp) and decode attention (attention.cpp): torch.classes.cag_avx2.DecodeWeights
// and torch.ops.cag_avx2.decode_layers. int4 weights only (the library has no bf16 products).
#include "arch/avx2/kernels.h"
#include "common/layers.h"

namespace cagk::avx2 {

struct Layers {
  static constexpr bool BF16 = false;
  static constexpr int64_t PREFIX = 2;  // [kp, vp]: the prefix as it is (this attention pairs nothing)
  using Attention = cagk::avx2::Attention;
  static void attention(std::vector<Attention>& att, const float* q, int64_t B, int64_t H, int64_t R, int64_t D,
                        const at::Tensor* pre, const at::Tensor& K, const at::Tensor& V, const at::Tensor& slots,
                        const at::Tensor& lens, double scale, int64_t window) {
    att.emplace_back(q, B, H, R, D, pre[0], pre[1], K, V, slots, lens, scale, window);
  }
  static void work(Attention& a, int64_t p, int64_t nt) { a.work(p, nt); }
  static constexpr auto int4_prepare = cagk::avx2::int4_prepare;
  static constexpr auto int4_outputs = cagk::avx2::int4_outputs;
  // never called: product_of refuses bf16 weights where BF16 is false
  static void bf16_outputs(const uint16_t*, int64_t, int64_t, const uint16_t*, float*, int64_t, int64_t, int64_t) {}
  static constexpr auto rms_rows = cagk::avx2::rms_rows;
  static constexpr auto rms_rows_f32 = cagk::avx2::rms_rows_f32;
  static constexpr auto rope_rows = cagk::avx2::rope_rows;
  static constexpr auto silu_mul_rows = cagk::avx2::silu_mul_rows;
  static constexpr auto to_bf16 = cagk::avx2::to_bf16;
};

}  // namespace cagk::avx2

TORCH_LIBRARY_FRAGMENT(cag_avx2, m) {
  cagk::layers::define<cagk::avx2::Layers>(m, "cag_avx2");
}
TORCH_LIBRARY_IMPL(cag_avx2, CPU, m) {
  m.impl("decode_layers", cagk::layers::decode_layers<cagk::avx2::Layers>);
}
