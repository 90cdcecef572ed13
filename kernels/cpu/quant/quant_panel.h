// The panel kernels' shared parts (quant_panel.cpp, quant_panel_bf16.h): the loop over panels
// and row blocks, the 16 x 16 register transpose that writes a decoded panel in full lines,
// and the next panel's prefetch.
//
// A panel is kPanel (panel_layout.h) weight rows x the full K, decoded into a buffer that
// stays in L2 while every block of rows of x passes over it. Row blocks are equal (32 rows at
// 12: 11 + 11 + 10, not 12 + 12 + 8), so no short block runs at the end.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef __AVX512BF16__
#include <c10/util/BFloat16.h>
#endif

#include "../panel_layout.h"

namespace kvfleet::quant {

constexpr int64_t kPanelRows = kvfleet_panel::kPanel;  // weight rows decoded per panel

// Prefetches the next panel's bytes (contiguous; none when bytes is 0) towards L2 a few lines
// per step(), spread over `steps` calls while this panel is decoded: decoding reads 16 rows at
// once, 16 streams the hardware prefetcher follows badly, and a burst of hundreds of
// prefetches stalls on the line-fill queue.
struct NextPanel {
  const char* p;
  int64_t bytes, steps, done = 0, fetched = 0;
  void step() {
    const int64_t until = bytes * ++done / steps;
    for (; fetched < until; fetched += 64) __builtin_prefetch(p + fetched, 0, 2);
  }
};

// The panel starting at weight row `start` (up to kPanelRows rows before n1), fetched over the
// two 16-row halves x nb blocks of the current panel's decoding.
inline NextPanel next_panel(const uint8_t* w, int64_t row_bytes, int64_t start, int64_t n1,
                            int64_t nb) {
  const int64_t rows = std::max<int64_t>(0, std::min(kPanelRows, n1 - start));
  return {reinterpret_cast<const char*>(w + start * row_bytes), rows * row_bytes, 2 * nb};
}

// Weight rows [n0, n1) of w (row_bytes a row, nb blocks) against every one of m_rows rows of
// x, one panel at a time. Panel supplies kRows (most rows of x per micro-kernel call),
// decode(first row, rows, next) and multiply(first x row, rows of x, first column, columns).
template <class Panel>
void run_panels(Panel& panel, int64_t m_rows, const uint8_t* w, int64_t row_bytes, int64_t nb,
                int64_t n0, int64_t n1) {
  const int64_t blocks = (m_rows + Panel::kRows - 1) / Panel::kRows;
  for (int64_t p = n0; p < n1; p += kPanelRows) {
    const int64_t cols = std::min(kPanelRows, n1 - p);
    panel.decode(w + p * row_bytes, cols, next_panel(w, row_bytes, p + cols, n1, nb));
    for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
      const int64_t mr = (m_rows - m) / (blocks - blk);
      panel.multiply(m, mr, p, cols);
      m += mr;
    }
  }
}

#ifdef __AVX512BF16__
// The bfloat16 micro-kernels' one step (quant_panel_bf16.h, quant_panel_q4f.h,
// quant_panel_q4p.h): each of MR rows' k-pair at x + i * ldx broadcast into two VDPBF16PS
// against the panel's two 16-column lines b0, b1.
template <int MR>
__attribute__((always_inline)) inline void pair_step(const uint16_t* x, int64_t ldx,
                                                     __m512bh b0, __m512bh b1, __m512 s0[MR],
                                                     __m512 s1[MR]) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    uint32_t pair;
    std::memcpy(&pair, x + i * ldx, sizeof pair);
    const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
    s0[i] = _mm512_dpbf16_ps(s0[i], xi, b0);
    s1[i] = _mm512_dpbf16_ps(s1[i], xi, b1);
  }
}

// MR rows of 32 float32 sums rounded once to bfloat16, the first `cols` of each stored.
template <int MR>
inline void store_rows_bf16(const __m512 acc0[MR], const __m512 acc1[MR], c10::BFloat16* out,
                            int64_t ldo, int64_t cols) {
  for (int i = 0; i < MR; ++i) {
    c10::BFloat16 tmp[kPanelRows];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)_mm512_cvtneps_pbh(acc0[i]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16),
                        (__m256i)_mm512_cvtneps_pbh(acc1[i]));
    std::memcpy(out + i * ldo, tmp, sizeof(c10::BFloat16) * cols);
  }
}
#endif

#ifdef __AVX512F__
// r[i] lane j -> r[j] lane i (16 x 16 32-bit lanes): 32-bit then 64-bit interleaves within
// 128-bit lanes, then two rounds of 128-bit lane shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + e], lane L: element 4L + e of rows 4g .. 4g + 3.
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}
#endif

}  // namespace kvfleet::quant
