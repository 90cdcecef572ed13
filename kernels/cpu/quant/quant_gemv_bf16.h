// One row of bfloat16 activations against Q4_0 / Q4_1 blocks (batch-1 decode of a bfloat16
// model), with the block affine factored out: y = sum_b d_b (q_b . x_b) + m_b X_b, where q_b
// are the block's integer nibbles, X_b = sum(x_b), and m_b = -8 d_b for Q4_0.
//
// Why factored: the register kernel (quant_gemm.cpp) spends ~13 vector instructions a block
// and weight row building a 16-value table of d * i + m, looking nibbles up in it twice and
// running two float32 FMAs; that, not DRAM, bounded it (~5 weights a cycle). Here a block of
// one weight row costs one vpmovzxbw (its 16 bytes widened to 16-bit lanes: low nibbles are
// weights 0..15 in order, high nibbles 16..31 after one shift, so x needs no reordering), two
// vpternlogd making each lane 0x4300 | q (the bfloat16 of 128 + q, exact: the exponent of 128
// with q as mantissa bits), two vdpbf16ps against x, one lane permute for d and one FMA; the
// headers of four rows convert together and their offset and min terms are one FMA.
// Measured on a 3072 x 576 Q4_1 projection in cache (Zen 4, stand-alone loop; cycles a block
// and row): 4.4 with a vcvtph2ps per row's header, 3.9 with four rows' headers converted
// together and the bytes widened as above (a vpmultishiftqb unpack was 6% slower; a vpermw
// lookup of q instead of the ternlog 10% slower); the float32 kernel ~6.
//
// Numerics: (128 + q) * x is exact in float32 (an 8-bit integer times a bfloat16); vdpbf16ps
// adds pairs in float32 (denormal products flushed); then one FMA by d, and d * 128 X_b is
// taken back out in float32. The offset costs ~4 of float32's 24 bits in the block sum
// (128 + q is ~17x q on average), far below the output's bfloat16 rounding (8 bits). The
// weights are never rounded to bfloat16 (the panel kernel rounds d * q + m). The output is
// rounded once to bfloat16.
//
// Built only where the compiler targets AVX512_BF16 and AVX512VL (KVFLEET_Q4_GEMV_BF16);
// elsewhere the float32 register kernel takes this case.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define KVFLEET_Q4_GEMV_BF16 1

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace kvfleet::quant {

// Per call, shared by every weight row: the per-block factors of the header [d, m] (Q4_1)
// or [d, 0] (Q4_0, m = -8 d): [-128 X_b, X_b] or [-136 X_b, 0], the offset and the min
// term, repeated for the four weight rows whose headers convert together.
template <int64_t QT>
struct Q4RowX {
  std::vector<float> xm;  // [nb][8]

  Q4RowX(const c10::BFloat16* x, int64_t nb) : xm(nb * 8) {
    for (int64_t b = 0; b < nb; ++b) {
      float sum = 0.f;
      for (int i = 0; i < kBlock; ++i) sum += static_cast<float>(x[b * kBlock + i]);
      const float a = QT == kQ4_1 ? -128.f * sum : -136.f * sum;
      const float m = QT == kQ4_1 ? sum : 0.f;
      for (int r = 0; r < 4; ++r) {
        xm[b * 8 + 2 * r] = a;
        xm[b * 8 + 2 * r + 1] = m;
      }
    }
  }
};

// The RT (<= 4) headers of block b of rows wr, wr + row_bytes, ... as float32 [d0, m0, d1,
// m1, ...]: one vcvtph2ps for the rows together (converting each row's alone cost more than
// a cycle a block). Q4_0's header is d alone: its neighbour bytes (the nibbles) are masked.
template <int64_t QT, int RT>
__attribute__((always_inline)) inline __m256 q4_headers(const uint8_t* blk, int64_t row_bytes) {
  __m128i h = _mm_castps_si128(_mm_broadcast_ss(reinterpret_cast<const float*>(blk)));
  if constexpr (RT > 1) {
    h = _mm_blend_epi32(h, _mm_castps_si128(_mm_broadcast_ss(
                               reinterpret_cast<const float*>(blk + row_bytes))), 2);
  }
  if constexpr (RT > 2) {
    h = _mm_blend_epi32(h, _mm_castps_si128(_mm_broadcast_ss(
                               reinterpret_cast<const float*>(blk + 2 * row_bytes))), 4);
  }
  if constexpr (RT > 3) {
    h = _mm_blend_epi32(h, _mm_castps_si128(_mm_broadcast_ss(
                               reinterpret_cast<const float*>(blk + 3 * row_bytes))), 8);
  }
  if constexpr (QT == kQ4_0) h = _mm_and_si128(h, _mm_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(h);
}

// Weight rows [n0, n1) (RT <= 4 at a time: independent chains sharing each x load), out
// rounded. 256-bit registers throughout (Zen 4 runs a 512-bit op as two: the per-block scale
// FMA takes one slot instead of two). A block's 16 bytes widen to 16-bit lanes (vpmovzxbw):
// the low nibbles are weights 0..15 in order, the high ones (after a shift) 16..31, so x
// needs no reordering; vpternlogd makes each lane 0x4300 | q.
template <int64_t QT, int RT>
void q4_gemv_bf16_rows(const Q4RowX<QT>& xr, const c10::BFloat16* x, const uint8_t* w,
                       int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1,
                       int64_t prefetch_bytes, c10::BFloat16* out) {
  constexpr int64_t bb = block_bytes(QT), qs = QT == kQ4_1 ? 4 : 2;
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), bias = _mm256_set1_epi32(0x43004300);
  for (int64_t n = n0; n + RT <= n1; n += RT) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[RT];
    __m256 accm = _mm256_setzero_ps();
    for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const auto* xb = reinterpret_cast<const __m256i*>(x + b * kBlock);
      const __m256bh x0 = (__m256bh)_mm256_loadu_si256(xb);
      const __m256bh x1 = (__m256bh)_mm256_loadu_si256(xb + 1);
      const __m256 dm = q4_headers<QT, RT>(wr + b * bb, row_bytes);
      accm = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xr.xm.data() + b * 8), accm);
#pragma GCC unroll 4
      for (int r = 0; r < RT; ++r) {
        const uint8_t* blk = wr + r * row_bytes + b * bb;
        __builtin_prefetch(blk + prefetch_bytes);
        const __m256i z =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs)));
        const __m256i q0 = _mm256_ternarylogic_epi32(z, low4, bias, 0xEA);
        const __m256i q1 = _mm256_ternarylogic_epi32(_mm256_srli_epi16(z, 4), low4, bias, 0xEA);
        __m256 s = _mm256_dpbf16_ps(_mm256_setzero_ps(), (__m256bh)q0, x0);
        s = _mm256_dpbf16_ps(s, (__m256bh)q1, x1);
        const __m256 d = _mm256_permutexvar_ps(_mm256_set1_epi32(2 * r), dm);
        acc[r] = _mm256_fmadd_ps(s, d, acc[r]);
      }
    }
    alignas(32) float m[8];
    _mm256_store_ps(m, accm);
    for (int r = 0; r < RT; ++r) {
      const __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc[r]),
                                  _mm256_extractf128_ps(acc[r], 1));
      const __m128 t = _mm_add_ps(a, _mm_movehl_ps(a, a));
      const float sum = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
      out[n + r] = c10::BFloat16(sum + (m[2 * r] + m[2 * r + 1]));
    }
  }
}

// Weight rows [n0, n1) of one row of x: 4 rows a pass for short rows, then the remainder one
// at a time; rows of kOneStreamRowBytes or more (quant_blocks.h) one at a time.
template <int64_t QT>
void q4_gemv_bf16(const Q4RowX<QT>& xr, const c10::BFloat16* x, const uint8_t* w,
                  int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, int64_t prefetch_bytes,
                  c10::BFloat16* out) {
  const int64_t tiled = row_bytes >= kOneStreamRowBytes ? n0 : n0 + (n1 - n0) / 4 * 4;
  q4_gemv_bf16_rows<QT, 4>(xr, x, w, row_bytes, nb, n0, tiled, prefetch_bytes, out);
  q4_gemv_bf16_rows<QT, 1>(xr, x, w, row_bytes, nb, tiled, n1, prefetch_bytes, out);
}

}  // namespace kvfleet::quant

#endif
