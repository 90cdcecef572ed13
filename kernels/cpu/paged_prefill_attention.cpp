// Paged prefill attention for CPU: every prefill segment of a step in one call. Segment s owns
// query rows [query_starts[s], query_starts[s] + query_lens[s]) of the flat batch; its context
// is context_lens[s] tokens (earlier tokens already cached, then this chunk, whose K/V the
// caller has written to the cache), read in place through block_tables[s]. Query i of the
// segment sits at position context_len - query_len + i and attends causally to keys 0..pos.
//
// With window > 0 the query at position p sees only keys > p - window (transformers' sliding
// window; key chunks before a tile's first window are skipped), and with softcap > 0 every
// score is capped to softcap * tanh(s / softcap) before the softmax (Gemma 2).
//
// Shapes: q, out [T, H, D] (any token/head strides, unit stride over D); k_cache, v_cache
// [num_blocks, block_size, KVH, D] contiguous; block_tables [S, max_blocks], query_starts,
// query_lens, context_lens [S], all int32. D in {16, 32, 64, 128, 256}; float32 or bfloat16,
// arithmetic in float32.
//
// Work item = (segment, tile of query tokens, KV head, run of that KV head's query heads).
// Its rows are (token, head) pairs, at most 64, laid out token-major in the lanes of up to
// four 16-float vectors, so that:
//   * S = Q K^T: Q is transposed into [D][rows] once per tile (scale * log2 e folded in); for
//     each key, K[key][d] is broadcast and FMA'd into the rows' vectors. No horizontal sums,
//     K read in place (bfloat16 K is first widened into a scratch chunk).
//   * the online softmax (chunks of 16 keys, exp2) runs across rows in lanes: running max,
//     sum and rescale factor are vectors, no horizontal reductions either.
//   * O += P V: V[key] rows are loaded as vectors over D, P[key][row] broadcast; O is
//     [rows][D] float scratch rescaled by the chunk's alpha as it is loaded.
// Items are sorted by cost (rows x keys) and handed out from an atomic counter, so two
// threads stay balanced even when one long segment dominates the step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "paged_rows.h"
#include "simd.h"

namespace {

using kvfleet::bcast;
using kvfleet::exp2v;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;
using kvfleet::vmax;

constexpr int kChunk = 16;    // keys per softmax step
constexpr int kMaxRows = 64;  // (token, head) rows per item: four vectors
constexpr float kNeg = -1e30f;
constexpr float kLog2e = 1.4426950408889634f;
alignas(64) const float kZeros[256] = {};  // >= the largest D

template <typename T>
struct Problem {
  const T* q;
  int64_t q_tok, q_head;
  T* out;
  int64_t o_tok, o_head;
  const T* k_cache;
  const T* v_cache;
  int64_t block_size, kv_heads, group;
  const int32_t* tables;
  int64_t table_width;
  const int32_t *starts, *lens, *ctx;
  float scale;  // softmax scale * log2(e)
  int32_t window = 0;  // a query at position p sees keys > p - window (0: all keys)
  float softcap = 0.f;  // scores capped to cap * tanh(s / cap) (0: no cap)
};

struct Item {
  int32_t seg, tok_begin, tok_end, kv_head, head_begin, heads;
  int64_t cost;
};

// Per-thread scratch, 64-byte aligned, grown on demand and kept across calls.
struct Scratch {
  float *qt, *s, *o, *kf, *vf, *alpha;
};

Scratch thread_scratch(int64_t d) {
  thread_local std::vector<float> buf;
  const size_t need = d * kMaxRows * 2 + kChunk * kMaxRows + 2 * kChunk * d + kMaxRows + 16;
  if (buf.size() < need) buf.resize(need);
  float* p = buf.data();
  p += (16 - (reinterpret_cast<uintptr_t>(p) / sizeof(float)) % 16) % 16;
  Scratch s;
  s.qt = p;
  s.o = s.qt + d * kMaxRows;
  s.s = s.o + d * kMaxRows;
  s.kf = s.s + kChunk * kMaxRows;
  s.vf = s.kf + kChunk * d;
  s.alpha = s.vf + kChunk * d;
  return s;
}

// S[j][rows] = sum_d Qt[d][rows] * K[j][d] for KJ keys, all NR row vectors in registers.
template <int D, int NR, int KJ>
inline void scores(const float* __restrict qt, const float* const* kp, float* __restrict s) {
  v16 acc[KJ][NR];
#pragma GCC unroll 16
  for (int j = 0; j < KJ; ++j)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[j][n] = v16{};
  const float* krow[KJ];
#pragma GCC unroll 16
  for (int j = 0; j < KJ; ++j) krow[j] = kp[j];
#pragma GCC unroll 2
  for (int d = 0; d < D; ++d) {
    v16 qv[NR];
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) qv[n] = load16(qt + d * NR * 16 + n * 16);
#pragma GCC unroll 16
    for (int j = 0; j < KJ; ++j) {
      const v16 b = bcast(krow[j][d]);
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[j][n] += b * qv[n];
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < KJ; ++j)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) store16(s + j * NR * 16 + n * 16, acc[j][n]);
}

// O[r][:] = O[r][:] * alpha[r] + sum_j P[j][r] * V[j][:] for rows [r0, r0 + R): R rows by CV
// vectors of D per register block (16 accumulators).
template <int D>
struct PvShape {
  static constexpr int CV = D >= 64 ? 4 : D / 16;
  static constexpr int R = 16 / CV;
};

template <int D>
inline void accumulate_pv(const float* __restrict p, int rows_stride, const float* const* vp,
                          int nkeys, const float* __restrict alpha, float* __restrict o, int r0,
                          bool first) {
  constexpr int CV = PvShape<D>::CV, R = PvShape<D>::R;
  for (int dh = 0; dh < D; dh += CV * 16) {
    v16 acc[R][CV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const v16 a = bcast(alpha[r0 + r]);
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c)
        acc[r][c] = first ? v16{} : load16(o + (r0 + r) * D + dh + c * 16) * a;
    }
    for (int j = 0; j < nkeys; ++j) {
      v16 v[CV];
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) v[c] = load16(vp[j] + dh + c * 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const v16 b = bcast(p[j * rows_stride + r0 + r]);
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) acc[r][c] += b * v[c];
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) store16(o + (r0 + r) * D + dh + c * 16, acc[r][c]);
  }
}

// Points kp/vp at the chunk's K/V rows (in place for float32, widened into scratch for
// bfloat16); keys in [nkeys, 16) point at zeros (their scores are computed, never used).
template <typename T, int D>
inline void chunk_rows(const Problem<T>& pb, const int32_t* table, int64_t kv_head, int c0,
                       int nkeys, Scratch& sc, const float** kp, const float** vp) {
  const int64_t row = pb.kv_heads * D;
  const T* krows[kChunk];
  const T* vrows[kChunk];
  kvfleet::chunk_rows(pb.k_cache, table, pb.block_size, row, c0, nkeys, krows);
  kvfleet::chunk_rows(pb.v_cache, table, pb.block_size, row, c0, nkeys, vrows);
  for (int j = 0; j < kChunk; ++j) {
    if (j >= nkeys) {
      kp[j] = vp[j] = kZeros;
      continue;
    }
    const T* k = krows[j] + kv_head * D;
    const T* v = vrows[j] + kv_head * D;
    if constexpr (std::is_same_v<T, float>) {
      kp[j] = k;
      vp[j] = v;
    } else {
      float* kd = sc.kf + j * D;
      float* vd = sc.vf + j * D;
#pragma GCC unroll 8
      for (int c = 0; c < D; c += 16) {
        store16(kd + c, load16(k + c));
        store16(vd + c, load16(v + c));
      }
      kp[j] = kd;
      vp[j] = vd;
    }
  }
}

template <typename T, int D, int NR>
void run_item(const Problem<T>& pb, const Item& it, Scratch& sc) {
  constexpr int W = NR * 16;  // lanes = padded rows
  constexpr int KJ = NR == 1 ? 16 : NR == 4 ? 4 : 8;
  const int seg = it.seg, ng = it.heads;
  const int ntok = it.tok_end - it.tok_begin, rows = ntok * ng;
  const int qlen = pb.lens[seg], ctx = pb.ctx[seg];
  const int first_pos = ctx - qlen + it.tok_begin, last_pos = ctx - qlen + it.tok_end - 1;
  const int32_t* table = pb.tables + seg * pb.table_width;
  const int64_t head0 = it.kv_head * pb.group + it.head_begin;

  // Q^T [D][W], scaled; padded lanes are zero. Row r = (token r / ng, head r % ng).
  alignas(64) float pos[W];
  const T* qrows[W];
  for (int r = 0; r < W; ++r) {
    const int rr = r < rows ? r : rows - 1;
    pos[r] = static_cast<float>(first_pos + rr / ng);
    qrows[r] = pb.q + (pb.starts[seg] + it.tok_begin + rr / ng) * pb.q_tok +
               (head0 + rr % ng) * pb.q_head;
  }
  const v16 scale = bcast(pb.scale);
  for (int n = 0; n < NR; ++n)
    for (int c = 0; c < D; c += 16) {
      v16 blk[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        blk[i] = n * 16 + i < rows ? load16(qrows[n * 16 + i] + c) * scale : v16{};
      kvfleet::transpose16(blk);
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) store16(sc.qt + (c + k) * W + n * 16, blk[k]);
    }
  v16 rowpos[NR], m[NR], l[NR];
  for (int n = 0; n < NR; ++n) {
    rowpos[n] = load16(pos + n * 16);
    m[n] = bcast(kNeg);
    l[n] = v16{};
  }

  const float* kp[kChunk];
  const float* vp[kChunk];
  // With a window, chunks wholly before the first row's window are never read.
  const int c_begin =
      pb.window > 0 ? std::max(0, first_pos - pb.window + 1) / kChunk * kChunk : 0;
  for (int c0 = c_begin; c0 <= last_pos; c0 += kChunk) {
    const int nkeys = std::min(kChunk, last_pos + 1 - c0);
    chunk_rows<T, D>(pb, table, it.kv_head, c0, nkeys, sc, kp, vp);
    for (int j0 = 0; j0 < nkeys; j0 += KJ) scores<D, NR, KJ>(sc.qt, kp + j0, sc.s + j0 * W);
    if (pb.softcap > 0.f)
      for (int j = 0; j < nkeys; ++j)
        for (int n = 0; n < NR; ++n) {
          float* x = sc.s + j * W + n * 16;
          store16(x, kvfleet::softcap_log2(load16(x), pb.softcap));
        }

    // Online softmax across rows in lanes. Keys after a row's position are masked only in
    // chunks reaching past the tile's first position (the causal diagonal), keys at or
    // before position - window only in chunks starting at or before the last row's edge.
    const bool diagonal = c0 + kChunk - 1 > first_pos;
    const bool edge = pb.window > 0 && c0 <= last_pos - pb.window;
    const v16 win = bcast(static_cast<float>(pb.window));
    for (int n = 0; n < NR; ++n) {
      float* s = sc.s + n * 16;
      v16 mx = m[n];
      for (int j = 0; j < nkeys; ++j) {
        v16 x = load16(s + j * W);
        const v16 key = bcast(static_cast<float>(c0 + j));
        if (diagonal) x = key > rowpos[n] ? bcast(kNeg) : x;
        if (edge) x = key <= rowpos[n] - win ? bcast(kNeg) : x;
        mx = vmax(mx, x);
      }
      const v16 alpha = exp2v(m[n] - mx);
      v16 sum = l[n] * alpha;
      for (int j = 0; j < nkeys; ++j) {
        v16 e = exp2v(load16(s + j * W) - mx);
        const v16 key = bcast(static_cast<float>(c0 + j));
        if (diagonal) e = key > rowpos[n] ? v16{} : e;
        if (edge) e = key <= rowpos[n] - win ? v16{} : e;
        sum += e;
        store16(s + j * W, e);
      }
      store16(sc.alpha + n * 16, alpha);
      l[n] = sum;
      m[n] = mx;
    }
    for (int r0 = 0; r0 < rows; r0 += PvShape<D>::R)
      accumulate_pv<D>(sc.s, W, vp, nkeys, sc.alpha, sc.o, r0, c0 == c_begin);
  }

  alignas(64) float inv[W];
  for (int n = 0; n < NR; ++n) store16(inv + n * 16, 1.f / l[n]);
  for (int r = 0; r < rows; ++r) {
    T* orow = pb.out + (pb.starts[seg] + it.tok_begin + r / ng) * pb.o_tok +
              (head0 + r % ng) * pb.o_head;
    const float* src = sc.o + r * D;
    const v16 f = bcast(inv[r]);
    if constexpr (std::is_same_v<T, float>) {
      for (int c = 0; c < D; c += 16) store16(orow + c, load16(src + c) * f);
    } else {
      alignas(64) float tmp[D];
      for (int c = 0; c < D; c += 16) store16(tmp + c, load16(src + c) * f);
      for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(tmp[d]);
    }
  }
}

template <typename T, int D>
void dispatch_item(const Problem<T>& pb, const Item& it, Scratch& sc) {
  const int rows = (it.tok_end - it.tok_begin) * it.heads;
  switch ((rows + 15) / 16) {
    case 1: return run_item<T, D, 1>(pb, it, sc);
    case 2: return run_item<T, D, 2>(pb, it, sc);
    case 3: return run_item<T, D, 3>(pb, it, sc);
    default: return run_item<T, D, 4>(pb, it, sc);
  }
}

// Tiles: up to 16 of the KV head's query heads per item and at most 64 rows. When the group
// allows it a tile is a multiple of 16 tokens whose positions start at a multiple of 16 too, so
// its diagonal chunks hold exactly its own positions (no keys computed only to be masked
// beyond the triangle).
std::vector<Item> make_items(int64_t num_segs, const int32_t* lens, const int32_t* ctx,
                             int64_t kv_heads, int64_t group) {
  const int heads = static_cast<int>(std::min<int64_t>(group, 16));
  const int tile = heads <= 4 ? kChunk * (4 / heads) : std::max(1, kMaxRows / heads);
  std::vector<Item> items;
  for (int32_t s = 0; s < num_segs; ++s) {
    const int32_t pos0 = ctx[s] - lens[s];
    // A short segment (a verify step's 1 + k rows, a small chunk) is cut into tiles of at
    // most 16 rows with an even share of its tokens, ignoring the aligned boundaries: each
    // tile reads the whole context, so the fewest one-vector tiles give the two threads the
    // most balanced items for the least work.
    const int32_t short_tokens =
        lens[s] * heads <= kMaxRows && lens[s] <= kChunk
            ? (lens[s] + (lens[s] * heads + 15) / 16 - 1) / ((lens[s] * heads + 15) / 16)
            : 0;
    for (int32_t t0 = 0; t0 < lens[s];) {
      const int32_t t1 = short_tokens
                             ? std::min(lens[s], t0 + short_tokens)
                             : std::min(lens[s], (pos0 + t0) / tile * tile + tile - pos0);
      const int64_t keys = ctx[s] - lens[s] + t1;
      for (int32_t h = 0; h < kv_heads; ++h)
        for (int32_t g = 0; g < group; g += heads) {
          const int32_t ng = static_cast<int32_t>(std::min<int64_t>(heads, group - g));
          items.push_back({s, t0, t1, h, g, ng, keys * (t1 - t0) * ng});
        }
      t0 = t1;
    }
  }
  // Largest first (balance), but all tiles of one (segment, KV head) stay together, largest
  // tile first: consecutive items then read the same K/V, which stays in cache.
  std::vector<int64_t> total(num_segs * kv_heads, 0);
  for (const Item& it : items) total[it.seg * kv_heads + it.kv_head] += it.cost;
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t ga = a.seg * kv_heads + a.kv_head, gb = b.seg * kv_heads + b.kv_head;
    if (ga != gb) return total[ga] != total[gb] ? total[ga] > total[gb] : ga < gb;
    return a.cost > b.cost;
  });
  return items;
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& starts,
         const at::Tensor& lens, const at::Tensor& ctx, double scale, int64_t window,
         double softcap) {
  const int64_t d = q.size(2);
  Problem<T> pb{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0),
                out.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1),
                k_cache.size(2), q.size(1) / k_cache.size(2), tables.data_ptr<int32_t>(),
                tables.size(1), starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                ctx.data_ptr<int32_t>(), static_cast<float>(scale) * kLog2e,
                static_cast<int32_t>(window), static_cast<float>(softcap)};
  const std::vector<Item> items =
      make_items(starts.size(0), pb.lens, pb.ctx, pb.kv_heads, pb.group);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    Scratch sc = thread_scratch(d);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      switch (d) {
        case 16: dispatch_item<T, 16>(pb, items[i], sc); break;
        case 32: dispatch_item<T, 32>(pb, items[i], sc); break;
        case 64: dispatch_item<T, 64>(pb, items[i], sc); break;
        case 128: dispatch_item<T, 128>(pb, items[i], sc); break;
        default: dispatch_item<T, 256>(pb, items[i], sc); break;
      }
    }
  });
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& query_lens,
                             const at::Tensor& context_lens, double scale, int64_t window,
                             double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [T, H, D] with unit stride over D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256,
              "head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "cache head_dim differs from q");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &query_starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block tables and segment vectors must be contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache dtypes differ");
  if (query_starts.numel() == 0) return;
  if (q.scalar_type() == at::kFloat) {
    run<float>(out, q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
               scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, query_starts, query_lens,
                       context_lens, scale, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention supports float32 and bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor query_starts, Tensor query_lens, Tensor context_lens, "
      "float scale, int window=0, float softcap=0.0) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
