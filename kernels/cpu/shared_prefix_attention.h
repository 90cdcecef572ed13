// Decode attention over a prefix that several requests of the batch share (the same cached
// blocks at the start of their block tables: a common system prompt, a few-shot preamble).
//
// The plain decode kernel reads a shared block once per request; every K row then meets only
// the `group` query heads of its KV head (3 for SmolLM2), so it is bound by loads. Here one
// work item takes up to ~32 query heads of one KV head (the group's heads of up to ~10
// requests) against the shared positions, so each K and V row loaded serves all of them:
//   1. a chunk of 16 K rows is transposed into [D][16] (four 16x16 in-register transposes),
//      then each query's 16 scores are D broadcast-FMAs (no horizontal reduction);
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

template <typename T, int D>
void prefix_partials(const Problem<T>& pb, const PrefixItem& it, const Partials& out) {
  using L = Layout<T, D>;
  const int64_t g = pb.group, nq = it.n * g, nq4 = (nq + 3) / 4 * 4;
  const int64_t len = it.len, kh = it.kv_head;
  const int32_t* table = pb.tables + static_cast<int64_t>(it.members[0]) * pb.table_width;
  // Scratch: q [nq4][D] (padding rows zero), scores then probabilities [nq][len],
  // o [nq][D], one transposed K chunk [D][16].
  float* qs = thread_scratch(nq4 * D + nq * (len + D) + D * kChunk);
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
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    chunk_and_next<T, D>(pb, pb.k_cache, table, c0, len, kh, rows);
    v16 blk[D / 16][kChunk];
    for (int j = 0; j < kChunk; ++j) {
      v16 r[D / 16];
      L::template load<D / 16>(rows[j] + kh * D, 0, r);
      for (int c = 0; c < D / 16; ++c) blk[c][j] = r[c];
    }
    for (int c = 0; c < D / 16; ++c) {
      kvfleet::transpose16(blk[c]);
      for (int t = 0; t < kChunk; ++t) store16(kt + (c * 16 + t) * kChunk, blk[c][t]);
    }
    for (int64_t i0 = 0; i0 < nq; i0 += 4) {
      v16 acc[4] = {};
      for (int d = 0; d < D; ++d) {
        const v16 k = load16(kt + d * kChunk);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[q] += bcast(qs[(i0 + q) * D + d]) * k;
      }
      for (int q = 0; q < 4 && i0 + q < nq; ++q) store16(s + (i0 + q) * len + c0, acc[q]);
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
