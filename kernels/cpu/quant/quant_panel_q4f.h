// The factored bfloat16 Q4 panel kernel (quant_panel.cpp, AVX512_BF16 + AVX512_VBMI builds):
// bfloat16 x against Q4_0 / Q4_1 with the block affine taken out of the dot product, as the
// batch-1 kernel (quant_gemv_bf16.h) does: y = sum_b d_b (v_b . x_b) + c_b X_b, where v = 128 + q
// (exact in bfloat16 as 0x4300 | q), X_b = sum(x_b) and c_b = m_b - 128 d_b (Q4_1) or
// -136 d_b (Q4_0, m = -8 d).
//
// Why: the rounded-weight panel (quant_panel_bf16.h) spends ~15 vector instructions a block and
// weight row building a table of d * i + m, rounding it, looking nibbles up and transposing 16
// rows in registers. Here 16 weight rows' nibbles are transposed as bytes before decoding
// (4 vpermt2w + 8 masked vpermt2b a 16 x 32 tile, the bytes landing zero-extended in their
// 32-bit lane), so one 128 + q register of 16 columns x one k-pair costs one vpternlogd (a
// shift more for the high nibbles), and the 16 rows' headers are one gather: ~6 instructions a
// block and row, stores included. The price is in the micro-kernel: per-block sums (7 rows a
// pass, not 12) and two FMAs a block and row for d and c (the earlier factored attempt, which
// decoded through a per-row lookup and register transpose, lost 8-12% at 32 rows on this
// price). Measured (docs/quantization.md): 6-15% faster than the rounded panel at 8-32 rows,
// still ~15% behind the dense bfloat16 panel at 32. Decoding the next panel inside the
// micro-kernel's block loop (two buffers) was tried and did not beat this.
//
// Numerics: (128 + q) * x is exact in float32 (VDPBF16PS, denormal products flushed), pair sums
// in float32, then d and c X_b in float32; the 128 offset costs ~4 of float32's 24 bits in a
// block's sum, far below the output's bfloat16 rounding. Weights are never rounded to bfloat16.
// Float32 models never take this path.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define KVFLEET_Q4_PANEL_FACTORED 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "quant_panel.h"

namespace kvfleet::quant {

// Per row of x, the float32 sum of each 32-element block: [m_rows][nb].
inline void q4f_block_sums(const uint16_t* x, int64_t ldx, int64_t m_rows, int64_t nb,
                           float* s) {
  for (int64_t i = 0; i < m_rows; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const auto* xb = reinterpret_cast<const c10::BFloat16*>(x + i * ldx + b * kBlock);
      s[i * nb + b] = kvfleet::hsum(kvfleet::load16(xb) + kvfleet::load16(xb + 16));
    }
}

// The byte permutations of the tile transpose (constant): level 1 gathers word t of 8 rows
// (rows 0-3 in the first source, 4-7 in the second; 8 words a row) as [t][row]; level 2 puts
// word t' of row i (i < 8 from the first source, else the second) in lane i as bytes
// [b0, 0, b1, 0] (the zeros by the mask).
struct Q4fIndex {
  __m512i lo, hi, t[4];
  Q4fIndex() {
    alignas(64) uint16_t w[2][32];
    for (int tt = 0; tt < 4; ++tt)
      for (int row = 0; row < 8; ++row)
        for (int half = 0; half < 2; ++half) w[half][8 * tt + row] = 8 * row + tt + 4 * half;
    lo = _mm512_load_si512(w[0]);
    hi = _mm512_load_si512(w[1]);
    for (int tt = 0; tt < 4; ++tt) {
      alignas(64) uint8_t b[64];
      for (int i = 0; i < 16; ++i) {
        const int src = (i < 8 ? 0 : 64) + 2 * (8 * tt + i % 8);
        b[4 * i] = src;
        b[4 * i + 1] = 0;
        b[4 * i + 2] = src + 1;
        b[4 * i + 3] = 0;
      }
      t[tt] = _mm512_load_si512(b);
    }
  }
};

// One block's per-row sums folded into the accumulators: acc += d * s + c * X_b, X_b the
// row's block sum (sx[i * nb]).
template <int MR>
__attribute__((always_inline)) inline void q4f_fold(const float* sx, int64_t nb,
                                                    const __m512 s0[MR], const __m512 s1[MR],
                                                    __m512 d0, __m512 d1, __m512 c0, __m512 c1,
                                                    __m512 acc0[MR], __m512 acc1[MR]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 xs = _mm512_set1_ps(sx[i * nb]);
    acc0[i] = _mm512_fmadd_ps(s0[i], d0, _mm512_fmadd_ps(xs, c0, acc0[i]));
    acc1[i] = _mm512_fmadd_ps(s1[i], d1, _mm512_fmadd_ps(xs, c1, acc1[i]));
  }
}

// MR rows of x x the panel's 32 columns: per block, VDPBF16PS of each row's k-pairs (broadcast)
// against the panel's 128 + q into per-block sums, then out += d * sums + c * X_b.
template <int MR>
void micro_q4f(const uint16_t* x, int64_t ldx, const float* sx, int64_t nb, const uint32_t* q,
               const float* d, const float* c, c10::BFloat16* out, int64_t ldo, int64_t cols,
               NextPanel& next) {
  constexpr int64_t P = kPanelRows;
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
    __m512 s0[MR], s1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
    const uint32_t* qb = q + b * (kBlock / 2) * P;
    const uint16_t* xb = x + b * kBlock;
#pragma GCC unroll 16
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(qb + j * P);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(qb + j * P + 16);
      pair_step<MR>(xb + 2 * j, ldx, b0, b1, s0, s1);
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * P), d1 = _mm512_loadu_ps(d + b * P + 16);
    const __m512 c0 = _mm512_loadu_ps(c + b * P), c1 = _mm512_loadu_ps(c + b * P + 16);
    q4f_fold<MR>(sx + b, nb, s0, s1, d0, d1, c0, c1, acc0, acc1);
  }
  store_rows_bf16<MR>(acc0, acc1, out, ldo, cols);
}

// A panel of 128 + q in the dense bfloat16 panel layout (pair j of weight row n at
// q[j * 32 + n]) with its scales d [nb][32] and c [nb][32]; rows past the panel's have q = 0
// (read from a zero block) and d = c = 0.
template <int64_t QT>
struct Q4fPanel {
  static constexpr int kRows = 7;  // 2 x 2 x kRows accumulators of 32 registers
  using Micro = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint32_t*,
                         const float*, const float*, c10::BFloat16*, int64_t, int64_t,
                         NextPanel&);
  static_assert(kRows == 7, "kMicro lists one micro-kernel per row count up to 7");
  static constexpr Micro kMicro[kRows] = {micro_q4f<1>, micro_q4f<2>, micro_q4f<3>,
                                          micro_q4f<4>, micro_q4f<5>, micro_q4f<6>,
                                          micro_q4f<7>};

  const uint16_t* x;
  int64_t ldx;
  const float* sx;  // q4f_block_sums [m_rows][nb]
  int64_t m_rows;
  c10::BFloat16* out;
  int64_t ldo, row_bytes, nb;
  std::vector<uint32_t>& q;
  std::vector<float>& dc;  // d [nb][32], then c [nb][32]

  // Weight rows h..h+15 (live of them real) of block b: 16 x 32 nibbles to 16 panel lines.
  void tile(const uint8_t* w, int64_t h, int64_t live, int64_t b, const Q4fIndex& ix) {
    constexpr int64_t bb = block_bytes(QT), qs = QT == kQ4_1 ? 4 : 2, P = kPanelRows;
    alignas(16) static const uint8_t zeros[16] = {};
    const uint8_t* base = w + h * row_bytes + b * bb;
    auto row = [&](int64_t i) {
      return reinterpret_cast<const __m128i*>(i < live ? base + i * row_bytes + qs : zeros);
    };
    __m512i z[4];  // rows 4g..4g+3, 8 words each
    for (int g = 0; g < 4; ++g) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(row(4 * g)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(row(4 * g + 1)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(row(4 * g + 2)), 2);
      z[g] = _mm512_inserti32x4(v, _mm_loadu_si128(row(4 * g + 3)), 3);
    }
    const __m512i a_lo = _mm512_permutex2var_epi16(z[0], ix.lo, z[1]);
    const __m512i a_hi = _mm512_permutex2var_epi16(z[0], ix.hi, z[1]);
    const __m512i b_lo = _mm512_permutex2var_epi16(z[2], ix.lo, z[3]);
    const __m512i b_hi = _mm512_permutex2var_epi16(z[2], ix.hi, z[3]);
    const __m512i low4 = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
    uint32_t* dst = q.data() + 16 * b * P + h;
    for (int t = 0; t < 8; ++t) {
      const __m512i zt = _mm512_maskz_permutex2var_epi8(
          0x5555555555555555ULL, t < 4 ? a_lo : a_hi, ix.t[t % 4], t < 4 ? b_lo : b_hi);
      _mm512_storeu_si512(dst + t * P, _mm512_ternarylogic_epi32(zt, low4, bias, 0xEA));
      _mm512_storeu_si512(dst + (t + 8) * P, _mm512_ternarylogic_epi32(
                                                  _mm512_srli_epi16(zt, 4), low4, bias, 0xEA));
    }
    // Headers: one masked gather of the 16 rows' first 4 bytes (Q4_0: d and two nibble bytes).
    const __m512i offs = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(row_bytes)));
    const __mmask16 lm = static_cast<__mmask16>((1u << live) - 1);
    const __m512i hd = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lm, offs, base, 1);
    const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hd));
    __m512 cv;
    if constexpr (QT == kQ4_1) {
      const __m512 mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hd, 16)));
      cv = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dv, mv);
    } else {
      cv = _mm512_mul_ps(_mm512_set1_ps(-136.f), dv);
    }
    _mm512_storeu_ps(dc.data() + b * P + h, dv);
    _mm512_storeu_ps(dc.data() + (nb + b) * P + h, cv);
  }

  NextPanel next{nullptr, 0, 1};

  // The next panel is prefetched while this one is multiplied (its blocks, spread over every
  // pass's blocks), not while it is decoded: decoding is short next to the passes, and a
  // panel read during its own decoding stalled on DRAM (a decode-only build read 15 GB/s).
  void decode(const uint8_t* w, int64_t rows, NextPanel following) {
    static const Q4fIndex ix;
    for (int64_t h = 0; h < kPanelRows; h += 16) {
      const int64_t live = std::min<int64_t>(16, std::max<int64_t>(0, rows - h));
      for (int64_t b = 0; b < nb; ++b) tile(w, h, live, b, ix);
    }
    next = following;
    next.steps = (m_rows + kRows - 1) / kRows * nb;
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t cols) {
    const float* d = dc.data();
    kMicro[mr - 1](x + m * ldx, ldx, sx + m * nb, nb, q.data(), d, d + nb * kPanelRows,
                   out + m * ldo + col0, ldo, cols, next);
  }
};

// Every row of x against weight rows [n0, n1); sx from q4f_block_sums.
template <int64_t QT>
void panels_q4f(const uint16_t* x, int64_t ldx, const float* sx, int64_t m_rows,
                const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1,
                c10::BFloat16* out, int64_t ldo) {
  thread_local std::vector<uint32_t> q;
  thread_local std::vector<float> dc;
  const int64_t need = kPanelRows * nb * (kBlock / 2);
  if (static_cast<int64_t>(q.size()) < need) q.resize(need);
  if (static_cast<int64_t>(dc.size()) < 2 * kPanelRows * nb) dc.resize(2 * kPanelRows * nb);
  Q4fPanel<QT> panel{x, ldx, sx, m_rows, out, ldo, row_bytes, nb, q, dc};
  run_panels(panel, m_rows, w, row_bytes, nb, n0, n1);
}

}  // namespace kvfleet::quant

#endif
