// Portable 16-lane float vectors (GCC/Clang vector extensions) for the attention kernels.
//
// The extension code compiles to one AVX-512 register per v16 under -march=native on an
// AVX-512 machine and to pairs/quads of narrower registers elsewhere, so the kernels need no
// intrinsics and no second code path. Loads and stores go through memcpy: unaligned access is
// allowed everywhere and the compiler turns it into plain vector moves.
//
// exp2v is a polynomial exp2 (relative error ~2e-7) valid for x <= 0, which is all softmax
// needs once the running maximum is subtracted; inputs below -126 are clamped (the result is
// then ~1e-38, never denormal, never zero: callers zero masked terms explicitly).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace kvfleet {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v16 bcast(float x) { return v16{} + x; }

__attribute__((always_inline)) inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widen and shift.
__attribute__((always_inline)) inline v16 load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  v16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store16(float* p, v16 v) {
  std::memcpy(p, &v, sizeof v);
}

__attribute__((always_inline)) inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

__attribute__((always_inline)) inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

__attribute__((always_inline)) inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Permutes of the 16x16 transpose network: round s (8, 4, 2, 1) exchanges bit s of the row
// and lane indices between rows i and i + s; kLo[k]/kHi[k] build the new rows i and i + s from
// (rows[i], rows[i + s]) for s = 8 >> k.
constexpr v16i kLo[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
constexpr v16i kHi[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

// In-register transpose of a 16x16 block (rows[i] lane j -> rows[j] lane i).
__attribute__((always_inline)) inline void transpose16(v16* rows) {
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const int s = 8 >> k;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & s) continue;
      const v16 a = rows[i], b = rows[i + s];
      rows[i] = __builtin_shuffle(a, b, kLo[k]);
      rows[i + s] = __builtin_shuffle(a, b, kHi[k]);
    }
  }
}

// Lane j of the result = the sum of rows[j]'s lanes (rows is clobbered). The transpose network
// with each exchanged pair added instead of kept: after round s a row's bit s indexes the
// original lane, the index being summed over, so the pair may be merged (the remaining rounds
// treat both rows alike). 30 permutes and 15 adds instead of 16 horizontal sums.
__attribute__((always_inline)) inline v16 reduce16(v16* rows) {
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const int s = 8 >> k;
#pragma GCC unroll 8
    for (int i = 0; i < s; ++i) {
      const v16 a = rows[i], b = rows[i + s];
      rows[i] = __builtin_shuffle(a, b, kLo[k]) + __builtin_shuffle(a, b, kHi[k]);
    }
  }
  return rows[0];
}

// Lane indices 0..15, for masking partial chunks.
constexpr v16 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// 2^x for x <= 0: x = n + f with n integer, f in (-0.5, 0.5]; 2^f by its degree-6 Taylor
// polynomial (error < 1.2e-7 relative on that range), 2^n by building the exponent bits.
__attribute__((always_inline)) inline v16 exp2v(v16 x) {
  const v16 lo = bcast(-126.f);
  x = x < lo ? lo : x;
  // Truncation toward zero of x - 0.5 rounds x <= 0 to the nearest integer.
  const v16i n = __builtin_convertvector(x - 0.5f, v16i);
  const v16 f = x - __builtin_convertvector(n, v16);
  v16 p = bcast(1.5403530393381606e-4f);  // ln2^6 / 720
  p = p * f + 1.3333558146428443e-3f;     // ln2^5 / 120
  p = p * f + 9.6181291076284772e-3f;     // ln2^4 / 24
  p = p * f + 5.5504108664821580e-2f;     // ln2^3 / 6
  p = p * f + 2.4022650695910071e-1f;     // ln2^2 / 2
  p = p * f + 6.9314718055994531e-1f;     // ln2
  p = p * f + 1.f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh(x) by exp2v: sign(x) (1 - e) / (1 + e) with e = 2^(-2 |x| log2 e), in exp2v's domain
// (x <= 0 there); absolute error ~1e-7. For logit soft-capping.
__attribute__((always_inline)) inline v16 tanhv(v16 x) {
  const v16 ax = x < 0.f ? -x : x;
  const v16 e = exp2v(ax * (-2.f * 1.4426950408889634f));
  const v16 t = (1.f - e) / (1.f + e);
  return x < 0.f ? -t : t;
}

// Scores in the kernels' log2 domain (s = q.k * scale * log2 e) soft-capped as transformers
// caps the natural ones: cap * tanh(s_nat / cap), back into log2.
__attribute__((always_inline)) inline v16 softcap_log2(v16 s, float cap) {
  constexpr float kLn2 = 0.6931471805599453f;
  return tanhv(s * (kLn2 / cap)) * (cap * 1.4426950408889634f);
}

}  // namespace kvfleet
