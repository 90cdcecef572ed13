// GEMM on GGUF K-quant (Q4_K, Q5_K, Q6_K) and Q5_0 weights: out = x @ dequant(W)^T.
//
// Same contract as quant_gemm.cpp (its ops live in the same torch library, registered here as
// a fragment so the two files build into one .so): W is [N, K] as GGUF rows of blocks, bytes as
// in the file, dequantized 32 weights at a time into two 16-lane float vectors right before the
// FMAs, so the weight stays quantized in memory (4.5 / 5.5 / 6.6 / 5.5 bits a weight).
//
// Layouts (ggml's block_q4_K / block_q5_K / block_q6_K / block_q5_0, QK_K = 256):
// - Q4_K (144 B): fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales and mins for 8 sub-blocks
//   of 32, 128 bytes of nibbles; sub-block j reads bytes 32 * (j / 2).. (low nibbles for even
//   j, high for odd). w = (d * sc_j) * q - (dmin * m_j).
// - Q5_K (176 B): Q4_K's header, 32 bytes of high bits (bit j of byte t is element t of
//   sub-block j), then Q4_K's nibbles; q = nibble | high << 4.
// - Q6_K (210 B): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per
//   16 weights), fp16 d; w = (d * scale) * (q - 32).
// - Q5_0 (22 B, blocks of 32): fp16 d, 32 high bits, 16 bytes of nibbles; w = d * (q - 16).
//   llama.cpp's K-quant mixes use it wherever K is not a multiple of 256 (Gemma 3 270M: 640).
//
// Numerics: each weight is computed with gguf-py's operations and order (the scale products
// are exact in float32: an fp16 times a 6/8-bit integer), so `kquant_dequantize` equals
// gguf-py bit for bit; the GEMM accumulates float32 products, only the summation order
// differs from dequantize-then-matmul.
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
#include "quant_blocks.h"

namespace {

using kvfleet::load16;
using kvfleet::v16;
using kvfleet::v16i;
using kvfleet::v16u;

// The fp16 and byte loads every GGUF block format shares (quant_blocks.h).
using kvfleet::quant::bytes16;
using kvfleet::quant::half_at;
using kvfleet::quant::v16b;

// ggml's type ids (GGMLQuantizationType).
constexpr int64_t kQ5_0 = 6, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

inline v16i widen(v16b b) { return __builtin_convertvector(b, v16i); }

inline v16 to_float(v16i v) { return __builtin_convertvector(v, v16); }

// Weights per block, bytes per block, 32-weight sub-blocks per block.
template <int64_t QT>
struct Layout {
  static constexpr int64_t weights = QT == kQ5_0 ? 32 : 256;
  static constexpr int64_t bytes = QT == kQ5_0 ? 22 : QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : 210;
  static constexpr int64_t subs = weights / 32;
};

// Per-block scales, decoded once and used by every sub-block: scale[j] for the first 16 and
// scale2[j] for the last 16 weights of sub-block j (they differ only in Q6_K), min[j].
struct Scales {
  float scale[8], scale2[8], min[8];
};

// Q4_K / Q5_K's 6-bit scales and mins (ggml's get_scale_min_k4).
inline void k4_scales(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <int64_t QT>
inline void prepare(const uint8_t* blk, Scales& s) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scales(blk + 4, j, sc, m);
      s.scale[j] = s.scale2[j] = d * static_cast<float>(sc);
      s.min[j] = dmin * static_cast<float>(m);
    }
  } else if constexpr (QT == kQ6_K) {
    const float d = half_at(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int j = 0; j < 8; ++j) {
      s.scale[j] = d * static_cast<float>(sc[2 * j]);
      s.scale2[j] = d * static_cast<float>(sc[2 * j + 1]);
    }
  } else {  // Q5_0
    s.scale[0] = s.scale2[0] = half_at(blk);
  }
}

// Elements 0..15 of sub-block j into `lo`, 16..31 into `hi`.
template <int64_t QT>
inline void dequant(const uint8_t* blk, const Scales& s, int j, v16& lo, v16& hi) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* qs = blk + (QT == kQ4_K ? 16 : 48) + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    v16i a = widen((bytes16(qs) >> shift) & 15), b = widen((bytes16(qs + 16) >> shift) & 15);
    if constexpr (QT == kQ5_K) {
      const uint8_t* qh = blk + 16;
      a |= widen((bytes16(qh) >> j) & 1) << 4;
      b |= widen((bytes16(qh + 16) >> j) & 1) << 4;
    }
    lo = to_float(a) * s.scale[j] - s.min[j];
    hi = to_float(b) * s.scale[j] - s.min[j];
  } else if constexpr (QT == kQ6_K) {
    const int h = j / 4, quarter = j % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (quarter & 1);
    const uint8_t* qh = blk + 128 + 32 * h;
    const int lshift = 4 * (quarter / 2), hshift = 2 * quarter;
    const v16i a = (widen((bytes16(ql) >> lshift) & 15) |
                    (widen((bytes16(qh) >> hshift) & 3) << 4)) - 32;
    const v16i b = (widen((bytes16(ql + 16) >> lshift) & 15) |
                    (widen((bytes16(qh + 16) >> hshift) & 3) << 4)) - 32;
    lo = to_float(a) * s.scale[j];
    hi = to_float(b) * s.scale2[j];
  } else {  // Q5_0
    uint32_t bits;
    std::memcpy(&bits, blk + 2, sizeof bits);
    const v16u iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16u high = v16u{} + bits;
    const v16b q = bytes16(blk + 6);
    const v16i a = (widen(q & 15) | __builtin_convertvector(((high >> iota) & 1) << 4, v16i)) - 16;
    const v16i b = (widen(q >> 4) |
                    __builtin_convertvector(((high >> (iota + 16)) & 1) << 4, v16i)) - 16;
    lo = to_float(a) * s.scale[0];
    hi = to_float(b) * s.scale[0];
  }
}

// out[m][n] for MT rows of x and weight rows [n0, n1).
template <int64_t QT, int MT>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb,
          int64_t n0, int64_t n1, float* out, int64_t ldo) {
  using L = Layout<QT>;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    v16 acc_lo[MT], acc_hi[MT];
    for (int m = 0; m < MT; ++m) acc_lo[m] = acc_hi[m] = v16{};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wr + b * L::bytes;
      Scales s;
      prepare<QT>(blk, s);
      for (int j = 0; j < L::subs; ++j) {
        v16 lo, hi;
        dequant<QT>(blk, s, j, lo, hi);
        const float* xb = x + b * L::weights + 32 * j;
        for (int m = 0; m < MT; ++m) {
          acc_lo[m] += lo * load16(xb + m * ldx);
          acc_hi[m] += hi * load16(xb + m * ldx + 16);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m * ldo + n] = kvfleet::hsum(acc_lo[m] + acc_hi[m]);
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

template <int64_t QT>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t k, int64_t r0,
                  int64_t r1, float* out) {
  using L = Layout<QT>;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + r * row_bytes + b * L::bytes;
      Scales s;
      prepare<QT>(blk, s);
      for (int j = 0; j < L::subs; ++j) {
        v16 lo, hi;
        dequant<QT>(blk, s, j, lo, hi);
        float* o = out + r * k + b * L::weights + 32 * j;
        std::memcpy(o, &lo, sizeof lo);
        std::memcpy(o + 16, &hi, sizeof hi);
      }
    }
  }
}

// Weights per block and bytes per block of `qtype`; weights 0 for a type not handled here.
void layout_of(int64_t qtype, int64_t& weights, int64_t& bytes) {
  weights = bytes = 0;
  if (qtype == kQ5_0) weights = Layout<kQ5_0>::weights, bytes = Layout<kQ5_0>::bytes;
  if (qtype == kQ4_K) weights = Layout<kQ4_K>::weights, bytes = Layout<kQ4_K>::bytes;
  if (qtype == kQ5_K) weights = Layout<kQ5_K>::weights, bytes = Layout<kQ5_K>::bytes;
  if (qtype == kQ6_K) weights = Layout<kQ6_K>::weights, bytes = Layout<kQ6_K>::bytes;
}

// out [M, N] float32 = x [M, K] float32 @ dequant(w [N, K / weights * bytes] uint8)^T.
void kquant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "kquant_linear: x must be float32 [M, K] with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "kquant_linear: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "kquant_linear: out");
  int64_t weights, bytes;
  layout_of(qtype, weights, bytes);
  TORCH_CHECK(weights > 0, "kquant_linear: unsupported GGML type ", qtype);
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % weights == 0, "kquant_linear: K must be a multiple of ", weights);
  const int64_t nb = k / weights;
  TORCH_CHECK(row_bytes == nb * bytes, "kquant_linear: row bytes do not match K");
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n, "kquant_linear: out shape");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case kQ5_0: rows<kQ5_0>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n); break;
      case kQ4_K: rows<kQ4_K>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n); break;
      case kQ5_K: rows<kQ5_K>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n); break;
      default: rows<kQ6_K>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, op, n); break;
    }
  });
}

// out [N, K] float32 = dequant(w), equal to gguf-py's values (the large-M path's input to BLAS).
void kquant_dequantize(at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "kquant_dequantize: w must be contiguous uint8 [N, row bytes]");
  int64_t weights, bytes;
  layout_of(qtype, weights, bytes);
  TORCH_CHECK(weights > 0, "kquant_dequantize: unsupported GGML type ", qtype);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == w.size(0) && out.size(1) % weights == 0,
              "kquant_dequantize: out must be contiguous float32 [N, K]");
  const int64_t n = w.size(0), k = out.size(1), nb = k / weights, row_bytes = w.size(1);
  TORCH_CHECK(row_bytes == nb * bytes, "kquant_dequantize: row bytes do not match K");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    switch (qtype) {
      case kQ5_0: dequant_rows<kQ5_0>(wp, row_bytes, nb, k, r0, r1, op); break;
      case kQ4_K: dequant_rows<kQ4_K>(wp, row_bytes, nb, k, r0, r1, op); break;
      case kQ5_K: dequant_rows<kQ5_K>(wp, row_bytes, nb, k, r0, r1, op); break;
      default: dequant_rows<kQ6_K>(wp, row_bytes, nb, k, r0, r1, op); break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_quant, m) {
  m.def("kquant_linear(Tensor(a!) out, Tensor x, Tensor w, int qtype) -> ()");
  m.def("kquant_dequantize(Tensor(a!) out, Tensor w, int qtype) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("kquant_linear", &kquant_linear);
  m.impl("kquant_dequantize", &kquant_dequantize);
}
