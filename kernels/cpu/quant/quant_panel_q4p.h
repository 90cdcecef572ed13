// The panel-ordered Q4 layout and its kernel (quant_panel_q4p.cpp, AVX512_BF16 + AVX512_VBMI
// builds): a Q4_0 / Q4_1 weight re-laid at load so that the factored panel's lines
// (quant_panel_q4f.h: 16 columns x one k-pair of 128 + q as bfloat16) come out of a straight
// 64-byte load, a shift and one vpternlogd, with no tile transpose and no header gather.
//
// Layout (still 4 bits a weight plus fp16 scales: exactly the GGUF bytes, the last panel's
// rows zero-padded to 32): panel p (weight rows 32p .. 32p + 31) holds, for each block b,
// 512 bytes of nibbles then, after all nb blocks, d as fp16 [nb][32] and (Q4_1) m as fp16
// [nb][32]. So a panel is 32 x row_bytes bytes and panel p starts at 32p x row_bytes, as a
// row-major panel would: the panel driver (quant_panel.h's run_panels) walks it unchanged.
// Block b's nibbles: word [(b * 4 + r) * 2 + h][n] (32 bits, column 16h + n) holds k-pairs
// j = 4r + s, s = 0..3: weight 2j at bits 4s..4s+3, weight 2j + 1 at bits 16 + 4s..
// So pair j's 16-column line is ((word >> 4s) & 0x000F000F) | 0x43004300.
//
// Numerics: identical to the factored panel (quant_panel_q4f.h): the same exact 128 + q, the
// same pair order within a block, the same d and c = m - 128 d (Q4_0: -136 d) in float32, so
// its outputs equal that panel's bit for bit. Float32 models never take this path.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"
#include "quant_panel.h"
#include "quant_panel_q4f.h"

namespace kvfleet::quant {

constexpr int64_t kQ4pBlockBytes = 512;  // 32 columns x 32 nibbles

// Block b of Q4 row `src` (its nibble bytes at q) into column n of a packed panel block.
inline void q4p_pack_block(const uint8_t* q, int64_t n, uint32_t* blk) {
  auto weight = [&](int i) -> uint32_t { return i < 16 ? q[i] & 15 : q[i - 16] >> 4; };
  for (int r = 0; r < 4; ++r) {
    uint32_t word = 0;
    for (int s = 0; s < 4; ++s) {
      const int j = 4 * r + s;
      word |= weight(2 * j) << (4 * s) | weight(2 * j + 1) << (16 + 4 * s);
    }
    blk[(r * 2 + n / 16) * 16 + n % 16] = word;
  }
}

// w [n, row_bytes] rows of QT -> packed panels (ceil(n / 32) x 32 x row_bytes bytes, zeroed).
template <int64_t QT>
void q4p_pack(const uint8_t* w, int64_t n, int64_t nb, uint8_t* packed) {
  constexpr int64_t bb = block_bytes(QT), qs = QT == kQ4_1 ? 4 : 2, P = kPanelRows;
  const int64_t row_bytes = nb * bb;
  for (int64_t row = 0; row < n; ++row) {
    uint8_t* panel = packed + row / P * P * row_bytes;
    const int64_t col = row % P;
    auto* d = reinterpret_cast<uint16_t*>(panel + nb * kQ4pBlockBytes);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + row * row_bytes + b * bb;
      q4p_pack_block(blk + qs, col,
                     reinterpret_cast<uint32_t*>(panel + b * kQ4pBlockBytes));
      std::memcpy(d + b * P + col, blk, 2);
      if constexpr (QT == kQ4_1) std::memcpy(d + (nb + b) * P + col, blk + 2, 2);
    }
  }
}

// Line s (0..3) of a packed word vector: 16 columns x k-pair 4r + s as bfloat16 128 + q.
template <int S>
inline __m512bh q4p_line(__m512i word) {
  const __m512i v = S == 0 ? word : _mm512_srli_epi32(word, 4 * S);
  return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x000F000F),
                                             _mm512_set1_epi32(0x43004300), 0xEA);
}

// d and c (float32) of 16 columns of block b from the panel's fp16 scales.
template <int64_t QT>
inline void q4p_scales(const uint16_t* dh, int64_t nb, int64_t idx, __m512& d, __m512& c) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + idx)));
  if constexpr (QT == kQ4_1) {
    const __m512 m = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + nb * kPanelRows + idx)));
    c = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m);
  } else {
    c = _mm512_mul_ps(_mm512_set1_ps(-136.f), d);
  }
}

// One k-pair of every row against line S of both 16-column word vectors.
template <int MR, int S>
__attribute__((always_inline)) inline void q4p_pairs(const uint16_t* x, int64_t ldx,
                                                     __m512i w0, __m512i w1, __m512 s0[MR],
                                                     __m512 s1[MR]) {
  pair_step<MR>(x + 2 * S, ldx, q4p_line<S>(w0), q4p_line<S>(w1), s0, s1);
}

// The fused micro-kernel: MR rows of x x 32 columns straight off the packed panel, each line
// decoded in registers just before its two VDPBF16PS (decoding rides beside the multiplies
// instead of a separate pass through a buffer), then out += d * sums + c * X_b per block.
template <int64_t QT, int MR>
void micro_q4p(const uint16_t* x, int64_t ldx, const float* sx, int64_t nb,
               const uint8_t* panel, c10::BFloat16* out, int64_t ldo, int64_t cols,
               NextPanel& next) {
  constexpr int64_t P = kPanelRows;
  const auto* words = reinterpret_cast<const __m512i*>(panel);
  const auto* dh = reinterpret_cast<const uint16_t*>(panel + nb * kQ4pBlockBytes);
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
    __m512 s0[MR], s1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
    const uint16_t* xb = x + b * kBlock;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512i w0 = _mm512_loadu_si512(words + (b * 4 + r) * 2);
      const __m512i w1 = _mm512_loadu_si512(words + (b * 4 + r) * 2 + 1);
      q4p_pairs<MR, 0>(xb + 8 * r, ldx, w0, w1, s0, s1);
      q4p_pairs<MR, 1>(xb + 8 * r, ldx, w0, w1, s0, s1);
      q4p_pairs<MR, 2>(xb + 8 * r, ldx, w0, w1, s0, s1);
      q4p_pairs<MR, 3>(xb + 8 * r, ldx, w0, w1, s0, s1);
    }
    __m512 d0, d1, c0, c1;
    q4p_scales<QT>(dh, nb, b * P, d0, c0);
    q4p_scales<QT>(dh, nb, b * P + 16, d1, c1);
    q4f_fold<MR>(sx + b, nb, s0, s1, d0, d1, c0, c1, acc0, acc1);
  }
  store_rows_bf16<MR>(acc0, acc1, out, ldo, cols);
}


// The panel over packed weights: nothing to decode ahead (the micro-kernel decodes as it
// multiplies), only the next panel's prefetch spread over this one's passes. Decoding once a
// panel into the factored panel's buffer instead (straight loads, shifts and vpternlogd, then
// quant_panel_q4f.h's micro-kernel) was built and measured slower at 8-64 rows
// (docs/quantization.md): the decode repeated per pass rides beside the VDPBF16PS.
template <int64_t QT>
struct Q4pPanel {
  static constexpr int kRows = 7;  // 4 x 7 accumulators of 32 registers, as quant_panel_q4f.h
  using Micro = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*,
                         c10::BFloat16*, int64_t, int64_t, NextPanel&);
  static_assert(kRows == 7, "kMicro lists one micro-kernel per row count up to 7");
  static constexpr Micro kMicro[kRows] = {micro_q4p<QT, 1>, micro_q4p<QT, 2>, micro_q4p<QT, 3>,
                                          micro_q4p<QT, 4>, micro_q4p<QT, 5>, micro_q4p<QT, 6>,
                                          micro_q4p<QT, 7>};

  const uint16_t* x;
  int64_t ldx;
  const float* sx;  // q4f_block_sums [m_rows][nb]
  int64_t m_rows;
  c10::BFloat16* out;
  int64_t ldo, nb;
  const uint8_t* panel = nullptr;
  NextPanel next{nullptr, 0, 1};

  void decode(const uint8_t* w, int64_t, NextPanel following) {
    panel = w;
    next = following;
    next.steps = (m_rows + kRows - 1) / kRows * nb;
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t cols) {
    kMicro[mr - 1](x + m * ldx, ldx, sx + m * nb, nb, panel, out + m * ldo + col0, ldo, cols,
                   next);
  }
};

// Every row of x against weight rows [n0, n1) of the packed weight; sx from q4f_block_sums.
template <int64_t QT>
void panels_q4p(const uint16_t* x, int64_t ldx, const float* sx, int64_t m_rows,
                const uint8_t* packed, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1,
                c10::BFloat16* out, int64_t ldo) {
  Q4pPanel<QT> panel{x, ldx, sx, m_rows, out, ldo, nb};
  run_panels(panel, m_rows, packed, row_bytes, nb, n0, n1);
}

}  // namespace kvfleet::quant

#endif
