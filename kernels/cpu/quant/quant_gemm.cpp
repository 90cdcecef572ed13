// GEMM on GGUF block-quantized weights (engine/quant/qlinear.py): out = x @ dequant(W)^T.
//
// W is [N, K] stored as GGUF rows: each row is K / 32 blocks of one format, bytes as in the
// file (ggml's block_q8_0 / block_q4_0 / block_q4_1). Every block is dequantized into two
// 16-lane float vectors right before it is used, so the weight stays quantized in memory and
// a decode step reads 4.5-8.5 bits per weight instead of 32.
//
// Shape: built for decode (few rows of x). The rows of x are taken in tiles of up to 8, so a
// dequantized block feeds 8 rows' FMAs while it sits in registers; a larger M re-dequantizes
// the weights once per tile (the caller dequantizes a whole weight and calls BLAS instead when
// M is large: engine/quant/qlinear.py measures where that wins).
//
// Numerics: float32 accumulation of products of float32 activations and dequantized weights
// (d * q + m computed in float32, as gguf-py and ggml dequantize); only the summation order
// differs from a dequantize-then-matmul reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "../simd.h"

namespace {

using kvfleet::load16;
using kvfleet::v16;

typedef uint8_t v16b __attribute__((vector_size(16)));

// ggml's type ids (GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

inline float half_at(const uint8_t* p) {
#ifdef __F16C__
  // One instruction; c10::Half's portable conversion is a dozen, per block of 32 weights.
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
#else
  c10::Half h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
#endif
}

inline v16b bytes16(const uint8_t* p) {
  v16b b;
  std::memcpy(&b, p, sizeof b);
  return b;
}

// Widen to int32 first: GCC scalarises a direct uint8 -> float vector conversion.
inline v16 to_float(v16b b) {
  return __builtin_convertvector(__builtin_convertvector(b, kvfleet::v16i), v16);
}

// Elements 0..15 of a block into `lo`, 16..31 into `hi`.
template <int64_t QT>
inline void dequant(const uint8_t* blk, v16& lo, v16& hi) {
  if constexpr (QT == kQ8_0) {
    const float d = half_at(blk);
    // Bytes as unsigned, re-centred (q ^ 0x80 is q + 128): the unsigned widening vectorises.
    lo = (to_float(bytes16(blk + 2) ^ 0x80) - 128.f) * d;
    hi = (to_float(bytes16(blk + 18) ^ 0x80) - 128.f) * d;
  } else if constexpr (QT == kQ4_0) {
    const float d = half_at(blk);
    const v16b q = bytes16(blk + 2);
    lo = (to_float(q & 15) - 8.f) * d;
    hi = (to_float(q >> 4) - 8.f) * d;
  } else {  // Q4_1
    const float d = half_at(blk), m = half_at(blk + 2);
    const v16b q = bytes16(blk + 4);
    lo = to_float(q & 15) * d + m;
    hi = to_float(q >> 4) * d + m;
  }
}

template <int64_t QT>
constexpr int64_t block_bytes() {
  return QT == kQ8_0 ? 34 : QT == kQ4_0 ? 18 : 20;
}

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// out[m][n] for MT rows of x and weight rows [n0, n1).
template <int64_t QT, int MT>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb,
          int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes<QT>();
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

// out [M, N] float32 = x [M, K] float32 @ dequant(w [N, K/32 * block bytes] uint8)^T.
void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "quant_linear: out");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "quant_linear: K must be a multiple of 32");
  const int64_t nb = k / kBlock;
  const int64_t bb = qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : -1;
  TORCH_CHECK(bb > 0, "quant_linear: unsupported GGML type ", qtype);
  TORCH_CHECK(row_bytes == nb * bb, "quant_linear: row bytes do not match K");
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n, "quant_linear: out shape");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Grain: enough weight rows per task to amortise the task, few enough to split N evenly.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    if (qtype == kQ8_0) rows<kQ8_0>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n);
    else if (qtype == kQ4_0) rows<kQ4_0>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n);
    else rows<kQ4_1>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n);
  });
}

// out [N, K] float32 = dequant(w): the large-M path's tile for BLAS (same values as gguf-py,
// up to the contraction of d * q + m into one rounding).
void quant_dequantize(at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_dequantize: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == w.size(0) && out.size(1) % kBlock == 0,
              "quant_dequantize: out must be contiguous float32 [N, K]");
  const int64_t n = w.size(0), k = out.size(1), nb = k / kBlock, row_bytes = w.size(1);
  const int64_t bb = qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : -1;
  TORCH_CHECK(bb > 0 && row_bytes == nb * bb, "quant_dequantize: type or row bytes");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        v16 lo, hi;
        const uint8_t* blk = wp + r * row_bytes + b * bb;
        if (qtype == kQ8_0) dequant<kQ8_0>(blk, lo, hi);
        else if (qtype == kQ4_0) dequant<kQ4_0>(blk, lo, hi);
        else dequant<kQ4_1>(blk, lo, hi);
        std::memcpy(op + r * k + b * kBlock, &lo, sizeof lo);
        std::memcpy(op + r * k + b * kBlock + 16, &hi, sizeof hi);
      }
    }
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
