// GEMM on GGUF block-quantized weights (engine/quant/qlinear.py): out = x @ dequant(W)^T.
//
// W is [N, K] stored as GGUF rows: each row is K / 32 blocks of one format, bytes as in the
// file (ggml's block_q8_0 / block_q4_0 / block_q4_1). Every block is dequantized into two
// 16-lane float vectors right before it is used, so the weight stays quantized in memory and
// a decode step reads 4.5-8.5 bits per weight instead of 32.
//
// Shape: built for decode (few rows of x). The rows of x are taken in tiles of up to 8, so a
// dequantized block feeds 8 rows' FMAs while it sits in registers; a larger M re-dequantizes
// the weights once per tile. For more rows the caller runs quant_panel.cpp (dequantize a
// panel once, reuse it over every row) or dequantize + BLAS; engine/quant/select.py measures
// which wins per row count.
//
// Numerics: float32 accumulation of products of float32 activations and dequantized weights
// (d * q + m computed in float32, as gguf-py and ggml dequantize); only the summation order
// differs from a dequantize-then-matmul reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "quant_blocks.h"

namespace {

using kvfleet::load16;
using kvfleet::v16;
using namespace kvfleet::quant;

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// out[m][n] for MT rows of x and weight rows [n0, n1).
template <int64_t QT, int MT>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb,
          int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes(QT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    v16 acc_lo[MT], acc_hi[MT];
    for (int m = 0; m < MT; ++m) acc_lo[m] = acc_hi[m] = v16{};
    for (int64_t b = 0; b < nb; ++b) {
      v16 lo, hi;
      dequant<QT>(wr + b * bb, lo, hi);
      const float* xb = x + b * kBlock;
      for (int m = 0; m < MT; ++m) {
        acc_lo[m] += lo * load16(xb + m * ldx);
        acc_hi[m] += hi * load16(xb + m * ldx + 16);
      }
    }
    for (int m = 0; m < MT; ++m) out[m * ldo + n] = hsum(acc_lo[m] + acc_hi[m]);
  }
}

template <int64_t QT>
void rows(const float* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
          int64_t nb, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 8 <= m_rows; m += 8) tile<QT, 8>(x + m * ldx, ldx, w, row_bytes, nb, n0, n1, out + m * ldo, ldo);
  const float* xr = x + m * ldx;
  float* o = out + m * ldo;
  switch (m_rows - m) {
    case 7: tile<QT, 7>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 6: tile<QT, 6>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 5: tile<QT, 5>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 4: tile<QT, 4>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 3: tile<QT, 3>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 2: tile<QT, 2>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    case 1: tile<QT, 1>(xr, ldx, w, row_bytes, nb, n0, n1, o, ldo); break;
    default: break;
  }
}

// out [M, N] float32 = x [M, K] float32 @ dequant(w [N, K/32 * block bytes] uint8)^T. `out`
// may be a column slice of a wider output (a fused projection's segment): rows of stride
// out.stride(0), unit column stride.
void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1,
              "quant_linear: out must be float32 [M, N] with unit column stride");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "quant_linear: K must be a multiple of 32");
  const int64_t nb = k / kBlock;
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(bb > 0, "quant_linear: unsupported GGML type ", qtype);
  TORCH_CHECK(row_bytes == nb * bb, "quant_linear: row bytes do not match K");
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n, "quant_linear: out shape");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // Grain: enough weight rows per task to amortise the task, few enough to split N evenly.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    dispatch(qtype, [&](auto qt) {
      rows<decltype(qt)::value>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, ldo);
    });
  });
}

template <int64_t QT, typename T>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, T* out) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t k = nb * kBlock;
  for (int64_t r = n0; r < n1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      v16 lo, hi;
      dequant<QT>(w + r * row_bytes + b * bb, lo, hi);
      T* o = out + r * k + b * kBlock;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(o, &lo, sizeof lo);
        std::memcpy(o + 16, &hi, sizeof hi);
      } else {
#ifdef __AVX512BF16__
        // One instruction for 32 values; c10's rounding per element made this path 10x slower.
        const __m512bh h = _mm512_cvtne2ps_pbh(__m512(hi), __m512(lo));  // lo in lanes 0-15
        std::memcpy(o, &h, sizeof h);
#else
        for (int i = 0; i < 16; ++i) o[i] = c10::BFloat16(lo[i]);
        for (int i = 0; i < 16; ++i) o[16 + i] = c10::BFloat16(hi[i]);
#endif
      }
    }
  }
}

// out [N, K] float32 or bfloat16 = dequant(w): the large-M path's weight for BLAS (float32:
// the same values as gguf-py, up to the contraction of d * q + m into one rounding; bfloat16:
// those rounded to nearest even, as a bfloat16 dense copy holds them).
void quant_dequantize(at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_dequantize: w must be contiguous uint8 [N, row bytes]");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.dim() == 2 && (bf16 || out.scalar_type() == at::kFloat) &&
                  out.is_contiguous() && out.size(0) == w.size(0) && out.size(1) % kBlock == 0,
              "quant_dequantize: out must be contiguous float32 or bfloat16 [N, K]");
  const int64_t n = w.size(0), k = out.size(1), nb = k / kBlock, row_bytes = w.size(1);
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(bb > 0 && row_bytes == nb * bb, "quant_dequantize: type or row bytes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
      if (bf16) dequant_rows<QT>(wp, row_bytes, nb, n0, n1, out.data_ptr<c10::BFloat16>());
      else dequant_rows<QT>(wp, row_bytes, nb, n0, n1, out.data_ptr<float>());
    });
  });
}

}  // namespace

TORCH_LIBRARY(kvfleet_quant, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor w, int qtype) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor w, int qtype) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
