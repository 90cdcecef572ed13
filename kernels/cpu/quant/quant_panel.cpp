// Quantized GEMM for 8-64 rows (engine/quant/qlinear.py): out = x @ dequant(W)^T, W a GGUF
// Q8_0 / Q4_0 / Q4_1 tensor [N, K] (quant_blocks.h).
//
// Why a second kernel: quant_gemm.cpp dequantizes each block in registers and re-dequantizes
// it for every 8 rows of x, so at 32 rows the dequantization costs as much as the FMAs; the
// old alternative, dequantizing the whole weight to float32 before BLAS, writes and re-reads
// 4 bytes a weight every step. Here each task dequantizes a panel of kPanel weight rows x the
// full K into a buffer that stays in L1/L2 (32 x 1536 x 4 bytes = 192 KiB at most for the
// default model), then a register-blocked micro-kernel runs every row of x against it:
// 4 rows of x x 4 weight rows = 16 vector accumulators along K, reduced at the end by one
// transpose-and-add network (simd.h's reduce16). Tasks are panels, split over OpenMP threads.
//
// Numerics: float32 x -> float32 panel and FMAs (only the summation order differs from
// dequantize-then-matmul, so the float32 exactness tests hold); bfloat16 x (a bfloat16 model)
// -> the panel rounded to bfloat16 (as the bfloat16 dense copy holds the weights) and
// AVX512_BF16 dot products with float32 accumulation, the output rounded to bfloat16 as
// F.linear's is. The bfloat16 path exists only where the compiler targets AVX512_BF16
// (quant_has_bf16_dot); elsewhere the caller converts x to float32.
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

namespace {

using kvfleet::load16;
using kvfleet::reduce16;
using kvfleet::store16;
using kvfleet::v16;
using namespace kvfleet::quant;

constexpr int64_t kPanel = 32;  // weight rows dequantized per task
constexpr int kTile = 4;        // rows of x, and weight rows, per micro-kernel call

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

// The panel starting at weight row `start` (up to kPanel rows before n1), fetched over the two
// 16-row halves x nb blocks of the current panel's decoding.
inline NextPanel next_panel(const uint8_t* w, int64_t row_bytes, int64_t start, int64_t n1,
                            int64_t nb) {
  const int64_t rows = std::max<int64_t>(0, std::min(kPanel, n1 - start));
  return {reinterpret_cast<const char*>(w + start * row_bytes), rows * row_bytes, 2 * nb};
}

// float32: rows [0, rows) of w dequantized into buf in the dense float32 panel layout
// (panel_linear.cpp's): [K][kPanel], weight k of row n at buf[k * kPanel + n]; rows past
// `rows` are zero. 16 rows' blocks are transposed in registers, as for bfloat16.
template <int64_t QT>
void dequant_f32(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t rows, float* buf,
                 NextPanel next) {
  constexpr int64_t bb = block_bytes(QT);
  for (int64_t h = 0; h < kPanel; h += 16) {
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
      float* o = buf + kBlock * b * kPanel + h;
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_si512(o + j * kPanel, lo[j]);
        _mm512_storeu_si512(o + (16 + j) * kPanel, hi[j]);
      }
    }
  }
}

// MR rows of x (float32) x the panel's 32 columns: per k two panel vectors, each row's x[k]
// broadcast into two FMAs; each output is one chain of FMAs along k.
template <int MR>
void micro_f32(const float* x, int64_t ldx, const float* panel, int64_t k, float* out,
               int64_t ldo, int64_t cols) {
  v16 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = v16{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const v16 b0 = load16(panel + kk * kPanel), b1 = load16(panel + kk * kPanel + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const v16 xi = kvfleet::bcast(x[i * ldx + kk]);
      acc0[i] += xi * b0;
      acc1[i] += xi * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float tmp[kPanel];
    store16(tmp, acc0[i]);
    store16(tmp + 16, acc1[i]);
    std::memcpy(out + i * ldo, tmp, sizeof(float) * cols);
  }
}

using MicroF32 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                          int64_t);
constexpr MicroF32 kMicroF32[12] = {micro_f32<1>, micro_f32<2>, micro_f32<3>,  micro_f32<4>,
                                    micro_f32<5>, micro_f32<6>, micro_f32<7>,  micro_f32<8>,
                                    micro_f32<9>, micro_f32<10>, micro_f32<11>, micro_f32<12>};

// Every row of x against weight rows [n0, n1), float32: as panels_bf16.
template <int64_t QT>
void panels_f32(const float* x, int64_t ldx, int64_t m_rows, const uint8_t* w,
                int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, float* out,
                int64_t ldo) {
  const int64_t k = nb * kBlock;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < kPanel * k) buf.resize(kPanel * k);
  const int64_t blocks = (m_rows + 11) / 12;
  for (int64_t p = n0; p < n1; p += kPanel) {
    const int64_t cols = std::min(kPanel, n1 - p);
    dequant_f32<QT>(w + p * row_bytes, row_bytes, nb, cols, buf.data(),
                    next_panel(w, row_bytes, p + cols, n1, nb));
    for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
      const int64_t mr = (m_rows - m) / (blocks - blk);
      kMicroF32[mr - 1](x + m * ldx, ldx, buf.data(), k, out + m * ldo + p, ldo, cols);
      m += mr;
    }
  }
}
#endif

#ifdef __AVX512BF16__
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

// Rows [0, rows) of w dequantized to bfloat16 into buf in the dense bfloat16 panel layout
// (kernels/cpu/panel_linear.cpp's): [K / 2][kPanel] k-pairs, pair j of weight row n at
// buf[j * kPanel + n]; rows past `rows` are zero. Each block of 16 weight rows is transposed
// in registers, so every store is a full 64-byte line.
template <int64_t QT>
void dequant_pairs(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t rows,
                   uint32_t* buf, NextPanel next) {
  constexpr int64_t bb = block_bytes(QT);
  for (int64_t h = 0; h < kPanel; h += 16) {
    for (int64_t b = 0; b < nb; ++b) {
      next.step();
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = h + i < rows ? block_pairs<QT>(w + (h + i) * row_bytes + b * bb)
                            : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(buf + (16 * b + j) * kPanel + h, r[j]);
    }
  }
}

// MR rows of x (bfloat16) x the panel's 32 columns: per k-pair two panel vectors, each row's
// pair broadcast into two VDPBF16PS; float32 sums rounded once to bfloat16 on store.
template <int MR>
void micro_bcast(const uint16_t* x, int64_t ldx, const uint32_t* panel, int64_t pairs,
                 c10::BFloat16* out, int64_t ldo, int64_t cols) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + j * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + j * kPanel + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * j, sizeof pair);
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], xi, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], xi, b1);
    }
  }
  for (int i = 0; i < MR; ++i) {
    c10::BFloat16 tmp[kPanel];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)_mm512_cvtneps_pbh(acc0[i]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16),
                        (__m256i)_mm512_cvtneps_pbh(acc1[i]));
    std::memcpy(out + i * ldo, tmp, sizeof(c10::BFloat16) * cols);
  }
}

using MicroBcast = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, c10::BFloat16*,
                            int64_t, int64_t);
constexpr int kMaxRows = 12;  // 24 accumulators of the 32 vector registers
constexpr MicroBcast kMicroBcast[kMaxRows] = {
    micro_bcast<1>, micro_bcast<2>, micro_bcast<3>, micro_bcast<4>,  micro_bcast<5>,
    micro_bcast<6>, micro_bcast<7>, micro_bcast<8>, micro_bcast<9>, micro_bcast<10>,
    micro_bcast<11>, micro_bcast<12>};

// Every row of x against weight rows [n0, n1), bfloat16: one panel dequantized at a time, then
// all of x in blocks of up to kMaxRows rows against it.
template <int64_t QT>
void panels_bf16(const uint16_t* x, int64_t ldx, int64_t m_rows, const uint8_t* w,
                 int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, c10::BFloat16* out,
                 int64_t ldo) {
  const int64_t pairs = nb * kBlock / 2;
  thread_local std::vector<uint32_t> buf;
  if (static_cast<int64_t>(buf.size()) < kPanel * pairs) buf.resize(kPanel * pairs);
  // Equal row blocks (32 rows: 11 + 11 + 10, not 12 + 12 + 8): no short block at the end.
  const int64_t blocks = (m_rows + kMaxRows - 1) / kMaxRows;
  for (int64_t p = n0; p < n1; p += kPanel) {
    const int64_t cols = std::min(kPanel, n1 - p);
    dequant_pairs<QT>(w + p * row_bytes, row_bytes, nb, cols, buf.data(),
                      next_panel(w, row_bytes, p + cols, n1, nb));
    for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
      const int64_t mr = (m_rows - m) / (blocks - blk);
      kMicroBcast[mr - 1](x + m * ldx, ldx, buf.data(), pairs, out + m * ldo + p, ldo, cols);
      m += mr;
    }
  }
}
#endif

// float32: rows [0, rows) of w dequantized into buf [round_up(rows, 4), k]; the padding rows
// are zero so the micro-kernel always reads 4 weight rows.
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

// Every row of x against weight rows [n0, n1), one panel at a time.
template <int64_t QT, typename E, typename O>
void panels(const E* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
            int64_t nb, int64_t n0, int64_t n1, O* out, int64_t ldo) {
  const int64_t k = nb * kBlock;
  thread_local std::vector<E> buf;
  if (static_cast<int64_t>(buf.size()) < kPanel * k) buf.resize(kPanel * k);
  for (int64_t p = n0; p < n1; p += kPanel) {
    const int64_t rows = std::min(kPanel, n1 - p);
    dequant_panel<QT>(w + p * row_bytes, row_bytes, nb, rows, buf.data());
    for (int64_t m = 0; m < m_rows; m += kTile) {
      const int mr = static_cast<int>(std::min<int64_t>(kTile, m_rows - m));
      const E* xm = x + m * ldx;
      for (int64_t t = 0; t < rows; t += kTile) {
        const E* wt = buf.data() + t * k;
        const v16 s = mr == 4   ? micro<4>(xm, ldx, wt, k)
                      : mr == 3 ? micro<3>(xm, ldx, wt, k)
                      : mr == 2 ? micro<2>(xm, ldx, wt, k)
                                : micro<1>(xm, ldx, wt, k);
        store_tile(s, mr, std::min<int64_t>(kTile, rows - t), out + m * ldo + p + t, ldo);
      }
    }
  }
}

template <typename E, typename O>
void run(const E* x, int64_t ldx, int64_t m_rows, const uint8_t* w, int64_t row_bytes,
         int64_t nb, int64_t n, O* out, int64_t ldo, int64_t qtype) {
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = p0 * kPanel, n1 = std::min(n, p1 * kPanel);
    dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<E, uint16_t>) {
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

bool quant_has_bf16_dot() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ dequant(w [N, row bytes] uint8)^T. x float32 -> out float32;
// x bfloat16 (only where quant_has_bf16_dot) -> out bfloat16. out may be a column slice of a
// wider output (unit column stride), as for quant_linear.
void quant_linear_panel(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                        int64_t qtype) {
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
    run(xp, ldx, m_rows, wp, row_bytes, nb, n, out.data_ptr<c10::BFloat16>(), ldo, qtype);
    return;
  }
#endif
  run(x.data_ptr<float>(), ldx, m_rows, wp, row_bytes, nb, n, out.data_ptr<float>(), ldo,
      qtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_quant, m) {
  m.def("quant_linear_panel(Tensor(a!) out, Tensor x, Tensor w, int qtype) -> ()");
  m.def("quant_has_bf16_dot() -> bool");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("quant_linear_panel", &quant_linear_panel);
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CompositeExplicitAutograd, m) {
  m.impl("quant_has_bf16_dot", &quant_has_bf16_dot);
}
