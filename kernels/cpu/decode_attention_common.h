// Pieces shared by the paged decode attention kernels (paged_decode_attention.cpp): the
// problem description, the kernel layout of cache rows, the P*V accumulation and the row
// helpers. See that file for the algorithm.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_rows.h"
#include "simd.h"

namespace kvfleet::decode {

using kvfleet::bcast;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;
using kvfleet::v16u;

constexpr int kChunk = 16;
constexpr float kNeg = -1e30f;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Problem {
  const T* q;
  int64_t q_tok, q_head;
  T* out;
  int64_t o_tok, o_head;
  const T* k_cache;
  const T* v_cache;
  int64_t block_size, kv_heads, heads, group;
  const int32_t* tables;
  int64_t table_width;
  const int32_t* lens;
  float scale;  // softmax scale * log2(e)
  // Sliding window (a request's query sees its last `window` positions; 0: all) and tanh
  // logit cap (0: none); the shared-prefix path supports neither.
  int32_t window = 0;
  float softcap = 0.f;
};

struct Item {
  int32_t request, kv_begin, kv_end;
};

inline float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats + 16) buf.resize(floats + 16);
  float* p = buf.data();
  return p + (16 - (reinterpret_cast<uintptr_t>(p) / sizeof(float)) % 16) % 16;
}

// Cache rows are read straight into registers in a "kernel layout" of D: for bfloat16 with D a
// multiple of 32, each 32 elements load as one 64-byte vector whose 16 even elements (low
// halves: shift left) and 16 odd elements (high halves: mask) become two float vectors, one
// ALU op each instead of a widening shuffle. q and O use the same layout, so dot products and
// axpys are unchanged; only the final output is permuted back. Otherwise the layout is D's own.
template <typename T, int D>
struct Layout {
  static constexpr bool kSplit = !std::is_same_v<T, float> && D % 32 == 0;

  // v[0..n) = row elements [c0, c0 + 16 n) in kernel layout (c0, n multiples of 32 / 2 when
  // split).
  template <int N>
  static inline void load(const T* row, int c0, v16* v) {
    if constexpr (kSplit) {
      const uint32_t mask = 0xFFFF0000u;
#pragma GCC unroll 8
      for (int c = 0; c < N; c += 2) {
        v16u raw;
        std::memcpy(&raw, row + c0 + c * 16, sizeof raw);
        const v16u lo = raw << 16, hi = raw & mask;
        std::memcpy(&v[c], &lo, sizeof lo);
        std::memcpy(&v[c + 1], &hi, sizeof hi);
      }
    } else {
#pragma GCC unroll 8
      for (int c = 0; c < N; ++c) v[c] = load16(row + c0 + c * 16);
    }
  }

  // Natural index of kernel-layout index k.
  static inline int natural(int k) {
    if constexpr (kSplit) return k / 32 * 32 + (k % 16) * 2 + (k % 32) / 16;
    return k;
  }
};

// o[h][:] += sum_j p[h][j] * V[j][:] for HT heads (rows of o and p `o_stride`/`p_stride`
// apart), keys j < n; CV vectors of D per register block. o is in kernel layout.
template <typename T, int D, int HT>
inline void accumulate_pv(const float* __restrict p, int64_t p_stride, const T* const* v, int n,
                          float* __restrict o) {
  constexpr int CV = D >= 64 ? 4 : D / 16;
  for (int dh = 0; dh < D; dh += CV * 16) {
    v16 acc[HT][CV];
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h)
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) acc[h][c] = load16(o + h * D + dh + c * 16);
    for (int j = 0; j < n; ++j) {
      v16 vv[CV];
      Layout<T, D>::template load<CV>(v[j], dh, vv);
#pragma GCC unroll 4
      for (int h = 0; h < HT; ++h) {
        const v16 b = bcast(p[h * p_stride + j]);
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) acc[h][c] += b * vv[c];
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h)
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) store16(o + h * D + dh + c * 16, acc[h][c]);
  }
}

template <typename T, int D>
inline void accumulate_group(const float* p, int64_t p_stride, const T* const* v, int n,
                             float* o, int64_t group) {
  // Up to four heads per register block.
  for (int64_t h = 0; h < group; h += 4) {
    const float* ph = p + h * p_stride;
    float* oh = o + h * D;
    switch (std::min<int64_t>(4, group - h)) {
      case 1: accumulate_pv<T, D, 1>(ph, p_stride, v, n, oh); break;
      case 2: accumulate_pv<T, D, 2>(ph, p_stride, v, n, oh); break;
      case 3: accumulate_pv<T, D, 3>(ph, p_stride, v, n, oh); break;
      default: accumulate_pv<T, D, 4>(ph, p_stride, v, n, oh); break;
    }
  }
}

// Prefetches into L2 elements [lo, hi) of the chunk's V rows while its K rows are read: pass 3
// then finds V in L2 (a request's V is well under 1 MB) and the two streams overlap in pass 1
// (bfloat16 from DRAM ~15% faster; float32 is bandwidth-bound either way).
template <typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* cache, const int32_t* table,
                                                         int64_t block_size, int64_t row,
                                                         int64_t c0, int n, int64_t lo,
                                                         int64_t hi) {
  const T* rows[kChunk];
  kvfleet::chunk_rows(cache, table, block_size, row, c0, n, rows);
  for (int j = 0; j < n; ++j) {
    const char* end = reinterpret_cast<const char*>(rows[j] + hi);
    for (const char* p = reinterpret_cast<const char*>(rows[j] + lo); p < end; p += 64)
      __builtin_prefetch(p, 0, 2);
  }
}

// Head pointers of a chunk's rows; positions past n repeat row n - 1 (read, never used).
template <typename T>
inline void head_rows(const T* const* rows, int64_t offset, int n, const T** dst) {
  for (int j = 0; j < kChunk; ++j) dst[j] = rows[j < n ? j : n - 1] + offset;
}

}  // namespace kvfleet::decode
