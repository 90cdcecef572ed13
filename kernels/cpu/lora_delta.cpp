// Batched LoRA delta for CPU, float32: out[row] += (x[row] @ A[slot]^T) @ B[slot]^T for every
// adapter row of a step, all segments (one per adapter) in one call.
//
// Why: the PyTorch path makes two small matmuls (plus a gather and an index_add where a
// segment's rows are not contiguous) per adapter, projection and layer; with 8 adapters that
// is ~2,000 calls a step, each costing more in dispatch and thread start-up than its math.
// In decode the delta is memory-bound, so the stacks come in the layout that streams them
// (engine/lora/cpu_layout.py): at [L, K, W] (A transposed, W = S*R padded to 16 with zero
// columns) and bp [L, ceil(N/16), R, 16] (each output column's own rank block, 16 columns a
// tile). slice_offsets [S+1] gives each slice's output columns; slice s reads ranks
// [s*R, s*R + R) of h.
//
// Work units (taken from an atomic counter): up to kGroup rows of one segment. A unit first
// shrinks its rows, h[g][:] = x[row] @ A^T (4 rows x up to 48 ranks in registers, one pass
// over at), then expands them over every output column (4 rows x 16 columns per register
// block, one pass over bp). One unit reads its adapter's A and B once, so decode rows of one
// adapter (one unit) read them once a step. Each delta is summed in float32 on its own and
// then added to out once, as addmm does; the sums' order differs from MKL's only in rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "simd.h"

namespace {

using kvfleet::bcast;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;

constexpr int64_t kGroup = 8;  // rows per work unit (a multiple of kRb)
constexpr int kRb = 4;         // rows per register block

struct Problem {
  float* out;
  int64_t ldo;
  const float* x;
  int64_t ldx;
  const float* at;
  const float* bp;
  const int64_t* rows;
  const int32_t* starts;
  const int32_t* slots;
  const int64_t* slice_offsets;
  int64_t rank, width, k, n, blocks;  // width: at's padded rank width
};

// h[r][w0 : w0 + 16*NV] for the 4 rows of xr; hr rows past the unit's last are scratch.
template <int NV>
void shrink_block(const Problem& p, const float* at, const float* const* xr, float* const* hr,
                  int64_t w0) {
  v16 acc[kRb][NV];
#pragma GCC unroll 4
  for (int r = 0; r < kRb; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[r][v] = v16{};
  const float* a = at + w0;
  for (int64_t c = 0; c < p.k; ++c, a += p.width) {
    v16 av[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) av[v] = load16(a + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < kRb; ++r) {
      const v16 xb = bcast(xr[r][c]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[r][v] += xb * av[v];
    }
  }
  for (int r = 0; r < kRb; ++r)
    for (int v = 0; v < NV; ++v) store16(hr[r] + w0 + 16 * v, acc[r][v]);
}

void shrink(const Problem& p, const float* at, int64_t i0, int64_t m, float* h) {
  for (int64_t g0 = 0; g0 < m; g0 += kRb) {
    const float* xr[kRb];
    float* hr[kRb];
    for (int r = 0; r < kRb; ++r) {  // rows past m repeat row g0; their h rows are scratch
      xr[r] = p.x + p.rows[i0 + (g0 + r < m ? g0 + r : g0)] * p.ldx;
      hr[r] = h + (g0 + r) * p.width;
    }
    int64_t w0 = 0;
    for (; w0 + 48 <= p.width; w0 += 48) shrink_block<3>(p, at, xr, hr, w0);
    if (p.width - w0 == 32) shrink_block<2>(p, at, xr, hr, w0);
    if (p.width - w0 == 16) shrink_block<1>(p, at, xr, hr, w0);
  }
}

// Columns [c0, c1) of one slice (ranks from r0), tile b: every row of the unit.
void expand_tile(const Problem& p, const float* b, int64_t c0, int64_t c1, int64_t r0,
                 int64_t i0, int64_t m, const float* h) {
  for (int64_t g0 = 0; g0 < m; g0 += kRb) {
    const int nr = static_cast<int>(std::min<int64_t>(kRb, m - g0));
    const float* hr[kRb];
    for (int r = 0; r < kRb; ++r) hr[r] = h + (g0 + std::min(r, nr - 1)) * p.width + r0;
    v16 acc[kRb] = {};
    for (int64_t j = 0; j < p.rank; ++j) {
      const v16 bv = load16(b + j * 16);
#pragma GCC unroll 4
      for (int r = 0; r < kRb; ++r) acc[r] += bcast(hr[r][j]) * bv;
    }
    for (int r = 0; r < nr; ++r) {
      float* o = p.out + p.rows[i0 + g0 + r] * p.ldo + c0;
      if (c1 - c0 == 16) {
        store16(o, load16(o) + acc[r]);
      } else {
        alignas(64) float t[16];
        store16(t, acc[r]);
        for (int64_t c = 0; c < c1 - c0; ++c) o[c] += t[c];
      }
    }
  }
}

// A tile whose 16 columns span two slices: each column with its own slice's ranks.
void expand_mixed(const Problem& p, const float* b, int64_t c0, int64_t c1, int64_t slice,
                  int64_t i0, int64_t m, const float* h) {
  for (int64_t g = 0; g < m; ++g) {
    float* o = p.out + p.rows[i0 + g] * p.ldo;
    int64_t s = slice;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= p.slice_offsets[s + 1]) ++s;
      const float* hr = h + g * p.width + s * p.rank;
      float acc = 0.f;
      for (int64_t j = 0; j < p.rank; ++j) acc += hr[j] * b[j * 16 + (c - c0)];
      o[c] += acc;
    }
  }
}

void unit(const Problem& p, int64_t seg, int64_t i0, float* h) {
  const int64_t m = std::min<int64_t>(p.starts[seg + 1], i0 + kGroup) - i0;
  const int64_t slot = p.slots[seg];
  shrink(p, p.at + slot * p.k * p.width, i0, m, h);
  const float* bp = p.bp + slot * p.blocks * p.rank * 16;
  int64_t slice = 0;
  for (int64_t t = 0; t < p.blocks; ++t) {
    const int64_t c0 = t * 16, c1 = std::min<int64_t>(p.n, c0 + 16);
    while (c0 >= p.slice_offsets[slice + 1]) ++slice;
    const float* b = bp + t * p.rank * 16;
    if (c1 <= p.slice_offsets[slice + 1])
      expand_tile(p, b, c0, c1, slice * p.rank, i0, m, h);
    else
      expand_mixed(p, b, c0, c1, slice, i0, m, h);
  }
}

template <typename F>
void run_units(int64_t units, F&& body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) body(u);
  });
}

void lora_delta(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& rows, const at::Tensor& seg_starts,
                const at::Tensor& seg_slots, const at::Tensor& slice_offsets, int64_t rank) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "lora_delta: float32 only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 4,
              "lora_delta: bad ranks (a packed [L, K, W], b packed [L, N/16, R, 16])");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_delta: rows must be unit-stride and the stacks contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slice_offsets.scalar_type() == at::kLong &&
                  seg_starts.scalar_type() == at::kInt && seg_slots.scalar_type() == at::kInt,
              "lora_delta: rows and slice offsets int64, segment vectors int32");
  const int64_t width = a.size(2), k = a.size(1), n = out.size(1), slices = slice_offsets.numel() - 1;
  TORCH_CHECK(x.size(1) == k && b.size(1) == (n + 15) / 16 && b.size(2) == rank &&
                  b.size(3) == 16 && b.size(0) == a.size(0),
              "lora_delta: shapes of x, out, a and b disagree");
  TORCH_CHECK(rank >= 1 && slices >= 1 && width % 16 == 0 && slices * rank <= width &&
                  width < slices * rank + 16,
              "lora_delta: a's width is not slices x rank padded to 16");
  const int64_t m = rows.numel(), segs = seg_slots.numel();
  if (m == 0 || segs == 0) return;
  Problem p{out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
            a.data_ptr<float>(), b.data_ptr<float>(), rows.data_ptr<int64_t>(),
            seg_starts.data_ptr<int32_t>(), seg_slots.data_ptr<int32_t>(),
            slice_offsets.data_ptr<int64_t>(), rank, width, k, n, b.size(1)};
  TORCH_CHECK(p.slice_offsets[0] == 0 && p.slice_offsets[slices] == n,
              "lora_delta: slice offsets must span out's columns");
  for (int64_t s = 0; s < segs; ++s)
    TORCH_CHECK(p.slots[s] >= 0 && p.slots[s] < a.size(0), "lora_delta: slot out of range");

  std::vector<std::pair<int64_t, int64_t>> units;  // (segment, first row)
  for (int64_t s = 0; s < segs; ++s)
    for (int64_t i = p.starts[s]; i < p.starts[s + 1]; i += kGroup) units.emplace_back(s, i);
  run_units(static_cast<int64_t>(units.size()), [&](int64_t u) {
    thread_local std::vector<float> h;
    if (static_cast<int64_t>(h.size()) < kGroup * width) h.resize(kGroup * width);
    unit(p, units[u].first, units[u].second, h.data());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "lora_delta(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor rows, Tensor seg_starts, "
      "Tensor seg_slots, Tensor slice_offsets, int rank) -> ()");
  m.impl("lora_delta", c10::DispatchKey::CPU, &lora_delta);
}
