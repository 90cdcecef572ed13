// Decode attention over a prefix that several requests of the batch share (the same cached
// blocks at the start of their block tables: a common system prompt, a few-shot preamble).
//
// The plain decode kernel reads a shared block once per request; every K row then meets only
// the `group` query heads of its KV head (3 for SmolLM2), so it is bound by loads. Here one
// work item takes up to ~32 query heads of one KV head (the group's heads of up to ~10
// requests) against the shared positions, so each K and V row loaded serves all of them:
//   1. two chunks of 16 K rows are transposed into [D][32] (16x16 in-register transposes),
//      then blocks of 12 queries x 32 keys are D broadcast-FMAs each (no horizontal
//      reduction; each K vector loaded meets 12 queries, not 4: ~8% less time a layer for 64
//      requests in 8 groups of a 512-token prefix, SmolLM2 shapes, same bits);
//   2. softmax pieces per query: m = the maximum score, l = sum of exp2(s - m);
//   3. o = sum of exp2(s - m) * V, unnormalised, in the kernel layout of D.
// (m, l, o) per (request, query head) are merged with the request's own positions by the
// plain kernel (paged_decode_attention.cpp, `run_item` with a prefix), which rescales both
// parts to their common maximum: softmax(all) V computed in two pieces, as FlashAttention's
// split-K / cascade attention do. Rounding differs from the one-piece order by a few ulps.
#pragma once

#include <algorithm>
#include <cstdint>

#include "decode_attention_common.h"

namespace kvfleet::decode {

// Softmax pieces of each (request, query head) over its shared prefix; rows [r * H + h].
struct Partials {
  float* m;  // [B * H] maximum score (log2 domain)
  float* l;  // [B * H] sum of exp2(score - m)
  float* o;  // [B * H * D] sum of exp2(score - m) * V, kernel layout
};

// One item: requests members[0..n) share `len` positions (a multiple of 16) of KV head kh.
struct PrefixItem {
  const int32_t* members;
  int32_t n, len, kv_head;
};

// rows = the 16 rows of shared chunk c0 of `cache`; KV head kh of the next chunk's rows is
// prefetched meanwhile (a group's shared run is read once, so nothing else brings it in early).
template <typename T, int D>
inline void chunk_and_next(const Problem<T>& pb, const T* cache, const int32_t* table,
                           int64_t c0, int64_t len, int64_t kh, const T** rows) {
  const int64_t row = pb.kv_heads * D;
  kvfleet::chunk_rows(cache, table, pb.block_size, row, c0, kChunk, rows);
  if (c0 + kChunk < len)
    prefetch_rows(cache, table, pb.block_size, row, c0 + kChunk, kChunk, kh * D, (kh + 1) * D);
}

// Scores of QB queries (q rows D apart, scaled) against NC transposed chunks of 16 keys
// (kt [D][32], chunk h at lane offset 16 h): s[q][16 h + t], rows `stride` apart; rows past
// `valid` are padding and not stored. Each score sums over d in increasing order.
template <int D, int QB, int NC>
inline void prefix_scores(const float* __restrict qs, const float* __restrict kt,
                          float* __restrict s, int64_t stride, int64_t valid) {
  v16 acc[QB][NC];
#pragma GCC unroll 12
  for (int q = 0; q < QB; ++q)
#pragma GCC unroll 2
    for (int h = 0; h < NC; ++h) acc[q][h] = v16{};
  for (int d = 0; d < D; ++d) {
    v16 k[NC];
#pragma GCC unroll 2
    for (int h = 0; h < NC; ++h) k[h] = load16(kt + d * 2 * kChunk + h * 16);
#pragma GCC unroll 12
    for (int q = 0; q < QB; ++q) {
      const v16 b = bcast(qs[q * D + d]);
#pragma GCC unroll 2
      for (int h = 0; h < NC; ++h) acc[q][h] += b * k[h];
    }
  }
  for (int q = 0; q < QB && q < valid; ++q)
    for (int h = 0; h < NC; ++h) store16(s + q * stride + h * 16, acc[q][h]);
}

// The next up-to-12 query rows (`left` of them padded to a multiple of 4, `valid` real).
template <int D, int NC>
inline void prefix_block(const float* qs, const float* kt, float* s, int64_t stride,
                         int64_t valid, int64_t left) {
  if (left >= 12) return prefix_scores<D, 12, NC>(qs, kt, s, stride, valid);
  if (left == 8) return prefix_scores<D, 8, NC>(qs, kt, s, stride, valid);
  prefix_scores<D, 4, NC>(qs, kt, s, stride, valid);
}

template <typename T, int D>
void prefix_partials(const Problem<T>& pb, const PrefixItem& it, const Partials& out) {
  using L = Layout<T, D>;
  const int64_t g = pb.group, nq = it.n * g, nq4 = (nq + 3) / 4 * 4;
  const int64_t len = it.len, kh = it.kv_head;
  const int32_t* table = pb.tables + static_cast<int64_t>(it.members[0]) * pb.table_width;
  // Scratch: q [nq4][D] (padding rows zero), scores then probabilities [nq][len],
  // o [nq][D], two transposed K chunks [D][32].
  float* qs = thread_scratch(nq4 * D + nq * (len + D) + D * 2 * kChunk);
  float* s = qs + nq4 * D;
  float* o = s + nq * len;
  float* kt = o + nq * D;
  for (int64_t i = 0; i < nq4; ++i) {
    const T* src = i < nq ? pb.q + it.members[i / g] * pb.q_tok + (kh * g + i % g) * pb.q_head
                          : nullptr;
    for (int k = 0; k < D; ++k)
      qs[i * D + k] = src ? static_cast<float>(src[L::natural(k)]) * pb.scale : 0.f;
  }
  for (int64_t i = 0; i < nq * D; i += 16) store16(o + i, v16{});

  const T* rows[kChunk];
  for (int64_t c0 = 0; c0 < len; c0 += 2 * kChunk) {
    // Two chunks (32 keys) at a time when there are two: 12 queries x 2 key vectors per
    // register block, so each loaded K vector meets 12 broadcast queries (FMA-bound).
    const int nc = c0 + kChunk < len ? 2 : 1;
    for (int h = 0; h < nc; ++h) {
      chunk_and_next<T, D>(pb, pb.k_cache, table, c0 + h * kChunk, len, kh, rows);
      v16 blk[D / 16][kChunk];
      for (int j = 0; j < kChunk; ++j) {
        v16 r[D / 16];
        L::template load<D / 16>(rows[j] + kh * D, 0, r);
        for (int c = 0; c < D / 16; ++c) blk[c][j] = r[c];
      }
      for (int c = 0; c < D / 16; ++c) {
        kvfleet::transpose16(blk[c]);
        for (int t = 0; t < kChunk; ++t)
          store16(kt + (c * 16 + t) * 2 * kChunk + h * 16, blk[c][t]);
      }
    }
    for (int64_t i0 = 0; i0 < nq4; i0 += 12) {
      float* si = s + i0 * len + c0;
      if (nc == 2)
        prefix_block<D, 2>(qs + i0 * D, kt, si, len, nq - i0, nq4 - i0);
      else
        prefix_block<D, 1>(qs + i0 * D, kt, si, len, nq - i0, nq4 - i0);
    }
  }

  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * len;
    v16 mx = bcast(kNeg);
    for (int64_t c = 0; c < len; c += 16) mx = vmax(mx, load16(si + c));
    const float m = kvfleet::hmax(mx);
    v16 sum = v16{};
    for (int64_t c = 0; c < len; c += 16) {
      const v16 e = kvfleet::exp2v(load16(si + c) - m);
      sum += e;
      store16(si + c, e);
    }
    const int64_t rh = it.members[i / g] * pb.heads + kh * g + i % g;
    out.m[rh] = m;
    out.l[rh] = kvfleet::hsum(sum);
  }

  const T* head[kChunk];
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    chunk_and_next<T, D>(pb, pb.v_cache, table, c0, len, kh, rows);
    head_rows(rows, kh * D, kChunk, head);
    accumulate_group<T, D>(s + c0, len, head, kChunk, o, nq);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t rh = it.members[i / g] * pb.heads + kh * g + i % g;
    std::copy(o + i * D, o + (i + 1) * D, out.o + rh * D);
  }
}

}  // namespace kvfleet::decode
