// bfloat16 row kernels for the fused elementwise ops, bit-exact with the PyTorch path of
// engine/models/layer_ops.py (transformers' op order) on this torch build.
//
// The PyTorch path is a chain of ops, each rounding its result to bfloat16; these kernels keep
// every intermediate in float32 registers but round exactly where an op boundary would:
// - residual += x: float add, rounded to bf16 (stored in place).
// - RMSNorm: h = float(r); mean(h * h) summed in the order of PyTorch's CPU sum kernel (below);
//   inv = 1 / sqrt(mean + eps) correctly rounded; bf16(weight * bf16(h * inv)).
// - SiLU-and-mul: bf16(silu(g) * up), silu(g) read from a table of F.silu's own bf16 results.
// - RoPE: bf16(bf16(x1 * cos) - bf16(x2 * sin)), bf16(bf16(x2 * cos) + bf16(x1 * sin)).
// Products of two bf16 values are exact in float32, so only sums, the division and the square
// root can round differently; the sum's order is therefore reproduced, not just its value.
//
// The build passes -ffast-math (for the float32 kernels' vectorised expf), which would let the
// compiler reassociate the sum, contract h * h + acc into an FMA, replace 1 / sqrt and the
// division by approximations, and drop the NaN test of the rounding. This file opts out of all
// of that; the pragma precedes every include so that inline header code gets the same options.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif

#include "bf16_rows.h"
#include "fused_elementwise.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace kvfleet_cpu {

using namespace kvfleet_bf16;  // NOLINT: the row helpers

namespace {

at::Tensor silu_of(const at::Tensor& x) { return at::silu(x); }

const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = unary_table(&silu_of);
  return table.data();
}

}  // namespace

template <>
void rms_norm_rows<BF16>(BF16* out, BF16* x, BF16* residual, const BF16* weight, int64_t rows,
                         int64_t hidden, double eps) {
  const float eps_f = static_cast<float>(eps);  // PyTorch adds the Python float as a float32
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* src = x + r * hidden;
      if (residual != nullptr) {
        BF16* rr = residual + r * hidden;
        const BF16* xr = src;
        for_each_chunk(hidden, [&](int64_t i, int64_t n) {
          store(rr + i, load(rr + i, n) + load(xr + i, n), n);
        });
        src = rr;
      }
      // mean is sum / n and rsqrt is 1 / sqrt, each correctly rounded, as in ATen.
      const float mean = sum_of_squares(src, hidden) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(mean + eps_f);
      BF16* o = out + r * hidden;
      for_each_chunk(hidden, [&](int64_t i, int64_t n) {
        store(o + i, load(weight + i, n) * round_bf16(load(src + i, n) * inv), n);
      });
    }
  });
}

template <>
void silu_and_mul_rows<BF16>(BF16* out, const BF16* x, int64_t rows, int64_t inter) {
  const uint16_t* silu = silu_table();  // built here, outside the parallel region
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* g = x + r * 2 * inter;
      const BF16* u = g + inter;
      BF16* o = out + r * inter;
      for_each_chunk(inter, [&](int64_t i, int64_t n) {
        store(o + i, lookup(silu, g + i, n) * load(u + i, n), n);
      });
    }
  });
}

template <>
void rotary_rows<BF16>(BF16* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                       const BF16* cos, const BF16* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BF16* row = x + r * row_stride;
      // Chunks outermost: a row's cos/sin chunk is loaded once for all its heads.
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
