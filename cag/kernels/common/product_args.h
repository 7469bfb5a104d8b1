// What the weight products of both libraries share (arch/avx512/products.cpp, arch/avx2/products.cpp): their
// arguments' checks (the same layouts: int4 in blocks of 16 outputs, q8 in Q8_0's rows), their rows in float32, and
// the q8 product's op around each one's rows.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cagk {

// x (M, K) bfloat16, contiguous, K the weight's input width.
inline void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == K,
              "x: (M, K) bfloat16, contiguous, K the weight's input width");
}

// The shape of an int4 product's weights: N outputs, K inputs, S rows of steps and mins.
struct Int4Shape {
  int64_t N, K, S;
};

// int4 (cag.model.layouts.pack_int4_native): qw (N16, G, 256) uint8 in blocks of 16 outputs,
// dm (S, G, N) float16, S = 1 (steps: Q4_0's grid) or 2 (steps, then mins), N16 = ceil(N / 16), K = 32 G.
inline Int4Shape int4_blocks_shape(const at::Tensor& qw, const at::Tensor& dm, const char* name) {
  TORCH_CHECK(qw.dim() == 3 && qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.size(2) == 256, name,
              ": int4 weights: qw (N16, K/32, 256) uint8");
  TORCH_CHECK(dm.dim() == 3 && dm.scalar_type() == at::kHalf && dm.is_contiguous() && (dm.size(0) == 1 || dm.size(0) == 2) &&
              dm.size(1) == qw.size(1) && (dm.size(2) + 15) / 16 == qw.size(0) && dm.size(2) >= 1, name,
              ": int4 weights: dm (S, K/32, N) float16, S 1 or 2, N within qw's blocks of 16");
  return {dm.size(2), qw.size(1) * 32, dm.size(0)};
}

// The int4 product x (M, K) bf16 times qw, dm (int4_blocks_shape) -> (M, N) float32, around an instruction set's
// `prepare(x, M, K, qx, dx, sx)` (each row's 8-bit codes, scales and code sums per group of 32) and
// `outputs(q, d, S, K, N, M, qx, dx, sx, y, n0, n1)` (outputs [n0, n1) of every row, n0 a multiple of `unit`):
// the outputs go over torch's threads in runs of `unit`; a row's bits are its own.
template <class Prepare, class Outputs>
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm, int64_t unit, Prepare prepare,
                        Outputs outputs) {
  const Int4Shape sh = int4_blocks_shape(qw, dm, "int4_mm");
  check_x(x, sh.K);
  const int64_t K = sh.K, N = sh.N, M = x.size(0), G = K / 32;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * G);
  std::vector<int32_t> sx(M * G);
  prepare(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, qx.data(), dx.data(), sx.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, (N + unit - 1) / unit, 1, [&](int64_t u0, int64_t u1) {
    outputs(q, d, sh.S, K, N, M, qx.data(), dx.data(), sx.data(), yd, u0 * unit, std::min(N, u1 * unit));
  });
  return y;
}

// q8: qw (N, K) int8, d (N, K/32) float16, K a multiple of 32; returns K.
inline int64_t check_q8(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d) {
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kChar && qw.is_contiguous() && qw.size(1) % 32 == 0,
              "qw: (N, K) int8, K a multiple of 32");
  const int64_t N = qw.size(0), K = qw.size(1);
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == N && d.size(1) == K / 32,
              "d: (N, K/32) float16");
  check_x(x, K);
  return K;
}

// n bf16 values (as their bits) -> float32, exactly.
inline void bf16_to_float(const uint16_t* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; i++) { const uint32_t b = (uint32_t)x[i] << 16; std::memcpy(y + i, &b, 4); }
}

// The q8 product x (M, K) bf16, qw (N, K) int8, d (N, K/32) float16 -> (M, N) float32 (int4's LM head), around an
// instruction set's `output(q, d, K, M, xf, y, N, n)`: output n of all M rows into y (M, N), from the rows in
// float32 (xf (M, K), exact). Outputs go over torch's threads in runs of 64; a row's bits are its own.
template <class Output>
at::Tensor q8_product(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, Output output) {
  const int64_t K = check_q8(x, qw, d), N = qw.size(0), M = x.size(0);
  std::vector<float> xf(M * K);  // the rows in float32 (exact)
  bf16_to_float(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M * K, xf.data());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* q = qw.data_ptr<int8_t>();
  const uint16_t* dd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) output(q, dd, K, M, xf.data(), yd, N, n);
  });
  return y;
}

}  // namespace cagk
