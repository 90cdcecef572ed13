// Fused elementwise ops for the CPU decoder layer. Each replaces several PyTorch passes over a
// [T, hidden] tensor with one pass per row, so large prefill batches stay in cache instead of
// streaming every intermediate through memory. Math follows transformers' op order (RMSNorm in
// float32: x * rsqrt(mean(x^2) + eps), then weight * x; SiLU gate times up; rotate-half RoPE).
//
// This file holds the ops' entry points (checks, dtype dispatch, registration) and the float32
// row kernels; the bfloat16 ones, which must round exactly where PyTorch does, live in
// fused_elementwise_bf16.cpp (see fused_elementwise.h).
#include "fused_elementwise.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace kvfleet_cpu {

// residual (optional) += x; out = weight * rmsnorm(residual or x). All float32, contiguous rows.
template <>
void rms_norm_rows<float>(float* out, float* x, float* residual, const float* weight,
                          int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * hidden;
      float* src = xr;
      if (residual != nullptr) {
        float* rr = residual + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) rr[i] += xr[i];
        src = rr;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += src[i] * src[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      float* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (src[i] * inv);
    }
  });
}

template <>
void silu_and_mul_rows<float>(float* out, const float* x, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = x + r * 2 * inter;
      const float* u = g + inter;
      float* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

template <>
void rotary_rows<float>(float* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                        const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = x + r * row_stride + h * dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          rotate_pair(x1[i], x2[i], c[i], s[i], x1[i], x2[i]);
        }
      }
    }
  });
}

}  // namespace kvfleet_cpu

namespace {

using kvfleet_cpu::rms_norm_rows;
using kvfleet_cpu::rotary_rows;
using kvfleet_cpu::silu_and_mul_rows;
using kvfleet_cpu::check;
using kvfleet_cpu::dispatch;

// The norm and SiLU ops allocate their output here rather than take one from Python: an
// empty_like from Python costs ~1 us a call, ~90 calls a decode step. Every element is written.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  const auto dtype = x.scalar_type();
  check(x, dtype, "x");
  check(weight, dtype, "weight");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(-1);
  dispatch(dtype, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), nullptr,
                     weight.data_ptr<T>(), x.numel() / hidden, hidden, eps);
  });
  return out;
}

// residual += x; returns rmsnorm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& x_in, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  const at::Tensor x = x_in.contiguous();
  const auto dtype = x.scalar_type();
  check(x, dtype, "x");
  check(residual, dtype, "residual");
  check(weight, dtype, "weight");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(-1);
  dispatch(dtype, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(),
                     residual.data_ptr<T>(), weight.data_ptr<T>(), x.numel() / hidden, hidden,
                     eps);
  });
  return out;
}

// Returns out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  check(x, dtype, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(dtype, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0), x.size(1) / 2);
  });
  return out;
}

// q and k are views into one fused qkv tensor [T, (H + 2 KVH) * D] (its rows may be strided,
// e.g. a column slice of a wider buffer): rotate both in place.
void rotary_qk(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be a CPU [T, (H + 2 KVH) * D] tensor with unit column stride");
  check(cos, dtype, "cos");
  check(sin, dtype, "sin");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.numel() == qkv.size(0) * (head_dim / 2) &&
                  sin.sizes() == cos.sizes(),
              "cos and sin must be [T, head_dim / 2]");
  const int64_t rows = qkv.size(0), stride = qkv.stride(0);
  dispatch(dtype, "rotary_qk", [&](auto tag) {
    using T = decltype(tag);
    T* base = qkv.data_ptr<T>();
    rotary_rows<T>(base, rows, num_heads, head_dim, stride, cos.data_ptr<T>(),
                   sin.data_ptr<T>());
    rotary_rows<T>(base + num_heads * head_dim, rows, num_kv_heads, head_dim, stride,
                   cos.data_ptr<T>(), sin.data_ptr<T>());
  });
}

// rotary_qk, then this step's (rotated) k and v rows of qkv written to their cache slots: what
// rotary_qk followed by write_kv_cache does, in one call (one dispatch and no key/value views
// built in Python, per layer).
void rotary_qk_write_kv(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == qkv.scalar_type() && kv_cache.dim() == 5 &&
                  kv_cache.size(3) == num_kv_heads && kv_cache.size(4) == head_dim,
              "kv_cache must be [2, num_blocks, block_size, KVH, D] of qkv's dtype");
  rotary_qk(qkv, num_heads, num_kv_heads, head_dim, cos, sin);
  const int64_t elem = qkv.element_size();
  const char* k = static_cast<const char*>(qkv.data_ptr()) + num_heads * head_dim * elem;
  const char* v = k + num_kv_heads * head_dim * elem;
  kvfleet_cpu::copy_kv_rows(kv_cache, k, qkv.stride(0), head_dim, v, qkv.stride(0), head_dim,
                            qkv.size(0), slot_mapping);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_qk(Tensor(a!) qkv, int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary_qk_write_kv(Tensor(a!) qkv, int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("rotary_qk", c10::DispatchKey::CPU, &rotary_qk);
  m.impl("rotary_qk_write_kv", c10::DispatchKey::CPU, &rotary_qk_write_kv);
}
