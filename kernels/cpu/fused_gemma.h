// Row kernels for what Gemma 2/3 and Qwen3 add to the Llama layer, templated on the element
// type as fused_elementwise.h's: float in fused_gemma.cpp (fast-math, float rounding), bfloat16
// in fused_gemma_bf16.cpp (bit-exact with the PyTorch path of engine/models/layer_ops.py).
//
// - Gemma RMSNorm: out = (rmsnorm(x) in float32) * (1 + w), cast once (transformers'
//   Gemma2RMSNorm / Gemma3RMSNorm); with a residual, the block's post norm, the residual add
//   and the next norm in one pass: residual += gnorm(x, w_post); out = gnorm(residual, w_next).
// - GeGLU: out = gelu_tanh(gate) * up.
// - q/k norm then rotation, in place on fused qkv rows: each q head and each k head normed
//   over head_dim (Llama numerics, or Gemma's (1 + w) ones), then rotate-half RoPE.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvfleet_cpu {

// gelu_tanh(g) * u in float32. gelu_tanh(g) = g * (1 + tanh(y)) / 2 = g * sigmoid(2 y),
// y = sqrt(2 / pi) (g + 0.044715 g^3): the sigmoid form needs one exp and no cancellation where
// tanh(y) is near -1. One definition for the GeGLU row kernel (fused_gemma.cpp) and the packed
// gate/up GEMM's epilogue (panel_linear.cpp), so the fused and unfused paths round alike.
__attribute__((always_inline)) inline float gelu_tanh_mul(float g, float u) {
  constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
  const float two_y = kTwoSqrt2OverPi * (g + 0.044715f * g * g * g);
  // Clamped below expf's overflow: fast-math's division turns g / inf into NaN.
  return g / (1.f + std::exp(std::min(-two_y, 80.f))) * u;
}

// residual null: out = gnorm(x, w_out). Else residual += gnorm(x, w_x) (rounded to T);
// out = gnorm(residual, w_out). Contiguous [rows, hidden].
template <typename T>
void gemma_norm_rows(T* out, const T* x, T* residual, const T* w_x, const T* w_out,
                     int64_t rows, int64_t hidden, double eps);

// out[t, i] = gelu_tanh(x[t, i]) * x[t, inter + i] for x [rows, 2 * inter]; out [rows, inter].
template <typename T>
void gelu_tanh_and_mul_rows(T* out, const T* x, int64_t rows, int64_t inter);

// qkv rows `row_stride` elements apart, each [q heads | k heads | v heads] of `dim`: every q
// head normed by q_w and every k head by k_w (gemma: by 1 + w), then rotated by cos/sin
// [rows, dim / 2]; v untouched.
template <typename T>
void qk_norm_rotary_rows(T* qkv, int64_t rows, int64_t row_stride, int64_t q_heads,
                         int64_t k_heads, int64_t dim, const T* q_w, const T* k_w, double eps,
                         bool gemma, const T* cos, const T* sin);

// gelu_tanh of every bfloat16 bit pattern, F.gelu's own results (65,536 entries + 1 of
// padding), built on first use: call it outside parallel regions first (it runs ATen's gelu).
const uint16_t* gelu_tanh_table();

#define KVFLEET_GEMMA_ROWS(T)                                                                 \
  template <>                                                                                 \
  void gemma_norm_rows<T>(T*, const T*, T*, const T*, const T*, int64_t, int64_t, double);    \
  template <>                                                                                 \
  void gelu_tanh_and_mul_rows<T>(T*, const T*, int64_t, int64_t);                             \
  template <>                                                                                 \
  void qk_norm_rotary_rows<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, const T*,      \
                              const T*, double, bool, const T*, const T*);
KVFLEET_GEMMA_ROWS(float)
KVFLEET_GEMMA_ROWS(c10::BFloat16)
#undef KVFLEET_GEMMA_ROWS

}  // namespace kvfleet_cpu
