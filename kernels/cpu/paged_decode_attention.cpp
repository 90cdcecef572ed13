// Paged decode attention for CPU: one query token per request, K/V read in place from the
// block-paged cache through each request's block table (no gather copy of the context).
//
// Shapes: q, out [B, H, D] (any token/head strides, unit stride over D); k_cache, v_cache
// [num_blocks, block_size, KVH, D] contiguous; block_tables [B, max_blocks] int32;
// context_lens [B] int32 (this step's token included). D in {16, 32, 64, 128}; float32 or
// bfloat16, arithmetic in float32.
//
// Work item = a request (or, with few requests, one KV head of a request so both threads
// work); items run longest first from an atomic counter. An item makes three passes:
//   1. scores, 16 positions at a time: rows are read in memory order, each giving every
//      query head a vector of partial products (D / 16 FMAs); per head, the 16 keys' vectors
//      are then summed lane-wise by one transpose-and-add network (reduce16) rather than 16
//      horizontal sums. scale * log2 e is folded into q. The chunk's V rows are prefetched.
//   2. softmax per head over the stored scores (exp2, max subtracted).
//   3. O += P V, 16 positions at a time: each V row is loaded once per KV head and FMA'd into
//      the accumulators of that KV head's query heads (GQA); the next chunk's V rows are
//      prefetched again meanwhile.
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

#include "paged_rows.h"
#include "simd.h"

namespace {

using kvfleet::bcast;
using kvfleet::exp2v;
using kvfleet::kIota;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;
using kvfleet::v16u;
using kvfleet::vmax;

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
};

struct Item {
  int32_t request, kv_begin, kv_end;
};

float* thread_scratch(size_t floats) {
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

template <typename T, int D>
void run_item(const Problem<T>& pb, const Item& it) {
  using L = Layout<T, D>;
  const int64_t r = it.request, g = pb.group;
  const int ctx = pb.lens[r];
  if (ctx <= 0) {  // nothing to attend to (never produced by the engine): a zero row
    for (int64_t h = it.kv_begin * g; h < it.kv_end * g; ++h)
      for (int k = 0; k < D; ++k) pb.out[r * pb.o_tok + h * pb.o_head + k] = static_cast<T>(0.f);
    return;
  }
  const int64_t padded = (ctx + kChunk - 1) / kChunk * kChunk;
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
    for (int c = 0; c < D; c += 16) store16(o + h * D + c, v16{});
  }

  const T* rows[kChunk];
  const T* head[kChunk];
  for (int c0 = 0; c0 < ctx; c0 += kChunk) {
    const int n = std::min(kChunk, ctx - c0);
    kvfleet::chunk_rows(pb.k_cache, table, pb.block_size, row, c0, n, rows);
    prefetch_rows(pb.v_cache, table, pb.block_size, row, c0, n, it.kv_begin * D, it.kv_end * D);
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
      if (n < kChunk) sc = kIota >= static_cast<float>(n) ? bcast(kNeg) : sc;
      store16(s + h * padded + c0, sc);
    }
  }

  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * padded;
    v16 mx = bcast(kNeg);
    for (int64_t c = 0; c < padded; c += 16) mx = vmax(mx, load16(sh + c));
    const v16 m = bcast(kvfleet::hmax(mx));
    v16 sum = v16{};
    for (int64_t c = 0; c < padded; c += 16) {
      v16 e = exp2v(load16(sh + c) - m);
      if (c + 16 > ctx) e = kIota >= static_cast<float>(ctx - c) ? v16{} : e;
      sum += e;
      store16(sh + c, e);
    }
    inv[h] = 1.f / kvfleet::hsum(sum);
  }

  for (int c0 = 0; c0 < ctx; c0 += kChunk) {
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
      accumulate_group<T, D>(s + h * padded + c0, padded, head, n, o + h * D, g);
    }
  }

  for (int64_t h = 0; h < nh; ++h) {
    T* dst = pb.out + r * pb.o_tok + (h0 + h) * pb.o_head;
    for (int k = 0; k < D; ++k) dst[L::natural(k)] = static_cast<T>(o[h * D + k] * inv[h]);
  }
}

// One item per request when there are enough of them to keep every thread busy, else one per
// (request, KV head); longest contexts first.
std::vector<Item> make_items(int64_t b, const int32_t* lens, int64_t kv_heads) {
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
    return lens[x.request] > lens[y.request];
  });
  return items;
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
         double scale) {
  const int64_t d = q.size(2);
  Problem<T> pb{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0),
                out.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.size(1),
                k_cache.size(2), q.size(1), q.size(1) / k_cache.size(2),
                tables.data_ptr<int32_t>(), tables.size(1), lens.data_ptr<int32_t>(),
                static_cast<float>(scale) * kLog2e};
  const std::vector<Item> items = make_items(q.size(0), pb.lens, pb.kv_heads);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      switch (d) {
        case 16: run_item<T, 16>(pb, items[i]); break;
        case 32: run_item<T, 32>(pb, items[i]); break;
        case 64: run_item<T, 64>(pb, items[i]); break;
        default: run_item<T, 128>(pb, items[i]); break;
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [B, H, D] with unit stride over D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128, "head_dim must be 16, 32, 64 or 128");
  TORCH_CHECK(k_cache.size(3) == d, "cache head_dim differs from q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables and context_lens must be contiguous int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache dtypes differ");
  if (q.size(0) == 0) return;
  if (q.scalar_type() == at::kFloat) {
    run<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
