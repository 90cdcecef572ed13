// Row helpers for the bfloat16 kernels that must match PyTorch's bf16 ops bit for bit
// (fused_elementwise_bf16.cpp, fused_gemma_bf16.cpp): 16-lane loads that widen bf16 to float,
// stores that round to nearest even as c10::BFloat16(float) does, table lookups of a unary
// op's own bf16 results, and the float32 sum of squares in ATen's cascade-sum order.
//
// Every includer must be compiled without fast-math's licences (the pragma below precedes
// its includes there): the helpers rely on no reassociation, no FMA contraction and IEEE
// division and square root.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// The AVX-512 forms of the helpers below are the generic ones in intrinsics: the same bits,
// without GCC splitting the widening conversions or calling memcpy for partial chunks.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFLEET_AVX512 1
#include <immintrin.h>
#endif

namespace kvfleet_bf16 {

using BF16 = c10::BFloat16;

// GCC vector types: lane order and rounding are those of the scalar ops, on any ISA. Casts
// between them (C style, as GCC defines for vectors of one size) reinterpret the bits.
using f32x16 = float __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using u16x16 = uint16_t __attribute__((vector_size(32)));
using f32x8 = float __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));

constexpr int64_t kLanes = 16;

// Rounds each lane to the nearest bf16 (ties to even) as c10::BFloat16(float) does, keeping it
// in a float: the low 16 bits become zero. (Not vcvtneps2bf16: it flushes denormals to zero.)
inline f32x16 round_bf16(f32x16 f) {
  const u32x16 u = (u32x16)f;
  const u32x16 rounded = (u + (((u >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
  const u32x16 is_num = (u32x16)(f == f);  // all ones unless NaN
  const u32x16 bits = (rounded & is_num) | (0x7fc00000u & ~is_num);
  return (f32x16)bits;
}

#if KVFLEET_AVX512
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// n <= kLanes elements; lanes past n read as zero (never stored back).
inline f32x16 load(const BF16* p, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(first(n), p);
  return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);  // bf16: a float's top half
}

inline void store(BF16* p, f32x16 v, int64_t n) {
  const __m512i bits = _mm512_srli_epi32((__m512i)round_bf16(v), 16);
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(bits));
}

// table[bits of p[l]] for n lanes, widened to float (the table holds bf16 bit patterns and one
// entry of padding: the gather reads 32 bits, the shift keeps the addressed 16).
inline f32x16 lookup(const uint16_t* table, const BF16* p, int64_t n) {
  const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first(n), p));
  return (f32x16)_mm512_slli_epi32(_mm512_i32gather_epi32(index, table, 2), 16);
}

inline f32x8 squares8(const BF16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const f32x8 v = (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  return v * v;
}
#else
inline f32x16 load(const BF16* p, int64_t n) {
  u16x16 h = {};
  std::memcpy(&h, p, n * sizeof(uint16_t));
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}

inline void store(BF16* p, f32x16 v, int64_t n) {
  const u16x16 h = __builtin_convertvector((u32x16)round_bf16(v) >> 16, u16x16);
  std::memcpy(p, &h, n * sizeof(uint16_t));
}

inline f32x16 lookup(const uint16_t* table, const BF16* p, int64_t n) {
  u32x16 bits = {};
  for (int64_t l = 0; l < n; ++l) bits[l] = static_cast<uint32_t>(table[p[l].x]) << 16;
  return (f32x16)bits;
}

inline f32x8 squares8(const BF16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const f32x8 v = (f32x8)(__builtin_convertvector(h, u32x8) << 16);
  return v * v;
}
#endif

// body(i, n) for each chunk [i, i + n) of [0, size): full chunks, then the remainder.
template <typename F>
inline void for_each_chunk(int64_t size, F&& body) {
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) body(i, kLanes);
  if (i < size) body(i, size - i);
}

// fn of every bf16 bit pattern, computed once by PyTorch itself: a function of one bf16 has
// only 65,536 inputs, so a table makes a kernel's activation the PyTorch path's by
// construction (whatever exp or tanh ATen uses) and replaces the math by a gather. One entry of
// padding: `lookup` reads 32 bits at the last index.
inline std::vector<uint16_t> unary_table(at::Tensor (*fn)(const at::Tensor&)) {
  at::Tensor inputs = at::empty({65536}, at::kBFloat16);
  BF16* in = inputs.data_ptr<BF16>();
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    in[bits] = BF16(static_cast<uint16_t>(bits), BF16::from_bits());
  }
  const at::Tensor result = fn(inputs).contiguous();
  std::vector<uint16_t> t(65536 + 1, 0);
  std::memcpy(t.data(), result.data_ptr<BF16>(), 65536 * sizeof(uint16_t));
  return t;
}

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(float(row)^2) over n elements in exactly the order of ATen's cascade_sum for a contiguous
// inner reduction (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum), which is
// what `h.pow(2).mean(-1)` runs. PyTorch registers that kernel up to AVX2 only (an AVX-512 CPU
// runs the AVX2 one), hence 8-float vectors. Squares of bf16 values are exact in float32.
inline float sum_of_squares(const BF16* row, int64_t n) {
  constexpr int64_t kWidth = 8, kIlp = 4, kLevels = 4;
  const int64_t vectors = n / kWidth, groups = vectors / kIlp;
  const auto sq = [&](int64_t v) { return squares8(row + v * kWidth); };

  // multi_row_sum: kIlp interleaved vector accumulators, cascaded over kLevels levels.
  f32x8 acc[kLevels][kIlp] = {};
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += sq(i * kIlp + k);
    }
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = f32x8{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += sq(i * kIlp + k);
  }
  for (int64_t j = 1; j < kLevels; ++j) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += acc[j][k];
  }
  // row_sum: leftover vectors into the first accumulator, then the accumulators together.
  f32x8 total = acc[0][0];
  for (int64_t v = groups * kIlp; v < vectors; ++v) total += sq(v);
  for (int64_t k = 1; k < kIlp; ++k) total += acc[0][k];
  // vectorized_inner_sum: the scalar tail first, then the lanes in order.
  float sum = 0.f;
  for (int64_t e = vectors * kWidth; e < n; ++e) {
    const float h = static_cast<float>(row[e]);
    sum += h * h;
  }
  for (int64_t l = 0; l < kWidth; ++l) sum += total[l];
  return sum;
}

}  // namespace kvfleet_bf16
