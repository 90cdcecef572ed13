// Fused ops for Gemma's layer (its (1 + w) RMSNorm with the residual add between a block's post
// norm and the next norm, GeGLU) and for per-head q/k norms (Qwen3, Gemma 3) fused with the
// rotation: each replaces a chain of PyTorch passes over a [T, hidden] tensor by one pass per
// row. Math in transformers' op order (see fused_gemma.h).
//
// This file holds the ops' entry points (checks, dtype dispatch, registration) and the float32
// row kernels; the bfloat16 ones, which must round where PyTorch does, are in
// fused_gemma_bf16.cpp.
#include "fused_gemma.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "fused_elementwise.h"

namespace kvfleet_cpu {

namespace {

// 1 / sqrt(mean(x^2) + eps) over n floats.
inline float inv_rms(const float* x, int64_t n, double eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

}  // namespace

template <>
void gemma_norm_rows<float>(float* out, const float* x, float* residual, const float* w_x,
                            const float* w_out, int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = x + r * hidden;
      if (residual != nullptr) {
        float* rr = residual + r * hidden;
        const float inv = inv_rms(src, hidden, eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) rr[i] += src[i] * inv * (1.f + w_x[i]);
        src = rr;
      }
      const float inv = inv_rms(src, hidden, eps);
      float* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = src[i] * inv * (1.f + w_out[i]);
    }
  });
}

// gelu_tanh_mul (fused_gemma.h) per element.
template <>
void gelu_tanh_and_mul_rows<float>(float* out, const float* x, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = x + r * 2 * inter;
      const float* u = g + inter;
      float* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = gelu_tanh_mul(g[i], u[i]);
    }
  });
}

template <>
void qk_norm_rotary_rows<float>(float* qkv, int64_t rows, int64_t row_stride, int64_t q_heads,
                                int64_t k_heads, int64_t dim, const float* q_w,
                                const float* k_w, double eps, bool gemma, const float* cos,
                                const float* sin) {
  const int64_t half = dim / 2, heads = q_heads + k_heads;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = qkv + r * row_stride + h * dim;
        float* x2 = x1 + half;
        const float* w = h < q_heads ? q_w : k_w;
        const float inv = inv_rms(x1, dim, eps);
        const float bias = gemma ? 1.f : 0.f;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i] * inv * (bias + w[i]), b = x2[i] * inv * (bias + w[half + i]);
          rotate_pair(a, b, c[i], s[i], x1[i], x2[i]);
        }
      }
    }
  });
}

}  // namespace kvfleet_cpu

namespace {

using kvfleet_cpu::check;
using kvfleet_cpu::dispatch;

// residual (optional, in place) += gnorm(x, w_x); out = gnorm(residual or x, w_out).
void gemma_rms_norm(at::Tensor out, const at::Tensor& x, std::optional<at::Tensor> residual,
                    const at::Tensor& w_x, const at::Tensor& w_out, double eps) {
  const auto dtype = x.scalar_type();
  check(out, dtype, "out");
  check(x, dtype, "x");
  check(w_x, dtype, "w_x");
  check(w_out, dtype, "w_out");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(out.sizes() == x.sizes() && w_x.numel() == hidden && w_out.numel() == hidden,
              "gemma_rms_norm: out must match x and both weights must be [hidden]");
  if (residual.has_value()) {
    check(*residual, dtype, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "gemma_rms_norm: residual must match x");
  }
  dispatch(dtype, "gemma_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    kvfleet_cpu::gemma_norm_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(),
                                    residual.has_value() ? residual->data_ptr<T>() : nullptr,
                                    w_x.data_ptr<T>(), w_out.data_ptr<T>(), x.numel() / hidden,
                                    hidden, eps);
  });
}

void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  check(out, dtype, "out");
  check(x, dtype, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) / 2,
              "gelu_tanh_and_mul: x must be [T, 2I] and out [T, I]");
  dispatch(dtype, "gelu_tanh_and_mul", [&](auto tag) {
    using T = decltype(tag);
    kvfleet_cpu::gelu_tanh_and_mul_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0),
                                           x.size(1) / 2);
  });
}

// In place on qkv [T, (H + 2 KVH) * D] (rows may be strided): q and k heads normed, then rotated.
void qk_norm_rotary(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                    bool gemma, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0,
              "qk_norm_rotary: qkv must be a CPU [T, (H + 2 KVH) * D] tensor with unit column "
              "stride and an even D");
  check(q_weight, dtype, "q_weight");
  check(k_weight, dtype, "k_weight");
  TORCH_CHECK(q_weight.numel() == head_dim && k_weight.numel() == head_dim,
              "qk_norm_rotary: q_weight and k_weight must be [head_dim]");
  check(cos, dtype, "cos");
  check(sin, dtype, "sin");
  TORCH_CHECK(cos.numel() == qkv.size(0) * (head_dim / 2) && sin.sizes() == cos.sizes(),
              "qk_norm_rotary: cos and sin must be [T, head_dim / 2]");
  dispatch(dtype, "qk_norm_rotary", [&](auto tag) {
    using T = decltype(tag);
    kvfleet_cpu::qk_norm_rotary_rows<T>(qkv.data_ptr<T>(), qkv.size(0), qkv.stride(0), num_heads,
                                        num_kv_heads, head_dim, q_weight.data_ptr<T>(),
                                        k_weight.data_ptr<T>(), eps, gemma, cos.data_ptr<T>(),
                                        sin.data_ptr<T>());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("gemma_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor w_x, "
        "Tensor w_out, float eps) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("qk_norm_rotary(Tensor(a!) qkv, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor q_weight, Tensor k_weight, float eps, bool gemma, Tensor cos, Tensor sin) -> ()");
  m.impl("gemma_rms_norm", c10::DispatchKey::CPU, &gemma_rms_norm);
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &gelu_tanh_and_mul);
  m.impl("qk_norm_rotary", c10::DispatchKey::CPU, &qk_norm_rotary);
}
