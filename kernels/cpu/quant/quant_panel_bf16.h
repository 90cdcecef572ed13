// The bfloat16 panel kernel (quant_panel.cpp, AVX512_BF16 builds): bfloat16 x against a Q8_0 /
// Q4_0 / Q4_1 weight decoded to bfloat16 in the dense bfloat16 panel layout
// (panel_linear.cpp's [K / 2][32] k-pairs), multiplied by the dense model's micro-kernel shape:
// up to kMaxRows rows of x x 32 columns in 24 accumulators, each row's k-pair broadcast into two
// VDPBF16PS (exact products, float32 sums), the output rounded once to bfloat16.
//
// Numerics: each weight is d * q (+ m) computed in float32 as dequant() computes it, then
// rounded to bfloat16 (nearest even): what transformers holds when it loads the same GGUF in
// bfloat16 and what a bfloat16 dense copy of the file holds. Float32 models never take this
// path.
//
// For Q4_0 / Q4_1 a factored panel exists beside this one (quant_panel_q4f.h: exact 128 + q
// decoded from a byte-transposed tile, the block affine in float32); the start-up plan times
// both and takes the faster (engine/quant/select.py). Q8_0 has only this one.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "quant_panel.h"

namespace kvfleet::quant {

// One block as 32 bfloat16 in k order, i.e. 16 k-pairs, one per 32-bit lane. A Q4 block goes
// through its 16 possible values (d * q + m, computed as dequant() computes them) rounded once
// into a 16-entry table, then each nibble picks its entry (vpermw): 4 vector instructions on
// 512 bits where widening every weight to float and rounding back takes 7.
template <int64_t QT>
inline __m512i block_pairs(const uint8_t* blk) {
  // Scales by one broadcast load and one vector conversion each (a scalar half load, convert
  // and broadcast took 4 instructions a scale, half the work of decoding a block).
  uint32_t head;
  std::memcpy(&head, blk, sizeof head);
  if constexpr (QT == kQ8_0) {
    // Signed bytes widened straight to int32 (exact in float), times d: dequant<kQ8_0>'s values.
    const v16 d = v16(_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(head))));
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const v16 lo = v16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))) * d;
    const v16 hi = v16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))) * d;
    return (__m512i)_mm512_cvtne2ps_pbh(__m512(hi), __m512(lo));  // lo in lanes 0-15
  } else {
    const v16 iota = kvfleet::kIota;
    v16 table;
    const uint8_t* q;
    if constexpr (QT == kQ4_0) {
      table = (iota - 8.f) * v16(_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(head))));
      q = blk + 2;
    } else {
      // Lanes d, m, d, m, ...: even lanes copied give d everywhere, odd lanes m.
      const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(head)));
      table = iota * v16(_mm512_moveldup_ps(dm)) + v16(_mm512_movehdup_ps(dm));
      q = blk + 4;
    }
    const __m256i t16 = (__m256i)_mm512_cvtneps_pbh(__m512(table));
    // Element i < 16 is the low nibble of byte i, element 16 + i its high nibble (ggml's order):
    // the bytes widened to words once (256 bits), then the two nibbles split in place (fewer
    // cross-lane operations than widening the split bytes to 512 bits).
    const __m256i words =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i lo = _mm256_and_si256(words, _mm256_set1_epi16(15));
    const __m256i hi = _mm256_srli_epi16(words, 4);
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(t16));
  }
}

// MR rows of x (bfloat16) x the panel's 32 columns: per k-pair two panel vectors, each row's
// pair broadcast into two VDPBF16PS; float32 sums rounded once to bfloat16 on store.
template <int MR>
void micro_bcast(const uint16_t* x, int64_t ldx, const uint32_t* panel, int64_t pairs,
                 c10::BFloat16* out, int64_t ldo, int64_t cols) {
  constexpr int64_t P = kPanelRows;
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + j * P);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + j * P + 16);
    pair_step<MR>(x + 2 * j, ldx, b0, b1, acc0, acc1);
  }
  store_rows_bf16<MR>(acc0, acc1, out, ldo, cols);
}

// The panel: pair j of weight row n at buf[j * 32 + n]; rows past the panel's are zero. Each
// block of 16 weight rows is transposed in registers, so every store is a full 64-byte line.
template <int64_t QT>
struct Bf16Panel {
  static constexpr int kRows = kvfleet_panel::kMaxRows;  // 24 accumulators of 32 registers
  using Micro = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, c10::BFloat16*,
                         int64_t, int64_t);
  static_assert(kRows == 12, "kMicro lists one micro-kernel per row count up to 12");
  static constexpr Micro kMicro[kRows] = {
      micro_bcast<1>, micro_bcast<2>, micro_bcast<3>, micro_bcast<4>,
      micro_bcast<5>, micro_bcast<6>, micro_bcast<7>, micro_bcast<8>,
      micro_bcast<9>, micro_bcast<10>, micro_bcast<11>, micro_bcast<12>};

  const uint16_t* x;
  int64_t ldx;
  c10::BFloat16* out;
  int64_t ldo, row_bytes, nb;
  std::vector<uint32_t>& buf;

  void decode(const uint8_t* w, int64_t rows, NextPanel next) {
    constexpr int64_t bb = block_bytes(QT), P = kPanelRows;
    for (int64_t h = 0; h < P; h += 16) {
      for (int64_t b = 0; b < nb; ++b) {
        next.step();
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i)
          r[i] = h + i < rows ? block_pairs<QT>(w + (h + i) * row_bytes + b * bb)
                              : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; ++j)
          _mm512_storeu_si512(buf.data() + (16 * b + j) * P + h, r[j]);
      }
    }
  }

  void multiply(int64_t m, int64_t mr, int64_t col0, int64_t cols) {
    kMicro[mr - 1](x + m * ldx, ldx, buf.data(), nb * kBlock / 2, out + m * ldo + col0, ldo,
                   cols);
  }
};

// Every row of x against weight rows [n0, n1).
template <int64_t QT>
void panels_bf16(const uint16_t* x, int64_t ldx, int64_t m_rows, const uint8_t* w,
                 int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, c10::BFloat16* out,
                 int64_t ldo) {
  thread_local std::vector<uint32_t> buf;
  const int64_t need = kPanelRows * nb * (kBlock / 2);
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  Bf16Panel<QT> panel{x, ldx, out, ldo, row_bytes, nb, buf};
  run_panels(panel, m_rows, w, row_bytes, nb, n0, n1);
}

}  // namespace kvfleet::quant
