// Fused elementwise ops for the CPU decoder layer. Each replaces several PyTorch passes over a
// [T, hidden] tensor with one pass per row, so large prefill batches stay in cache instead of
// streaming every intermediate through memory. Math follows transformers' op order (RMSNorm in
// float32: x * rsqrt(mean(x^2) + eps), then weight * x; SiLU gate times up; rotate-half RoPE).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

constexpr int64_t kGrain = 16;

// residual (optional) += x; out = weight * rmsnorm(residual or x). All float32, contiguous rows.
void rms_norm_rows(float* out, float* x, float* residual, const float* weight, int64_t rows,
                   int64_t hidden, double eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
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

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 tensor");
}

void rms_norm(at::Tensor out, at::Tensor x, const at::Tensor& weight, double eps) {
  check_f32(out, "out");
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t hidden = x.size(-1);
  rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), nullptr, weight.data_ptr<float>(),
                x.numel() / hidden, hidden, eps);
}

// residual += x; out = rmsnorm(residual) * weight.
void add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                  double eps) {
  check_f32(out, "out");
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  const int64_t hidden = x.size(-1);
  rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), residual.data_ptr<float>(),
                weight.data_ptr<float>(), x.numel() / hidden, hidden, eps);
}

// out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I].
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_f32(out, "out");
  check_f32(x, "x");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * 2 * inter;
      const float* u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

// In place on x [T, heads, D] (rows may be strided by `row_stride` floats): rotate-half RoPE
// with cos/sin [T, D/2].
void rotary_rows(float* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                 const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * half;
      const float* s = sin + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = x + r * row_stride + h * dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// q and k are views into one fused qkv tensor [T, (H + 2 KVH) * D]: rotate both in place.
void rotary_qk(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               const at::Tensor& cos, const at::Tensor& sin) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t rows = qkv.size(0), stride = qkv.size(1);
  float* base = qkv.data_ptr<float>();
  rotary_rows(base, rows, num_heads, head_dim, stride, cos.data_ptr<float>(),
              sin.data_ptr<float>());
  rotary_rows(base + num_heads * head_dim, rows, num_kv_heads, head_dim, stride,
              cos.data_ptr<float>(), sin.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_qk(Tensor(a!) qkv, int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary_qk", c10::DispatchKey::CPU, &rotary_qk);
}
