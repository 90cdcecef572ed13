// Row kernels behind the fused elementwise ops, templated on the element type.
//
// Each specialisation reproduces what the PyTorch path (engine/models/layer_ops.py) computes for
// its dtype, so the two paths are interchangeable:
// - float: defined in fused_elementwise.cpp (compiled with -ffast-math; matches the PyTorch
//   path to float rounding, not bit for bit).
// - c10::BFloat16: defined in fused_elementwise_bf16.cpp, which is compiled without fast-math's
//   licences so that every rounding point and the order of the float32 sum of squares are
//   those of PyTorch's CPU kernels (bit-exact).
// The primary templates are declared only: other dtypes are refused before reaching them.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace kvfleet_cpu {

// For the ops' entry points (fused_elementwise.cpp, fused_gemma.cpp): runs `body` with T the
// C++ type of `dtype`, float32 or bfloat16, the dtypes with row kernels.
template <typename F>
inline void dispatch(at::ScalarType dtype, const char* op, F&& body) {
  if (dtype == at::kFloat) {
    body(float{});
  } else if (dtype == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "kvfleet_cpu::", op, ": float32 or bfloat16 only, got ", dtype);
  }
}

inline void check(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), name,
              " must be a contiguous CPU ", dtype, " tensor");
}

// Rows handed to one at::parallel_for task.
constexpr int64_t kRowGrain = 16;

// residual (optional) += x; out = weight * rmsnorm(residual or x). Contiguous [rows, hidden].
template <typename T>
void rms_norm_rows(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t hidden,
                   double eps);

// out[t, i] = silu(x[t, i]) * x[t, inter + i] for x [rows, 2 * inter]; out [rows, inter].
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t inter);

// In place on x [rows, heads, dim] whose rows start `row_stride` elements apart: rotate-half
// RoPE with cos/sin [rows, dim / 2].
template <typename T>
void rotary_rows(T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                 const T* cos, const T* sin);

// One rotate-half RoPE pair: (a, b) = a head's elements i and i + dim / 2, (c, s) = cos and
// sin of their angle. The float32 expression of both rotations (rotary_rows here, and
// qk_norm_rotary_rows in fused_gemma.cpp after the norm), kept in one place so that the two
// ops round identically; inlined into their `omp simd` loops.
inline void rotate_pair(float a, float b, float c, float s, float& x1, float& x2) {
  x1 = a * c - b * s;
  x2 = b * c + a * s;
}

// kv_cache[0][slot[i]] = k rows, kv_cache[1][slot[i]] = v rows, i < t: row i's head h starts
// at k_src + i * ks0 + h * ks1 (element strides, unit stride over D), in the cache's dtype.
// Checks the cache's layout and the slots (kv_cache_write.cpp).
void copy_kv_rows(at::Tensor& kv_cache, const char* k_src, int64_t ks0, int64_t ks1,
                  const char* v_src, int64_t vs0, int64_t vs1, int64_t t,
                  const at::Tensor& slot_mapping);

template <>
void rms_norm_rows<float>(float*, float*, float*, const float*, int64_t, int64_t, double);
template <>
void silu_and_mul_rows<float>(float*, const float*, int64_t, int64_t);
template <>
void rotary_rows<float>(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*);

template <>
void rms_norm_rows<c10::BFloat16>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16*,
                                  const c10::BFloat16*, int64_t, int64_t, double);
template <>
void silu_and_mul_rows<c10::BFloat16>(c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t);
template <>
void rotary_rows<c10::BFloat16>(c10::BFloat16*, int64_t, int64_t, int64_t, int64_t,
                                const c10::BFloat16*, const c10::BFloat16*);

}  // namespace kvfleet_cpu
