// One row of bfloat16 activations against Q4_0 / Q4_1 blocks (batch-1 decode of a bfloat16
// model), with the block affine factored out: y = sum_b d_b (q_b . x_b) + m_b X_b, where q_b
// are the block's integer nibbles, X_b = sum(x_b), and m_b = -8 d_b for Q4_0.
//
// Why factored: the register kernel (quant_gemm.cpp) spends ~13 vector instructions a block
// and weight row building a 16-value table of d * i + m, looking nibbles up in it twice and
// running two float32 FMAs; that, not DRAM, bounded it (~5 weights a cycle). Here a block
// costs one 16-byte broadcast load, one vpmultishiftqb (every nibble into the low bits of a
// 16-bit lane), one vpternlogd making each lane the bfloat16 of 128 + q (0x4300 | q: exact,
// the exponent of 128 with q as mantissa bits), one vdpbf16ps against x and one FMA by the
// block's scale; the offset and the min term are an xmm FMA (d * -128 X_b + m * X_b).
// Measured (docs/quantization.md): a vpermw lookup of q itself instead of the ternlog was 10%
// slower in cache; the float32 kernel 1.3x slower from DRAM.
//
// Lane order: vpmultishiftqb reads only within a 64-bit lane, so the unpacked register holds
// the block's 32 weights in the fixed order q4_word_weight(); x is permuted the same way once
// per call (shared by every weight row), which makes the order free.
//
// Numerics: (128 + q) * x is exact in float32 (an 8-bit integer times a bfloat16); vdpbf16ps
// adds pairs in float32 (denormal products flushed); then one FMA by d, and d * 128 X_b is
// taken back out in float32. The offset costs ~4 of float32's 24 bits in the block sum
// (128 + q is ~17x q on average), far below the output's bfloat16 rounding (8 bits). The
// weights are never rounded to bfloat16 (the panel kernel rounds d * q + m). The output is
// rounded once to bfloat16.
//
// Built only where the compiler targets AVX512_BF16 and AVX512_VBMI (KVFLEET_Q4_GEMV_BF16);
// elsewhere the float32 register kernel takes this case.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define KVFLEET_Q4_GEMV_BF16 1

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace kvfleet::quant {

// Which of the block's 32 weights 16-bit lane w of the unpacked register holds. Lane w sits in
// 64-bit lane w / 4, whose source (the broadcast 16 bytes) is bytes 0..7 for even 64-bit
// lanes and 8..15 for odd ones; slot s = w % 4 of 64-bit lanes 2L and 2L + 1 takes nibble
// n = 4L + s of its 8 bytes (n even: the low nibble of byte n / 2, weight = that byte's
// index; n odd: the high nibble, weight = index + 16).
constexpr int q4_word_weight(int w) {
  const int q = w / 4, n = 4 * (q / 2) + w % 4;
  const int byte = (q % 2 ? 8 : 0) + n / 2;
  return n % 2 ? byte + 16 : byte;
}

// vpmultishiftqb control: the low byte of lane w starts at bit 4n of its 64-bit lane (the
// nibble, with the next nibble's bits above it: vpermw reads only the low 5 bits and the
// ternlog masks it to 4 bits); the high byte is overwritten by the ternlog.
inline __m512i q4_unpack_control() {
  alignas(64) uint8_t c[64];
  for (int w = 0; w < 32; ++w) {
    c[2 * w] = static_cast<uint8_t>(4 * (4 * ((w / 4) / 2) + w % 4));
    c[2 * w + 1] = 0;
  }
  return _mm512_load_si512(c);
}

// Per call, shared by every weight row: x permuted block by block into the unpacked lane
// order, and the per-block factors of the header [d, m] (Q4_1) or [d, 0] (Q4_0; m = -8 d):
// [-128 X_b, X_b] and [-136 X_b, 0], the offset and the min term.
template <int64_t QT>
struct Q4RowX {
  std::vector<uint16_t> xp;  // [nb][32] bfloat16 bits
  std::vector<float> xm;     // [nb][4]

  Q4RowX(const c10::BFloat16* x, int64_t nb) : xp(nb * kBlock), xm(nb * 4, 0.f) {
    for (int64_t b = 0; b < nb; ++b) {
      const c10::BFloat16* xb = x + b * kBlock;
      float sum = 0.f;
      for (int w = 0; w < kBlock; ++w) {
        xp[b * kBlock + w] = xb[q4_word_weight(w)].x;
        sum += static_cast<float>(xb[w]);
      }
      if constexpr (QT == kQ4_1) { xm[b * 4] = -128.f * sum; xm[b * 4 + 1] = sum; }
      else xm[b * 4] = -136.f * sum;
    }
  }
};

// Weight rows [n0, n1) (RT at a time: independent chains sharing each x load), out rounded.
// 256-bit registers throughout: the per-block scale FMA and its broadcast then take one
// 256-bit slot each instead of two (Zen 4 runs a 512-bit op as two), and the header [d, m]
// converts by one broadcast load and one vcvtph2ps ([d, m] in every lane pair: moveldup
// gives d everywhere, and the low pair is the min term's factor).
template <int64_t QT, int RT>
void q4_gemv_bf16_rows(const Q4RowX<QT>& xr, const uint8_t* w, int64_t row_bytes, int64_t nb,
                       int64_t n0, int64_t n1, int64_t prefetch_bytes, c10::BFloat16* out) {
  constexpr int64_t bb = block_bytes(QT), qs = QT == kQ4_1 ? 4 : 2;
  const __m512i ctrl = q4_unpack_control();
  const __m256i ctrl0 = _mm512_castsi512_si256(ctrl), ctrl1 = _mm512_extracti64x4_epi64(ctrl, 1);
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), bias = _mm256_set1_epi32(0x43004300);
  for (int64_t n = n0; n + RT <= n1; n += RT) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[RT];
    __m128 accm[RT];
    for (int r = 0; r < RT; ++r) {
      acc[r] = _mm256_setzero_ps();
      accm[r] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* xb = xr.xp.data() + b * kBlock;
      const __m256bh x0 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
      const __m256bh x1 =
          (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
      const __m128 xm = _mm_loadu_ps(xr.xm.data() + b * 4);
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) {
        const uint8_t* blk = wr + r * row_bytes + b * bb;
        __builtin_prefetch(blk + prefetch_bytes);
        // Header: [d, m] (Q4_1) or [d, q bits] masked to [d, 0] (Q4_0) as fp16.
        uint32_t head;
        std::memcpy(&head, blk, sizeof head);
        if constexpr (QT == kQ4_0) head &= 0xFFFF;
        const __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(head)));
        const __m256i src = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs)));
        const __m256i q0 = _mm256_ternarylogic_epi32(
            _mm256_multishift_epi64_epi8(ctrl0, src), low4, bias, 0xEA);
        const __m256i q1 = _mm256_ternarylogic_epi32(
            _mm256_multishift_epi64_epi8(ctrl1, src), low4, bias, 0xEA);
        __m256 s = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)q0, x0);
        s = _mm256_dpbf16_ps(s, (__m256bh)q1, x1);
        acc[r] = _mm256_fmadd_ps(s, _mm256_moveldup_ps(dm), acc[r]);
        accm[r] = _mm_fmadd_ps(_mm256_castps256_ps128(dm), xm, accm[r]);
      }
    }
    for (int r = 0; r < RT; ++r) {
      const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc[r]),
                                  _mm256_extractf128_ps(acc[r], 1));
      const __m128 t = _mm_add_ps(a, accm[r]);
      const __m128 t2 = _mm_add_ps(t, _mm_movehl_ps(t, t));
      out[n + r] = c10::BFloat16(_mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2))));
    }
  }
}

// Weight rows [n0, n1) of one row of x: 4 rows a pass, then the remainder one at a time.
template <int64_t QT>
void q4_gemv_bf16(const Q4RowX<QT>& xr, const uint8_t* w, int64_t row_bytes, int64_t nb,
                  int64_t n0, int64_t n1, int64_t prefetch_bytes, c10::BFloat16* out) {
  const int64_t tiled = n0 + (n1 - n0) / 4 * 4;
  q4_gemv_bf16_rows<QT, 4>(xr, w, row_bytes, nb, n0, tiled, prefetch_bytes, out);
  q4_gemv_bf16_rows<QT, 1>(xr, w, row_bytes, nb, tiled, n1, prefetch_bytes, out);
}

}  // namespace kvfleet::quant

#endif
