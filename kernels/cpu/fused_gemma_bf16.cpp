// bfloat16 row kernels of fused_gemma.h, bit-exact with the PyTorch path of
// engine/models/layer_ops.py (transformers' op order), rounding where its ops round:
// - Gemma norm: h = float(x); inv = 1 / sqrt(mean(h * h) + eps) (sum in ATen's order, as
//   fused_elementwise_bf16.cpp's); bf16((h * inv) * (1 + float(w))): one rounding, at the cast.
// - residual + gnorm(x): a bf16 add of the rounded norm, stored in place.
// - GeGLU: bf16(gelu_tanh(g) * up), gelu_tanh(g) read from a table of F.gelu's own results
//   (its vectorised loop's; ATen's scalar loop, which it runs on the tails of a thread's
//   range, differs from it by up to ~2e-7 where gelu is below ~1e-6: -0.0 against -1.5e-7 at
//   g = -5.09, so there the PyTorch path itself depends on the thread count).
// - q/k norm: Llama's bf16(w * bf16(h * inv)) or Gemma's above, per head; stored, then the
//   rotation of fused_elementwise_bf16.cpp on the stored (rounded) heads.
// Like that file it opts out of -ffast-math; the pragma precedes every include.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif

#include "bf16_rows.h"
#include "fused_elementwise.h"
#include "fused_gemma.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace kvfleet_cpu {

using namespace kvfleet_bf16;  // NOLINT: the row helpers

namespace {

at::Tensor gelu_tanh_of(const at::Tensor& x) { return at::gelu(x, "tanh"); }

// 1 / sqrt(mean(float(x)^2) + eps) over n values: sum / n and the square root each correctly
// rounded, as ATen's mean and rsqrt.
inline float inv_rms(const BF16* x, int64_t n, double eps) {
  const float mean = sum_of_squares(x, n) / static_cast<float>(n);
  return 1.f / std::sqrt(mean + static_cast<float>(eps));  // eps added as a float32
}

// Chunk i of a Gemma-normed row, not yet rounded: (h * inv) * (1 + float(w)).
inline f32x16 gemma_scaled(const BF16* x, const BF16* w, float inv, int64_t i, int64_t n) {
  return (load(x + i, n) * inv) * (1.f + load(w + i, n));
}

}  // namespace

const uint16_t* gelu_tanh_table() {
  static const std::vector<uint16_t> table = unary_table(&gelu_tanh_of);
  return table.data();
}

template <>
void gemma_norm_rows<BF16>(BF16* out, const BF16* x, BF16* residual, const BF16* w_x,
                           const BF16* w_out, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* src = x + r * hidden;
      if (residual != nullptr) {
        BF16* rr = residual + r * hidden;
        const float inv = inv_rms(src, hidden, eps);
        for_each_chunk(hidden, [&](int64_t i, int64_t n) {
          const f32x16 normed = round_bf16(gemma_scaled(src, w_x, inv, i, n));
          store(rr + i, load(rr + i, n) + normed, n);
        });
        src = rr;
      }
      const float inv = inv_rms(src, hidden, eps);
      BF16* o = out + r * hidden;
      for_each_chunk(hidden, [&](int64_t i, int64_t n) {
        store(o + i, gemma_scaled(src, w_out, inv, i, n), n);
      });
    }
  });
}

template <>
void gelu_tanh_and_mul_rows<BF16>(BF16* out, const BF16* x, int64_t rows, int64_t inter) {
  const uint16_t* gelu = gelu_tanh_table();  // built here, outside the parallel region
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* g = x + r * 2 * inter;
      const BF16* u = g + inter;
      BF16* o = out + r * inter;
      for_each_chunk(inter, [&](int64_t i, int64_t n) {
        store(o + i, lookup(gelu, g + i, n) * load(u + i, n), n);
      });
    }
  });
}

template <>
void qk_norm_rotary_rows<BF16>(BF16* qkv, int64_t rows, int64_t row_stride, int64_t q_heads,
                               int64_t k_heads, int64_t dim, const BF16* q_w, const BF16* k_w,
                               double eps, bool gemma, const BF16* cos, const BF16* sin) {
  const int64_t half = dim / 2, heads = q_heads + k_heads;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BF16* row = qkv + r * row_stride;
      for (int64_t h = 0; h < heads; ++h) {
        BF16* head = row + h * dim;
        const BF16* w = h < q_heads ? q_w : k_w;
        const float inv = inv_rms(head, dim, eps);
        for_each_chunk(dim, [&](int64_t i, int64_t n) {
          store(head + i, gemma ? gemma_scaled(head, w, inv, i, n)
                                : load(w + i, n) * round_bf16(load(head + i, n) * inv), n);
        });
      }
      for_each_chunk(half, [&](int64_t i, int64_t n) {
        const f32x16 c = load(cos + r * half + i, n), s = load(sin + r * half + i, n);
        for (int64_t h = 0; h < heads; ++h) {
          BF16* x1 = row + h * dim + i;
          BF16* x2 = x1 + half;
          const f32x16 a = load(x1, n), b = load(x2, n);
          store(x1, round_bf16(a * c) - round_bf16(b * s), n);
          store(x2, round_bf16(b * c) + round_bf16(a * s), n);
        }
      });
    }
  });
}

}  // namespace kvfleet_cpu
