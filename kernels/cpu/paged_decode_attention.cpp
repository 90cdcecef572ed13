// Paged decode attention for CPU: one query token per request, K/V read in place from the
// block-paged cache through each request's block table (no gather copy of the context).
//
// Shapes: q, out [B, H, D] (any token/head strides, unit stride over D); k_cache, v_cache
// [num_blocks, block_size, KVH, D] contiguous; block_tables [B, max_blocks] int32;
// context_lens [B] int32 (this step's token included). D in {16, 32, 64, 128, 256}; float32 or
// bfloat16, arithmetic in float32.
//
// Work item = a request (or, with few requests, one KV head of a request so both threads
// work); items run longest first from an atomic counter. An item makes three passes:
//   1. scores, 16 positions at a time: rows are read in memory order, each giving every
//      query head a vector of partial products (D / 16 FMAs); per head, the 16 keys' vectors
//      are then summed lane-wise by one transpose-and-add network (reduce16) rather than 16
//      horizontal sums. scale * log2 e is folded into q. The chunk's V rows and the next
//      chunk's K rows are prefetched (each 16-position block is a separate 12 KB page run, where
//      the hardware prefetcher starts cold: 64 requests x 288 positions x 30 layers of SmolLM2,
//      float32 from DRAM, 59 -> 54 ms a step).
//   2. softmax per head over the stored scores (exp2, max subtracted).
//   3. O += P V, 16 positions at a time: each V row is loaded once per KV head and FMA'd into
//      the accumulators of that KV head's query heads (GQA); the next chunk's V rows are
//      prefetched again meanwhile.
// With `window` > 0 an item starts at its request's window (the last `window` positions) and
// with `softcap` > 0 every score is capped (cap * tanh(s / cap)) before the softmax; the
// shared-prefix variant takes neither.
// `paged_decode_attention_shared` first reduces prefixes that groups of requests share (the
// same block ids) once per group (shared_prefix_attention.h); each request's item then starts
// at its own positions and merges the prefix's softmax pieces (run_item's `start`, `pre`).
// Rows are read straight into registers (bfloat16: see Layout). Once the caches no longer fit
// in L3 (every decode step reads all layers' caches) the kernel is bound by DRAM bandwidth:
// float32 then runs at the speed of the simple token-by-token loop it replaced, bfloat16 ~25%
// faster; from cache it is 2x faster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "decode_attention_common.h"
#include "shared_prefix_attention.h"
#include "paged_rows.h"
#include "simd.h"

namespace {

using namespace kvfleet::decode;
using kvfleet::bcast;
using kvfleet::exp2v;
using kvfleet::kIota;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;
using kvfleet::v16u;
using kvfleet::vmax;

// `start` > 0: positions [0, start) are a shared prefix already reduced to `pre` (see
// shared_prefix_attention.h); this item attends [start, ctx) and merges the two.
template <typename T, int D>
void run_item(const Problem<T>& pb, const Item& it, int start, const Partials* pre) {
  using L = Layout<T, D>;
  const int64_t r = it.request, g = pb.group;
  const int ctx = pb.lens[r];
  const int own = ctx - start;
  if (ctx <= 0) {  // nothing to attend to (never produced by the engine): a zero row
    for (int64_t h = it.kv_begin * g; h < it.kv_end * g; ++h)
      for (int k = 0; k < D; ++k) pb.out[r * pb.o_tok + h * pb.o_head + k] = static_cast<T>(0.f);
    return;
  }
  const int64_t padded = (own + kChunk - 1) / kChunk * kChunk;
  const int64_t h0 = it.kv_begin * g, nh = (it.kv_end - it.kv_begin) * g;
  const int64_t row = pb.kv_heads * D;
  const int32_t* table = pb.tables + r * pb.table_width;
  // Scratch: q [nh][D], scores then probabilities [nh][padded], o [nh][D], 1 / sums [nh],
  // a chunk's partial score vectors [nh][16][16].
  const int64_t nh16 = (nh + 15) / 16 * 16;
  float* qs = thread_scratch(nh * (2 * D + padded) + nh16 + nh * kChunk * 16);
  float* s = qs + nh * D;
  float* o = s + nh * padded;
  float* inv = o + nh * D;
  float* part = inv + nh16;

  for (int64_t h = 0; h < nh; ++h) {
    const T* src = pb.q + r * pb.q_tok + (h0 + h) * pb.q_head;
    for (int k = 0; k < D; ++k) qs[h * D + k] = static_cast<float>(src[L::natural(k)]) * pb.scale;
  }

  // Positions [start, lead_end) precede the window in its first chunk: masked (start is the
  // window's first position rounded down to a chunk; without a window lead_end == start).
  const int lead_end = pb.window > 0 ? std::max(start, ctx - pb.window) : start;
  const T* rows[kChunk];
  const T* head[kChunk];
  for (int c0 = start; c0 < ctx; c0 += kChunk) {
    const int n = std::min(kChunk, ctx - c0);
    kvfleet::chunk_rows(pb.k_cache, table, pb.block_size, row, c0, n, rows);
    prefetch_rows(pb.v_cache, table, pb.block_size, row, c0, n, it.kv_begin * D, it.kv_end * D);
    if (c0 + kChunk < ctx)
      prefetch_rows(pb.k_cache, table, pb.block_size, row, c0 + kChunk,
                    std::min(kChunk, ctx - c0 - kChunk), it.kv_begin * D, it.kv_end * D);
    // Rows in memory order, each row's KV heads in turn (reading one KV head's 16 rows, then
    // the next's, streams ~25% slower from DRAM); the partial vectors wait in `part`.
    for (int j = 0; j < kChunk; ++j) {
      const T* rj = rows[j < n ? j : n - 1];
      for (int64_t kh = it.kv_begin; kh < it.kv_end; ++kh) {
        v16 kv[D / 16];
        L::template load<D / 16>(rj + kh * D, 0, kv);
        for (int64_t h = (kh - it.kv_begin) * g; h < (kh - it.kv_begin + 1) * g; ++h) {
          v16 acc = load16(qs + h * D) * kv[0];
#pragma GCC unroll 8
          for (int c = 1; c < D / 16; ++c) acc += load16(qs + h * D + c * 16) * kv[c];
          store16(part + (h * kChunk + j) * 16, acc);
        }
      }
    }
    for (int64_t h = 0; h < nh; ++h) {
      v16 pv[kChunk];
#pragma GCC unroll 16
      for (int j = 0; j < kChunk; ++j) pv[j] = load16(part + (h * kChunk + j) * 16);
      v16 sc = kvfleet::reduce16(pv);
      if (pb.softcap > 0.f) sc = kvfleet::softcap_log2(sc, pb.softcap);
      if (c0 < lead_end) sc = kIota < static_cast<float>(lead_end - c0) ? bcast(kNeg) : sc;
      if (n < kChunk) sc = kIota >= static_cast<float>(n) ? bcast(kNeg) : sc;
      store16(s + h * padded + (c0 - start), sc);
    }
  }

  const int lead = lead_end - start;
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * padded;
    v16 mx = bcast(kNeg);
    for (int64_t c = 0; c < padded; c += 16) mx = vmax(mx, load16(sh + c));
    const int64_t rh = r * pb.heads + h0 + h;
    const float own_max = kvfleet::hmax(mx);
    const float top = pre != nullptr ? std::max(own_max, pre->m[rh]) : own_max;
    const v16 m = bcast(top);
    v16 sum = v16{};
    for (int64_t c = 0; c < padded; c += 16) {
      v16 e = exp2v(load16(sh + c) - m);
      if (c + 16 > own) e = kIota >= static_cast<float>(own - c) ? v16{} : e;
      if (c < lead) e = kIota < static_cast<float>(lead - c) ? v16{} : e;
      sum += e;
      store16(sh + c, e);
    }
    float total = kvfleet::hsum(sum);
    if (pre != nullptr) {  // the prefix's pieces, rescaled from their maximum to `top`
      const v16 a = exp2v(bcast(pre->m[rh] - top));
      total += pre->l[rh] * a[0];
      for (int c = 0; c < D; c += 16) store16(o + h * D + c, load16(pre->o + rh * D + c) * a);
    } else {
      for (int c = 0; c < D; c += 16) store16(o + h * D + c, v16{});
    }
    inv[h] = 1.f / total;
  }

  for (int c0 = start; c0 < ctx; c0 += kChunk) {
    const int n = std::min(kChunk, ctx - c0);
    kvfleet::chunk_rows(pb.v_cache, table, pb.block_size, row, c0, n, rows);
    // The next chunk's V again, though pass 1 prefetched it: by now some of those lines have
    // left L2 or never arrived, and a miss here stalls the FMA chain (from DRAM, 64 requests x
    // ~290 positions: 1.26 -> 1.16 ms a layer contiguous, 1.80 -> 1.63 ms scattered blocks).
    if (c0 + kChunk < ctx)
      prefetch_rows(pb.v_cache, table, pb.block_size, row, c0 + kChunk,
                    std::min(kChunk, ctx - c0 - kChunk), it.kv_begin * D, it.kv_end * D);
    for (int64_t kh = it.kv_begin; kh < it.kv_end; ++kh) {
      head_rows(rows, kh * D, n, head);
      const int64_t h = (kh - it.kv_begin) * g;
      accumulate_group<T, D>(s + h * padded + (c0 - start), padded, head, n, o + h * D, g);
    }
  }

  for (int64_t h = 0; h < nh; ++h) {
    T* dst = pb.out + r * pb.o_tok + (h0 + h) * pb.o_head;
    for (int k = 0; k < D; ++k) dst[L::natural(k)] = static_cast<T>(o[h * D + k] * inv[h]);
  }
}

// One item per request when there are enough of them to keep every thread busy, else one per
// (request, KV head); the most positions to attend first.
std::vector<Item> make_items(int64_t b, const int32_t* lens, const std::vector<int32_t>& start,
                             int64_t kv_heads) {
  const bool split = b < 4 * at::get_num_threads() && kv_heads > 1;
  std::vector<Item> items;
  for (int32_t r = 0; r < b; ++r) {
    if (!split) {
      items.push_back({r, 0, static_cast<int32_t>(kv_heads)});
      continue;
    }
    for (int32_t h = 0; h < kv_heads; ++h) items.push_back({r, h, h + 1});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return lens[x.request] - start[x.request] > lens[y.request] - start[y.request];
  });
  return items;
}

// The first key chunk of an item this thread runs next, fetched while it runs the current
// one: inside an item each chunk fetches the next, but an item's first chunk had nothing ahead
// of it, and one decode call starts an item per request (a DRAM stall each, blocks scattered).
template <typename T, int D>
void prefetch_first_chunk(const Problem<T>& pb, const Item& it, int start) {
  const int ctx = pb.lens[it.request];
  if (ctx <= start) return;
  prefetch_rows(pb.k_cache, pb.tables + it.request * pb.table_width, pb.block_size,
                pb.kv_heads * D, start, std::min(kChunk, ctx - start), it.kv_begin * D,
                it.kv_end * D);
}

template <typename T, int D>
void dispatch_item(const Problem<T>& pb, const Item& it, int start, const Partials* pre) {
  // With a window, `start` is the window's first position and there is no prefix to merge.
  run_item<T, D>(pb, it, start, start > 0 && pb.window == 0 ? pre : nullptr);
}

// Item i, with item j (claimed next by this thread; j >= size: none) prefetched first.
template <typename T, int D>
void run_claimed(const Problem<T>& pb, const std::vector<Item>& items, int64_t i, int64_t j,
                 int start, int start_j, const Partials* pre) {
  if (j < static_cast<int64_t>(items.size())) prefetch_first_chunk<T, D>(pb, items[j], start_j);
  dispatch_item<T, D>(pb, items[i], start, pre);
}

// Requests grouped by a shared prefix: group_of[r] is r's group (-1: none), shared_lens[g] the
// group's shared positions. Prefix items: up to ~32 query heads of one KV head each.
struct Sharing {
  std::vector<int32_t> start, members;
  std::vector<PrefixItem> items;
  std::vector<float> m, l, o;
  Partials partials() { return {m.data(), l.data(), o.data()}; }
};

Sharing plan_sharing(int64_t b, int64_t heads, int64_t d, int64_t kv_heads, int64_t group,
                     const int32_t* group_of, const int32_t* shared_lens, int64_t num_groups) {
  Sharing sh;
  sh.start.assign(b, 0);
  if (group_of == nullptr) return sh;
  std::vector<std::vector<int32_t>> by(num_groups);
  for (int32_t r = 0; r < b; ++r)
    if (group_of[r] >= 0) {
      by[group_of[r]].push_back(r);
      sh.start[r] = shared_lens[group_of[r]];
    }
  sh.members.reserve(b);
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset in members, count) per group
  for (const auto& m : by) {
    spans.push_back({static_cast<int64_t>(sh.members.size()), static_cast<int64_t>(m.size())});
    sh.members.insert(sh.members.end(), m.begin(), m.end());
  }
  const int64_t per_item = std::max<int64_t>(1, 32 / group);
  for (int64_t g = 0; g < num_groups; ++g)
    for (int32_t kh = 0; kh < kv_heads; ++kh)
      for (int64_t k = 0; k < spans[g].second; k += per_item)
        sh.items.push_back({sh.members.data() + spans[g].first + k,
                            static_cast<int32_t>(std::min(per_item, spans[g].second - k)),
                            shared_lens[g], kh});
  std::stable_sort(sh.items.begin(), sh.items.end(), [](const PrefixItem& x, const PrefixItem& y) {
    return int64_t{x.n} * x.len > int64_t{y.n} * y.len;
  });
  sh.m.resize(b * heads);
  sh.l.resize(b * heads);
  sh.o.resize(b * heads * d);
  return sh;
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
         double scale, const int32_t* group_of, const int32_t* shared_lens, int64_t num_groups,
         int64_t window, double softcap) {
  const int64_t d = q.size(2);
  Problem<T> pb{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0),
                out.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1),
                k_cache.size(2), q.size(1), q.size(1) / k_cache.size(2),
                tables.data_ptr<int32_t>(), tables.size(1), lens.data_ptr<int32_t>(),
                static_cast<float>(scale) * kLog2e};
  pb.window = static_cast<int32_t>(window);
  pb.softcap = static_cast<float>(softcap);
  Sharing sh = plan_sharing(q.size(0), pb.heads, d, pb.kv_heads, pb.group, group_of,
                            shared_lens, num_groups);
  if (window > 0)  // chunks before the window are never read (chunks start at multiples of 16)
    for (int64_t r = 0; r < q.size(0); ++r)
      sh.start[r] = std::max<int32_t>(0, pb.lens[r] - pb.window) / kChunk * kChunk;
  const Partials pre = sh.partials();
  const int64_t np = static_cast<int64_t>(sh.items.size());
  if (np > 0) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), np), 1, [&](int64_t, int64_t) {
      for (int64_t i = next.fetch_add(1); i < np; i = next.fetch_add(1)) {
        switch (d) {
          case 16: prefix_partials<T, 16>(pb, sh.items[i], pre); break;
          case 32: prefix_partials<T, 32>(pb, sh.items[i], pre); break;
          case 64: prefix_partials<T, 64>(pb, sh.items[i], pre); break;
          case 128: prefix_partials<T, 128>(pb, sh.items[i], pre); break;
          default: prefix_partials<T, 256>(pb, sh.items[i], pre); break;
        }
      }
    });
  }
  const std::vector<Item> items = make_items(q.size(0), pb.lens, sh.start, pb.kv_heads);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    // Each thread claims its next item before running the current one, to prefetch it.
    for (int64_t i = next.fetch_add(1), j = 0; i < n; i = j) {
      j = next.fetch_add(1);
      const int start = sh.start[items[i].request];
      const int start_j = j < n ? sh.start[items[j].request] : 0;
      switch (d) {
        case 16: run_claimed<T, 16>(pb, items, i, j, start, start_j, &pre); break;
        case 32: run_claimed<T, 32>(pb, items, i, j, start, start_j, &pre); break;
        case 64: run_claimed<T, 64>(pb, items, i, j, start, start_j, &pre); break;
        case 128: run_claimed<T, 128>(pb, items, i, j, start, start_j, &pre); break;
        default: run_claimed<T, 256>(pb, items, i, j, start, start_j, &pre); break;
      }
    }
  });
}

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [B, H, D] with unit stride over D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256,
              "head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(k_cache.size(3) == d, "cache head_dim differs from q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16");
}

void launch(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale, const int32_t* group_of,
            const int32_t* shared_lens, int64_t num_groups, int64_t window = 0,
            double softcap = 0.0) {
  if (q.size(0) == 0) return;
  if (q.scalar_type() == at::kFloat) {
    run<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale, group_of,
               shared_lens, num_groups, window, softcap);
  } else {
    run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale, group_of,
                       shared_lens, num_groups, window, softcap);
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window,
                            double softcap) {
  check_inputs(out, q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");
  launch(out, q, k_cache, v_cache, block_tables, context_lens, scale, nullptr, nullptr, 0,
         window, softcap);
}

// The same attention, with requests that share the first shared_lens[g] positions of their
// block tables (the same block ids) grouped: group_of [B] int32, -1 for none. A group's shared
// positions must be whole 16-position chunks and fewer than each member's context.
void paged_decode_attention_shared(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, double scale,
                                   const at::Tensor& group_of, const at::Tensor& shared_lens) {
  check_inputs(out, q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(group_of.scalar_type() == at::kInt && shared_lens.scalar_type() == at::kInt &&
                  group_of.is_contiguous() && shared_lens.is_contiguous() &&
                  group_of.numel() == q.size(0),
              "group_of must be [B] int32 and shared_lens int32, both contiguous");
  TORCH_CHECK(k_cache.size(1) % kChunk == 0, "shared prefixes need a block size multiple of 16");
  const int32_t* g = group_of.data_ptr<int32_t>();
  const int32_t* len = shared_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int64_t num_groups = shared_lens.numel();
  for (int64_t i = 0; i < num_groups; ++i)
    TORCH_CHECK(len[i] > 0 && len[i] % kChunk == 0, "shared_lens must be positive multiples of 16");
  for (int64_t r = 0; r < q.size(0); ++r)
    TORCH_CHECK(g[r] >= -1 && g[r] < num_groups && (g[r] < 0 || len[g[r]] < ctx[r]),
                "group_of out of range, or a shared prefix not shorter than its context");
  launch(out, q, k_cache, v_cache, block_tables, context_lens, scale, g, len, num_groups);
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor context_lens, float scale, int window=0, "
      "float softcap=0.0) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def(
      "paged_decode_attention_shared(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor context_lens, float scale, Tensor group_of, "
      "Tensor shared_lens) -> ()");
  m.impl("paged_decode_attention_shared", c10::DispatchKey::CPU, &paged_decode_attention_shared);
}
