// GEMM on GGUF block-quantized weights (engine/quant/qlinear.py): out = x @ dequant(W)^T.
//
// W is [N, K] stored as GGUF rows: each row is K / 32 blocks of one format, bytes as in the
// file (ggml's block_q8_0 / block_q4_0 / block_q4_1). Every block is dequantized into two
// 16-lane float vectors right before it is used, so the weight stays quantized in memory and
// a decode step reads 4.5-8.5 bits per weight instead of 32.
//
// Shape: built for decode (few rows of x). One row of x (batch-1 decode) runs 4 weight rows
// at a time against each x load, with the next rows prefetched: at batch 1 the step is the
// weights streamed from DRAM, and the block decode is a table lookup (dequant_fast). 2-8 rows
// of x are taken in tiles of up to 8, so a dequantized block feeds 8 rows' FMAs while it sits
// in registers; a larger M re-dequantizes the weights once per tile. For more rows the caller
// runs quant_panel.cpp (dequantize a panel once, reuse it over every row) or dequantize +
// BLAS; engine/quant/select.py measures which wins per row count.
//
// One bfloat16 row of a Q4_0 / Q4_1 weight (batch-1 decode of a bfloat16 model) goes to the
// factored kernel of quant_gemv_bf16.h instead (exact integer nibbles times x by vdpbf16ps,
// the block's scale and minimum applied after), where the compiler targets it.
//
// Numerics: float32 accumulation of products of float32 activations and dequantized weights
// (d * q + m computed in float32, as gguf-py and ggml dequantize; the same values on every
// path); only the summation order differs from a dequantize-then-matmul reference. bfloat16
// activations are widened exactly and the float32 result rounded once to bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "quant_blocks.h"
#include "quant_gemv_bf16.h"

namespace {

using kvfleet::load16;
using kvfleet::v16;
using namespace kvfleet::quant;

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Weight rows ahead of the ones being read that each block load prefetches: the hardware
// prefetcher alone streamed a decode step's weights from DRAM at ~4 GB/s on one Zen 4 core,
// two thirds of the core's read bandwidth; 8 rows (3-8 KiB for the default model) covers
// the latency.
constexpr int64_t kPrefetchRows = 8;

// The block's weights as dequant() gives them, in fewer instructions where AVX-512 is there:
// Q4 formats through the block's 16 possible values (d * i (+ m) for i = 0..15, computed as
// dequant() computes each weight) and a lane permute per nibble (vpermps reads the low 4 bits
// of each index, so the low nibble needs no mask); Q8_0 by a signed widening (d * q is exact
// in float32 either way).
template <int64_t QT>
__attribute__((always_inline)) inline void dequant_fast(const uint8_t* blk, v16& lo, v16& hi) {
#ifdef __AVX512F__
  if constexpr (QT == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_at(blk));
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    lo = v16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d));
    hi = v16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d));
  } else {
    const v16 iota = kvfleet::kIota;
    const v16 table = QT == kQ4_0 ? (iota - 8.f) * half_at(blk)
                                  : iota * half_at(blk) + half_at(blk + 2);
    const __m512i z = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_0 ? 2 : 4))));
    lo = v16(_mm512_permutexvar_ps(z, __m512(table)));
    hi = v16(_mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), __m512(table)));
  }
#else
  dequant<QT>(blk, lo, hi);
#endif
}

// One row of x against weight rows [n0, n1), RT rows at a time: RT independent accumulator
// chains (one row's chain is bound by the FMA latency) sharing each x load.
template <int64_t QT, int RT, typename O>
void row_tile(const float* x, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0,
              int64_t n1, O* out) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t ahead = kPrefetchRows * row_bytes;
  for (int64_t n = n0; n + RT <= n1; n += RT) {
    const uint8_t* wr = w + n * row_bytes;
    v16 acc_lo[RT], acc_hi[RT];
    for (int r = 0; r < RT; ++r) acc_lo[r] = acc_hi[r] = v16{};
    for (int64_t b = 0; b < nb; ++b) {
      const v16 x_lo = load16(x + b * kBlock), x_hi = load16(x + b * kBlock + 16);
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) {
        const uint8_t* blk = wr + r * row_bytes + b * bb;
        __builtin_prefetch(blk + ahead);  // past the tensor's end it is a no-op, never a fault
        v16 lo, hi;
        dequant_fast<QT>(blk, lo, hi);
        acc_lo[r] += lo * x_lo;
        acc_hi[r] += hi * x_hi;
      }
    }
    for (int r = 0; r < RT; ++r) out[n + r] = O(hsum(acc_lo[r] + acc_hi[r]));
  }
}

// Q4: 4 weight rows per pass (measured 10-20% faster than one with the weights in cache, level
// from DRAM) where the rows are short; rows of kOneStreamRowBytes or more one at a time (four
// interleaved long rows are four DRAM streams: quant_gemv_bf16.h). Q8_0: one row per pass —
// four interleaved streams of 34-byte blocks read from DRAM at a fifth of one stream's speed
// on Zen 4, prefetch or not. Each row's sums are the same either way.
template <int64_t QT, typename O>
void one_row(const float* x, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0,
             int64_t n1, O* out) {
  constexpr int RT = QT == kQ8_0 ? 1 : 4;
  const int64_t tiled =
      row_bytes >= kOneStreamRowBytes ? n0 : n0 + (n1 - n0) / RT * RT;
  row_tile<QT, RT>(x, w, row_bytes, nb, n0, tiled, out);
  row_tile<QT, 1>(x, w, row_bytes, nb, tiled, n1, out);
}

// out[m][n] for MT rows of x and weight rows [n0, n1).
template <int64_t QT, int MT, typename O>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb,
          int64_t n0, int64_t n1, O* out, int64_t ldo) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t ahead = kPrefetchRows * row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    v16 acc_lo[MT], acc_hi[MT];
    for (int m = 0; m < MT; ++m) acc_lo[m] = acc_hi[m] = v16{};
    for (int64_t b = 0; b < nb; ++b) {
      __builtin_prefetch(wr + b * bb + ahead);
      v16 lo, hi;
      dequant_fast<QT>(wr + b * bb, lo, hi);
      const float* xb = x + b * kBlock;
      for (int m = 0; m < MT; ++m) {
        acc_lo[m] += lo * load16(xb + m * ldx);
        acc_hi[m] += hi * load16(xb + m * ldx + 16);
      }
    }
    for (int m = 0; m < MT; ++m) out[m * ldo + n] = O(hsum(acc_lo[m] + acc_hi[m]));
  }
}

template <int64_t QT, typename O>
void rows(const float* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
          int64_t nb, int64_t n0, int64_t n1, O* out, int64_t ldo) {
  if (m_rows == 1) {
    one_row<QT>(x, w, row_bytes, nb, n0, n1, out);
    return;
  }
  int64_t m = 0;
  for (; m + 8 <= m_rows; m += 8) tile<QT, 8>(x + m * ldx, ldx, w, row_bytes, nb, n0, n1, out + m * ldo, ldo);
  const float* xr = x + m * ldx;
  O* o = out + m * ldo;
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

// out [1, N] bfloat16 = x [1, K] bfloat16 @ dequant(w)^T for Q4_0 / Q4_1 by the factored
// bfloat16 kernel (quant_gemv_bf16.h); quant_has_q4_gemv_bf16() says whether it was built.
void quant_gemv_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16 &&
                  x.stride(1) == 1,
              "quant_gemv_bf16: x must be bfloat16 [1, K] with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_gemv_bf16: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, "quant_gemv_bf16: qtype must be Q4_0 or Q4_1, got ",
              qtype);
  const int64_t k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % kBlock == 0 && row_bytes == k / kBlock * block_bytes(qtype),
              "quant_gemv_bf16: K must be a multiple of 32 matching w's row bytes");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.size(0) == 1 &&
                  out.size(1) == n && out.stride(1) == 1,
              "quant_gemv_bf16: out must be bfloat16 [1, N] with unit column stride");
#ifdef KVFLEET_Q4_GEMV_BF16
  const int64_t nb = k / kBlock;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  dispatch(qtype, [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    if constexpr (QT != kQ8_0) {
      const Q4RowX<QT> xr(xp, nb);
      at::parallel_for(0, (n + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
        q4_gemv_bf16<QT>(xr, xp, wp, row_bytes, nb, t0 * 4, std::min(n, t1 * 4),
                         kPrefetchRows * row_bytes, op);
      });
    }
  });
#else
  TORCH_CHECK(false, "quant_gemv_bf16: not built (needs AVX512_BF16 and AVX512VL)");
#endif
}

bool quant_has_q4_gemv_bf16() {
#ifdef KVFLEET_Q4_GEMV_BF16
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ dequant(w [N, K/32 * block bytes] uint8)^T, x and out both float32
// or both bfloat16 (a bfloat16 model: x widened to float32 once, exactly, and each output
// rounded to nearest even, as a float32 GEMM then `.to(bfloat16)` would give). `out` may be
// a column slice of a wider output (a fused projection's segment): rows of stride
// out.stride(0), unit column stride.
void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.stride(1) == 1,
              "quant_linear: x must be float32 or bfloat16 [M, K] with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == x.scalar_type() && out.stride(1) == 1,
              "quant_linear: out must be [M, N] of x's dtype with unit column stride");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "quant_linear: K must be a multiple of 32");
  const int64_t nb = k / kBlock;
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(bb > 0, "quant_linear: unsupported GGML type ", qtype);
  TORCH_CHECK(row_bytes == nb * bb, "quant_linear: row bytes do not match K");
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n, "quant_linear: out shape");
#ifdef KVFLEET_Q4_GEMV_BF16
  if (bf16 && m_rows == 1 && qtype != kQ8_0) {
    // Batch-1 decode of a bfloat16 model: the factored kernel (quant_gemv_bf16.h), 1.3x this
    // file's at one row (docs/quantization.md). Q8_0 keeps the float32 one.
    quant_gemv_bf16(out, x, w, qtype);
    return;
  }
#endif
  // bfloat16 x widened here, not by x.to(kFloat): an ATen op costs ~3 us a call, a fifth of
  // a batch-1 projection.
  std::vector<float> widened;
  const float* xp;
  int64_t ldx = x.stride(0);
  if (bf16) {
    widened.resize(m_rows * k);
    const auto* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t i = 0; i < k; ++i) widened[m * k + i] = float(xb[m * ldx + i]);
    xp = widened.data();
    ldx = k;
  } else {
    xp = x.data_ptr<float>();
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldo = out.stride(0);
  // Grain: whole 4-row tiles, enough of them to amortise the task; at::parallel_for splits
  // N into one contiguous range per thread (each writes its own outputs: no shared lines but
  // at the one boundary).
  at::parallel_for(0, (n + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * 4, n1 = std::min(n, t1 * 4);
    dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
      if (bf16) {
        rows<QT>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, out.data_ptr<c10::BFloat16>(), ldo);
      } else {
        rows<QT>(xp, ldx, m_rows, wp, row_bytes, nb, n0, n1, out.data_ptr<float>(), ldo);
      }
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
  m.def("quant_gemv_bf16(Tensor(a!) out, Tensor x, Tensor w, int qtype) -> ()");
  m.def("quant_has_q4_gemv_bf16() -> bool");
  m.def("quant_dequantize(Tensor(a!) out, Tensor w, int qtype) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_gemv_bf16", &quant_gemv_bf16);
  m.impl("quant_dequantize", &quant_dequantize);
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CompositeExplicitAutograd, m) {
  m.impl("quant_has_q4_gemv_bf16", &quant_has_q4_gemv_bf16);
}
