// GGUF block formats Q8_0 / Q4_0 / Q4_1 decoded into float vectors: shared by the quantized
// GEMM kernels (quant_gemm.cpp: dequantize in registers; quant_panel.cpp: dequantize a panel
// into a cache-resident buffer).
//
// A block is 32 weights along K, bytes as in the file (ggml's block_q8_0 / block_q4_0 /
// block_q4_1). Values are d * q (+ m) in float32, as gguf-py and ggml compute them, up to the
// contraction of d * q + m into one rounding.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "../simd.h"

namespace kvfleet::quant {

using kvfleet::v16;

typedef uint8_t v16b __attribute__((vector_size(16)));

// ggml's type ids (GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

// Rows at least this long run one at a time: four interleaved rows are four DRAM streams
// then (a row of 8+ cache lines), which Zen 4 read at 8.6-9.3 GB/s against 12.1-12.8 for one
// (SmolLM2's down projection, 960-byte rows; docs/quantization.md), as the Q8_0 kernel found
// for its 612-byte rows. Shorter rows' tile of four is nearly one stream, and four rows
// share the header conversion: 4 rows a pass won there (gate/up, 360-byte rows: 2.3-2.6
// against 2.7-2.9 ms a sweep).
constexpr int64_t kOneStreamRowBytes = 512;

// Bytes of one block of `qtype`; -1 for a type no kernel reads.
constexpr int64_t block_bytes(int64_t qtype) {
  return qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : -1;
}

inline float half_at(const uint8_t* p) {
#ifdef __F16C__
  // One instruction; c10::Half's portable conversion is a dozen, per block of 32 weights.
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
#else
  c10::Half h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
#endif
}

inline v16b bytes16(const uint8_t* p) {
  v16b b;
  std::memcpy(&b, p, sizeof b);
  return b;
}

// Widen to int32 first: GCC scalarises a direct uint8 -> float vector conversion.
inline v16 to_float(v16b b) {
  return __builtin_convertvector(__builtin_convertvector(b, kvfleet::v16i), v16);
}

// Elements 0..15 of a block into `lo`, 16..31 into `hi`.
template <int64_t QT>
inline void dequant(const uint8_t* blk, v16& lo, v16& hi) {
  if constexpr (QT == kQ8_0) {
    const float d = half_at(blk);
    // Bytes as unsigned, re-centred (q ^ 0x80 is q + 128): the unsigned widening vectorises.
    lo = (to_float(bytes16(blk + 2) ^ 0x80) - 128.f) * d;
    hi = (to_float(bytes16(blk + 18) ^ 0x80) - 128.f) * d;
  } else if constexpr (QT == kQ4_0) {
    const float d = half_at(blk);
    const v16b q = bytes16(blk + 2);
    lo = (to_float(q & 15) - 8.f) * d;
    hi = (to_float(q >> 4) - 8.f) * d;
  } else {  // Q4_1
    const float d = half_at(blk), m = half_at(blk + 2);
    const v16b q = bytes16(blk + 4);
    lo = to_float(q & 15) * d + m;
    hi = to_float(q >> 4) * d + m;
  }
}

template <int64_t QT>
using QType = std::integral_constant<int64_t, QT>;

// Calls f(QType<QT>{}) for the runtime type id (one of the three above), so a generic lambda
// gets the format as a compile-time constant: decltype(qt)::value.
template <typename F>
inline void dispatch(int64_t qtype, F&& f) {
  if (qtype == kQ8_0) f(QType<kQ8_0>{});
  else if (qtype == kQ4_0) f(QType<kQ4_0>{});
  else f(QType<kQ4_1>{});
}

}  // namespace kvfleet::quant
