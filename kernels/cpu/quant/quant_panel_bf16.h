// The bfloat16 panel kernel (quant_panel.cpp, AVX512_BF16 builds): bfloat16 x against a Q8_0 /
// Q4_0 / Q4_1 weight with the block affine factored out of the dot product.
//
// For a 32-weight block b of weight row n, w = d_b * q + m_b (m_b = 0 for Q4_0 / Q8_0 with q
// re-centred), so x_b . w_b = d_b * (x_b . q_b) + m_b * sum(x_b). The integers q (Q4_1 0..15,
// Q4_0 -8..7, Q8_0 -128..127) are exact in bfloat16: the panel holds them, not the scaled
// weights, so decoding a Q4 block is one table lookup (vpermw over 32 constant entries) after
// the nibble split, with no per-block table to build and round. x_b . q_b runs on VDPBF16PS
// (exact products, float32 sums) into per-block accumulators, which the block's d (and m times
// the row's block sum, computed once per GEMM call and shared by every column) fold into the
// output's float32 accumulators. The per-block accumulators halve the rows a pass can hold:
// kRows = kMaxRows / 2.
//
// Numerics: the weights are the file's exact d * q + m (in float32 arithmetic), not rounded to
// bfloat16, so the output is not bit-identical to a bfloat16 copy of the dequantized weights
// (transformers-in-bfloat16 rounds each weight); sums in float32, the output rounded once to
// bfloat16. Float32 models never take this path.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "quant_panel.h"

namespace kvfleet::quant {

// Per row of x, the float32 sum of each 32-element block: [m_rows][nb]. Only Q4_1 needs it.
inline std::vector<float> block_sums(const uint16_t* x, int64_t ldx, int64_t m_rows,
                                     int64_t nb) {
  std::vector<float> s(m_rows * nb);
  for (int64_t i = 0; i < m_rows; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const auto* xb = reinterpret_cast<const c10::BFloat16*>(x + i * ldx + b * kBlock);
      s[i * nb + b] = kvfleet::hsum(kvfleet::load16(xb) + kvfleet::load16(xb + 16));
    }
  return s;
}

// One block's integers as 32 bfloat16 in k order (16 k-pairs, one per 32-bit lane).
template <int64_t QT>
inline __m512i block_ints(const uint8_t* blk) {
  if constexpr (QT == kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in lanes 0-15
  } else {
    // Entry i is bfloat16(i mod 16) (Q4_1) or bfloat16(i mod 16 - 8) (Q4_0): vpermw reads the
    // low 5 bits of each index, so the low nibble's word (the whole byte) needs no mask.
    static const __m512i table = [] {
      alignas(64) uint16_t t[32];
      for (int i = 0; i < 32; ++i) {
        const c10::BFloat16 v(static_cast<float>(QT == kQ4_0 ? i % 16 - 8 : i % 16));
        std::memcpy(&t[i], &v, sizeof v);
      }
      return _mm512_load_si512(t);
    }();
    // Element i < 16 is the low nibble of byte i, element 16 + i its high nibble (ggml's order).
    const __m256i words = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2))));
    const __m512i idx =
        _mm512_inserti64x4(_mm512_castsi256_si512(words), _mm256_srli_epi16(words, 4), 1);
    return _mm512_permutexvar_epi16(idx, table);
  }
}

// MR rows of x x the panel's 32 columns: per block, VDPBF16PS of each row's k-pairs (broadcast)
// against the panel's integers into per-block sums, then out += d * sums (+ m * block sum).
template <int64_t QT, int MR>
void micro_affine(const uint16_t* x, int64_t ldx, const float* sx, int64_t nb,
                  const uint32_t* q, const float* d, const float* mn, c10::BFloat16* out,
                  int64_t ldo, int64_t cols) {
  constexpr int64_t P = kPanelRows;
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s0[MR], s1[MR];
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
    const uint32_t* qb = q + b * (kBlock / 2) * P;
    const uint16_t* xb = x + b * kBlock;
#pragma GCC unroll 16
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(qb + j * P);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(qb + j * P + 16);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        uint32_t pair;
        std::memcpy(&pair, xb + i * ldx + 2 * j, sizeof pair);
        const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        s0[i] = _mm512_dpbf16_ps(s0[i], xi, b0);
        s1[i] = _mm512_dpbf16_ps(s1[i], xi, b1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * P), d1 = _mm512_loadu_ps(d + b * P + 16);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      acc0[i] = _mm512_fmadd_ps(s0[i], d0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(s1[i], d1, acc1[i]);
    }
    if constexpr (QT == kQ4_1) {
      const __m512 m0 = _mm512_loadu_ps(mn + b * P), m1 = _mm512_loadu_ps(mn + b * P + 16);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m512 si = _mm512_set1_ps(sx[i * nb + b]);
        acc0[i] = _mm512_fmadd_ps(si, m0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(si, m1, acc1[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    c10::BFloat16 tmp[P];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)_mm512_cvtneps_pbh(acc0[i]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16),
                        (__m256i)_mm512_cvtneps_pbh(acc1[i]));
    std::memcpy(out + i * ldo, tmp, sizeof(c10::BFloat16) * cols);
  }
}

// A panel of integers in the dense bfloat16 panel layout (panel_linear.cpp's [K / 2][32]
// k-pairs: pair j of weight row n at q[j * 32 + n]) with its scales [nb][32] (d, and m for
// Q4_1); rows past the panel's are zero, scales included.
template <int64_t QT>
struct AffinePanel {
  static constexpr int kRows = kvfleet_panel::kMaxRows / 2;  // 2 x 2 x kRows accumulators
  using Micro = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint32_t*,
                         const float*, const float*, c10::BFloat16*, int64_t, int64_t);
  static constexpr Micro kMicro[kRows] = {micro_affine<QT, 1>, micro_affine<QT, 2>,
                                          micro_affine<QT, 3>, micro_affine<QT, 4>,
                                          micro_affine<QT, 5>, micro_affine<QT, 6>};

  const uint16_t* x;
  int64_t ldx;
  const float* sx;  // block_sums (Q4_1), else unused
  c10::BFloat16* out;
  int64_t ldo, row_bytes, nb;
  std::vector<uint32_t>& q;
  std::vector<float>& dm;  // d [nb][32], then m [nb][32]

  void decode(const uint8_t* w, int64_t rows, NextPanel next) {
    constexpr int64_t bb = block_bytes(QT), P = kPanelRows;
    float* d = dm.data();
    float* mn = d + nb * P;
    for (int64_t h = 0; h < P; h += 16) {
      for (int64_t b = 0; b < nb; ++b) {
        next.step();
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) {
          const bool live = h + i < rows;
          const uint8_t* blk = w + (h + i) * row_bytes + b * bb;
          r[i] = live ? block_ints<QT>(blk) : _mm512_setzero_si512();
          d[b * P + h + i] = live ? half_at(blk) : 0.f;
          if constexpr (QT == kQ4_1) mn[b * P + h + i] = live ? half_at(blk + 2) : 0.f;
        }
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(q.data() + (16 * b + j) * P + h, r[j]);
      }
    }
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t cols) {
    const float* d = dm.data();
    const float* sxm = QT == kQ4_1 ? sx + m * nb : nullptr;
    kMicro[mr - 1](x + m * ldx, ldx, sxm, nb, q.data(), d, d + nb * kPanelRows,
                   out + m * ldo + col0, ldo, cols);
  }
};

// Every row of x against weight rows [n0, n1).
template <int64_t QT>
void panels_bf16(const uint16_t* x, int64_t ldx, const float* sx, int64_t m_rows,
                 const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1,
                 c10::BFloat16* out, int64_t ldo) {
  thread_local std::vector<uint32_t> q;
  thread_local std::vector<float> dm;
  const int64_t need = kPanelRows * nb * (kBlock / 2);
  if (static_cast<int64_t>(q.size()) < need) q.resize(need);
  if (static_cast<int64_t>(dm.size()) < 2 * kPanelRows * nb) dm.resize(2 * kPanelRows * nb);
  AffinePanel<QT> panel{x, ldx, sx, out, ldo, row_bytes, nb, q, dm};
  run_panels(panel, m_rows, w, row_bytes, nb, n0, n1);
}

}  // namespace kvfleet::quant
