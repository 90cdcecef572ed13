// Quantized GEMM for 8-64 rows (engine/quant/qlinear.py): out = x @ dequant(W)^T, W a GGUF
// Q8_0 / Q4_0 / Q4_1 tensor [N, K] (quant_blocks.h).
//
// Why a second kernel: quant_gemm.cpp dequantizes each block in registers and re-dequantizes
// it for every 8 rows of x, so at 32 rows the dequantization costs as much as the FMAs; the
// old alternative, dequantizing the whole weight to float32 before BLAS, writes and re-reads
// 4 bytes a weight every step. Here each task decodes a panel of 32 weight rows x the full K
// into a buffer that stays in L2, then a register-blocked micro-kernel runs every row of x
// against it (quant_panel.h's run_panels; tasks are ranges of panels over OpenMP threads):
// - bfloat16 x (AVX512_BF16 builds): quant_panel_bf16.h, the weights rounded to bfloat16 in
//   the dense bfloat16 panel layout and the dense model's VDPBF16PS micro-kernel shape; or,
//   for Q4_0 / Q4_1 with `factored` (AVX512_VBMI too), quant_panel_q4f.h: the exact 128 + q in
//   that layout, the block affine applied per block in float32;
// - float32 x (AVX-512F builds): the dequantized weights in the dense float32 panel layout
//   (panel_linear.cpp's [K][32]), up to kMaxRows rows x 32 columns, each row's x[k] broadcast
//   into two FMAs;
// - elsewhere: a row-major float32 panel, 4 rows of x x 4 weight rows = 16 accumulators along
//   K, reduced at the end by one transpose-and-add network (simd.h's reduce16).
//
// Numerics: float32 x -> float32 weights and FMAs (only the summation order differs from
// dequantize-then-matmul, so the float32 exactness tests hold); bfloat16 x -> see
// quant_panel_bf16.h (weights rounded to bfloat16, float32 sums, output rounded once). The
// bfloat16 path exists only where the compiler targets AVX512_BF16 (quant_has_bf16_dot);
// elsewhere the caller converts x to float32.
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
#include "quant_panel.h"
#ifdef __AVX512BF16__
#include "quant_panel_bf16.h"
#include "quant_panel_q4f.h"
#endif

namespace {

using kvfleet::load16;
using kvfleet::reduce16;
using kvfleet::store16;
using kvfleet::v16;
using namespace kvfleet::quant;

constexpr int kTile = 4;  // rows of x, and weight rows, per portable micro-kernel call

#ifdef __AVX512F__
// MR rows of x (float32) x the panel's 32 columns: per k two panel vectors, each row's x[k]
// broadcast into two FMAs; each output is one chain of FMAs along k.
template <int MR>
void micro_f32(const float* x, int64_t ldx, const float* panel, int64_t k, float* out,
               int64_t ldo, int64_t cols) {
  constexpr int64_t P = kPanelRows;
  v16 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = v16{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const v16 b0 = load16(panel + kk * P), b1 = load16(panel + kk * P + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const v16 xi = kvfleet::bcast(x[i * ldx + kk]);
      acc0[i] += xi * b0;
      acc1[i] += xi * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float tmp[P];
    store16(tmp, acc0[i]);
    store16(tmp + 16, acc1[i]);
    std::memcpy(out + i * ldo, tmp, sizeof(float) * cols);
  }
}

// The dequantized weights in the dense float32 panel layout: [K][32], weight k of row n at
// buf[k * 32 + n]; rows past the panel's are zero. 16 rows' blocks are transposed in
// registers, so every store is a full line.
template <int64_t QT>
struct F32Panel {
  static constexpr int kRows = kvfleet_panel::kMaxRows;
  using Micro = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                         int64_t);
  static_assert(kRows == 12, "kMicro lists one micro-kernel per row count up to 12");
  static constexpr Micro kMicro[kRows] = {
      micro_f32<1>, micro_f32<2>, micro_f32<3>, micro_f32<4>,  micro_f32<5>,  micro_f32<6>,
      micro_f32<7>, micro_f32<8>, micro_f32<9>, micro_f32<10>, micro_f32<11>, micro_f32<12>};

  const float* x;
  int64_t ldx;
  float* out;
  int64_t ldo, row_bytes, nb;
  std::vector<float>& buf;

  void decode(const uint8_t* w, int64_t rows, NextPanel next) {
    constexpr int64_t bb = block_bytes(QT), P = kPanelRows;
    for (int64_t h = 0; h < P; h += 16) {
      for (int64_t b = 0; b < nb; ++b) {
        next.step();
        __m512i lo[16], hi[16];
        for (int64_t i = 0; i < 16; ++i) {
          v16 l{}, u{};
          if (h + i < rows) dequant<QT>(w + (h + i) * row_bytes + b * bb, l, u);
          lo[i] = (__m512i)l;
          hi[i] = (__m512i)u;
        }
        transpose16(lo);
        transpose16(hi);
        float* o = buf.data() + kBlock * b * P + h;
        for (int j = 0; j < 16; ++j) {
          _mm512_storeu_si512(o + j * P, lo[j]);
          _mm512_storeu_si512(o + (16 + j) * P, hi[j]);
        }
      }
    }
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t cols) {
    kMicro[mr - 1](x + m * ldx, ldx, buf.data(), nb * kBlock, out + m * ldo + col0, ldo, cols);
  }
};

template <int64_t QT>
void panels_f32(const float* x, int64_t ldx, int64_t m_rows, const uint8_t* w,
                int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, float* out,
                int64_t ldo) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < kPanelRows * nb * kBlock)
    buf.resize(kPanelRows * nb * kBlock);
  F32Panel<QT> panel{x, ldx, out, ldo, row_bytes, nb, buf};
  run_panels(panel, m_rows, w, row_bytes, nb, n0, n1);
}
#endif

// Portable float32: rows [0, rows) of w dequantized into buf [round_up(rows, 4), k]; the
// padding rows are zero so the micro-kernel always reads 4 weight rows.
template <int64_t QT>
void dequant_panel(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t rows, float* buf) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t k = nb * kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    float* o = buf + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      v16 lo, hi;
      dequant<QT>(wr + b * bb, lo, hi);
      store16(o + b * kBlock, lo);
      store16(o + b * kBlock + 16, hi);
    }
  }
  const int64_t padded = (rows + kTile - 1) / kTile * kTile;
  std::memset(buf + rows * k, 0, (padded - rows) * k * sizeof(float));
}

// GCC otherwise folds the x load into each of the 4 FMAs that use it (4 loads instead of 1),
// which makes the loop load-bound: 20 vector loads per 16 FMAs instead of 8.
template <typename V>
__attribute__((always_inline)) inline void keep_in_register(V& v) {
  asm("" : "+v"(v));
}

// Lane m * 4 + n: dot(x row m, w row n) over k, for m < MR (lanes of rows >= MR are zero).
template <int MR>
inline v16 micro(const float* x, int64_t ldx, const float* w, int64_t k) {
  v16 acc[16] = {};
  for (int64_t kk = 0; kk < k; kk += 16) {
    v16 wv[kTile];
#pragma GCC unroll 4
    for (int n = 0; n < kTile; ++n) wv[n] = load16(w + n * k + kk);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      v16 xv = load16(x + m * ldx + kk);
      keep_in_register(xv);
#pragma GCC unroll 4
      for (int n = 0; n < kTile; ++n) acc[m * kTile + n] += xv * wv[n];
    }
  }
  return reduce16(acc);
}

template <typename O>
inline void store_tile(v16 s, int mr, int64_t nr, O* out, int64_t ldo) {
  for (int m = 0; m < mr; ++m)
    for (int64_t n = 0; n < nr; ++n) out[m * ldo + n] = O(s[m * kTile + n]);
}

// The portable panel: [round_up(rows, 4)][K] row-major float32, multiplied 4 weight rows at a
// time.
template <int64_t QT, typename E, typename O>
struct PortablePanel {
  static constexpr int kRows = kTile;
  const E* x;
  int64_t ldx;
  O* out;
  int64_t ldo, row_bytes, nb;
  std::vector<float>& buf;
  int64_t rows = 0;

  void decode(const uint8_t* w, int64_t n, NextPanel) {
    rows = n;
    dequant_panel<QT>(w, row_bytes, nb, n, buf.data());
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t) {
    const int64_t k = nb * kBlock;
    const E* xm = x + m * ldx;
    for (int64_t t = 0; t < rows; t += kTile) {
      const float* wt = buf.data() + t * k;
      const v16 s = mr == 4   ? micro<4>(xm, ldx, wt, k)
                    : mr == 3 ? micro<3>(xm, ldx, wt, k)
                    : mr == 2 ? micro<2>(xm, ldx, wt, k)
                              : micro<1>(xm, ldx, wt, k);
      store_tile(s, static_cast<int>(mr), std::min<int64_t>(kTile, rows - t),
                 out + m * ldo + col0 + t, ldo);
    }
  }
};

template <int64_t QT, typename E, typename O>
void panels(const E* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
            int64_t nb, int64_t n0, int64_t n1, O* out, int64_t ldo) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < kPanelRows * nb * kBlock)
    buf.resize(kPanelRows * nb * kBlock);
  PortablePanel<QT, E, O> panel{x, ldx, out, ldo, row_bytes, nb, buf};
  run_panels(panel, m_rows, w, row_bytes, nb, n0, n1);
}

// Every row of x against every weight row: tasks are ranges of panels. sx (the rows' block
// sums) non-null: the factored Q4 panel (quant_panel_q4f.h) for bfloat16 Q4_0 / Q4_1.
template <typename E, typename O>
void run(const E* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
         int64_t nb, int64_t n, O* out, int64_t ldo, int64_t qtype, const float* sx = nullptr) {
  at::parallel_for(0, (n + kPanelRows - 1) / kPanelRows, 1, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = p0 * kPanelRows, n1 = std::min(n, p1 * kPanelRows);
    dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<E, uint16_t>) {
#ifdef KVFLEET_Q4_PANEL_FACTORED
        if constexpr (QT != kQ8_0) {
          if (sx != nullptr) {
            panels_q4f<QT>(x, ldx, sx, m_rows, w, row_bytes, nb, n0, n1, out, ldo);
            return;
          }
        }
#endif
        panels_bf16<QT>(x, ldx, m_rows, w, row_bytes, nb, n0, n1, out, ldo);
        return;
      } else
#endif
#ifdef __AVX512F__
        panels_f32<QT>(x, ldx, m_rows, w, row_bytes, nb, n0, n1, out, ldo);
#else
        panels<QT>(x, ldx, m_rows, w, row_bytes, nb, n0, n1, out, ldo);
#endif
    });
  });
}

bool quant_has_q4_panel_factored() {
#ifdef KVFLEET_Q4_PANEL_FACTORED
  return true;
#else
  return false;
#endif
}

bool quant_has_bf16_dot() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ dequant(w [N, row bytes] uint8)^T. x float32 -> out float32;
// x bfloat16 (only where quant_has_bf16_dot) -> out bfloat16. out may be a column slice of a
// wider output (unit column stride), as for quant_linear. `factored` picks the factored Q4
// panel for bfloat16 Q4_0 / Q4_1 where it is built (quant_has_q4_panel_factored); it changes
// nothing for float32 x or Q8_0.
void quant_linear_panel(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                        int64_t qtype, bool factored) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.stride(1) == 1,
              "quant_linear_panel: x must be float32 or bfloat16 [M, K], unit column stride");
  TORCH_CHECK(!bf16 || quant_has_bf16_dot(),
              "quant_linear_panel: bfloat16 x needs AVX512_BF16 (convert x to float32)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_linear_panel: w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == x.scalar_type() && out.stride(1) == 1,
              "quant_linear_panel: out must be [M, N] of x's dtype, unit column stride");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "quant_linear_panel: K must be a multiple of 32");
  const int64_t nb = k / kBlock, bb = block_bytes(qtype);
  TORCH_CHECK(bb > 0, "quant_linear_panel: unsupported GGML type ", qtype);
  TORCH_CHECK(row_bytes == nb * bb, "quant_linear_panel: row bytes do not match K");
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n, "quant_linear_panel: out shape");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
#ifdef __AVX512BF16__
  if (bf16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    std::vector<float> sx;
#ifdef KVFLEET_Q4_PANEL_FACTORED
    if (factored && qtype != kQ8_0) {
      sx.resize(m_rows * nb);
      q4f_block_sums(xp, ldx, m_rows, nb, sx.data());
    }
#endif
    run(xp, ldx, m_rows, wp, row_bytes, nb, n, out.data_ptr<c10::BFloat16>(), ldo, qtype,
        sx.empty() ? nullptr : sx.data());
    return;
  }
#endif
  run(x.data_ptr<float>(), ldx, m_rows, wp, row_bytes, nb, n, out.data_ptr<float>(), ldo,
      qtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_quant, m) {
  m.def(
      "quant_linear_panel(Tensor(a!) out, Tensor x, Tensor w, int qtype, bool factored=False)"
      " -> ()");
  m.def("quant_has_bf16_dot() -> bool");
  m.def("quant_has_q4_panel_factored() -> bool");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("quant_linear_panel", &quant_linear_panel);
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CompositeExplicitAutograd, m) {
  m.impl("quant_has_bf16_dot", &quant_has_bf16_dot);
  m.impl("quant_has_q4_panel_factored", &quant_has_q4_panel_factored);
}
