// Batched LoRA delta for CPU, float32: out[row] += (x[row] @ A[slot]^T) @ B[slot]^T for every
// adapter row of a step, all segments (one per adapter) in one call.
//
// Why: the PyTorch path makes two small matmuls (plus a gather and an index_add where a
// segment's rows are not contiguous) per adapter, projection and layer; with 8 adapters that
// is ~2,000 calls a step, each costing more in dispatch and thread start-up than its math.
//
// Layout (engine/lora/slots.py): a [L, S*R, K], b [L, N, S*R], both contiguous, slice s of a
// fused projection owning output columns [slice_offsets[s], slice_offsets[s + 1]) and rank
// columns [s*R, s*R + R) of B (the rest of B is zero, so it is never read). rows [M] int64 are
// the adapter rows of the flat batch, segment after segment (seg_starts [S+1], seg_slots [S]).
//
// Two phases, each parallel over work units taken from an atomic counter:
//   shrink  h[i][:] = x[rows[i]] @ A[slot]^T      units: (segment, 4 rows), 4x4 register block
//   expand  out[rows[i]][n] += h[i][sR:sR+R] . B[slot][n][sR:sR+R]   units: (segment, 64 cols)
// The expand transposes a 16-column x 16-rank tile of B once per segment and reuses it for all
// of the segment's rows. Each delta is summed in float32 on its own and then added to out once,
// as addmm does; the sums' order differs from MKL's only in rounding.
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

constexpr int kRows = 4;       // rows per shrink unit
constexpr int kRanks = 4;      // rank columns per shrink register block
constexpr int kColBlock = 64;  // output columns per expand unit

struct Problem {
  float* out;
  int64_t ldo;
  const float* x;
  int64_t ldx;
  const float* a;
  const float* b;
  const int64_t* rows;
  const int32_t* starts;
  const int32_t* slots;
  const int64_t* slice_offsets;
  int64_t num_slices, rank, width, k, n;
  float* h;  // [M, width]
};

float hsum(v16 v) {
  alignas(64) float t[16];
  store16(t, v);
  float s = 0.f;
  for (float e : t) s += e;
  return s;
}

void shrink_unit(const Problem& p, int64_t seg, int64_t i0) {
  const int64_t i1 = std::min<int64_t>(p.starts[seg + 1], i0 + kRows);
  const float* a = p.a + p.slots[seg] * p.width * p.k;
  const float* xr[kRows];
  for (int r = 0; r < kRows; ++r)  // rows past the unit repeat its first (results unused)
    xr[r] = p.x + p.rows[i0 + r < i1 ? i0 + r : i0] * p.ldx;
  const int64_t k16 = p.k / 16 * 16;
  for (int64_t j0 = 0; j0 < p.width; j0 += kRanks) {
    const float* ar[kRanks];
    for (int j = 0; j < kRanks; ++j) ar[j] = a + std::min(j0 + j, p.width - 1) * p.k;
    v16 acc[kRows][kRanks];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < kRanks; ++j) acc[r][j] = v16{};
    for (int64_t c = 0; c < k16; c += 16) {
      v16 xv[kRows], av[kRanks];
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) xv[r] = load16(xr[r] + c);
#pragma GCC unroll 4
      for (int j = 0; j < kRanks; ++j) av[j] = load16(ar[j] + c);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < kRanks; ++j) acc[r][j] += xv[r] * av[j];
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int j = 0; j < kRanks && j0 + j < p.width; ++j) {
        float s = hsum(acc[i - i0][j]);
        for (int64_t c = k16; c < p.k; ++c) s += xr[i - i0][c] * ar[j][c];
        p.h[i * p.width + j0 + j] = s;
      }
  }
}

// Columns [c, c + 16) of one slice: B's rank block transposed into bt[R][16], then every row.
void expand_vector(const Problem& p, int64_t seg, const float* b, int64_t c, int64_t rank0,
                   float* bt) {
  const int64_t R = p.rank;
  for (int64_t j0 = 0; j0 < R; j0 += 16) {
    v16 tile[16];
    const int64_t nj = std::min<int64_t>(16, R - j0);
    for (int i = 0; i < 16; ++i) {
      const float* src = b + (c + i) * p.width + rank0 + j0;
      if (nj == 16) {
        tile[i] = load16(src);
      } else {
        alignas(64) float tmp[16] = {};
        for (int64_t j = 0; j < nj; ++j) tmp[j] = src[j];
        tile[i] = load16(tmp);
      }
    }
    kvfleet::transpose16(tile);
    for (int64_t j = 0; j < nj; ++j) store16(bt + (j0 + j) * 16, tile[j]);
  }
  for (int64_t i = p.starts[seg]; i < p.starts[seg + 1]; ++i) {
    const float* h = p.h + i * p.width + rank0;
    v16 acc{};
    for (int64_t j = 0; j < R; ++j) acc += bcast(h[j]) * load16(bt + j * 16);
    float* o = p.out + p.rows[i] * p.ldo + c;
    store16(o, load16(o) + acc);
  }
}

void expand_scalar(const Problem& p, int64_t seg, const float* b, int64_t col, int64_t rank0) {
  const float* brow = b + col * p.width + rank0;
  for (int64_t i = p.starts[seg]; i < p.starts[seg + 1]; ++i) {
    const float* h = p.h + i * p.width + rank0;
    float s = 0.f;
    for (int64_t j = 0; j < p.rank; ++j) s += h[j] * brow[j];
    p.out[p.rows[i] * p.ldo + col] += s;
  }
}

void expand_unit(const Problem& p, int64_t seg, int64_t c0, float* bt) {
  const float* b = p.b + p.slots[seg] * p.n * p.width;
  const int64_t c1 = std::min(p.n, c0 + kColBlock);
  int64_t slice = 0;
  for (int64_t c = c0; c < c1;) {
    while (c >= p.slice_offsets[slice + 1]) ++slice;
    const int64_t end = std::min(c1, p.slice_offsets[slice + 1]);
    if (c + 16 <= end) {
      expand_vector(p, seg, b, c, slice * p.rank, bt);
      c += 16;
    } else {
      expand_scalar(p, seg, b, c, slice * p.rank);
      c += 1;
    }
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
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_delta: bad ranks");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora_delta: rows must be unit-stride and the stacks contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slice_offsets.scalar_type() == at::kLong &&
                  seg_starts.scalar_type() == at::kInt && seg_slots.scalar_type() == at::kInt,
              "lora_delta: rows and slice offsets int64, segment vectors int32");
  const int64_t width = a.size(1), k = a.size(2), n = b.size(1), slices = slice_offsets.numel() - 1;
  TORCH_CHECK(x.size(1) == k && out.size(1) == n && b.size(2) == width && b.size(0) == a.size(0),
              "lora_delta: shapes of x, out, a and b disagree");
  TORCH_CHECK(slices >= 1 && slices * rank == width, "lora_delta: slices x rank != a's width");
  const int64_t m = rows.numel(), segs = seg_slots.numel();
  if (m == 0 || segs == 0) return;
  at::Tensor h = at::empty({m, width}, x.options());
  Problem p{out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
            a.data_ptr<float>(), b.data_ptr<float>(), rows.data_ptr<int64_t>(),
            seg_starts.data_ptr<int32_t>(), seg_slots.data_ptr<int32_t>(),
            slice_offsets.data_ptr<int64_t>(), slices, rank, width, k, n, h.data_ptr<float>()};
  TORCH_CHECK(p.slice_offsets[0] == 0 && p.slice_offsets[slices] == n,
              "lora_delta: slice offsets must span out's columns");

  std::vector<std::pair<int64_t, int64_t>> units;  // (segment, first row)
  for (int64_t s = 0; s < segs; ++s)
    for (int64_t i = p.starts[s]; i < p.starts[s + 1]; i += kRows) units.emplace_back(s, i);
  run_units(static_cast<int64_t>(units.size()),
            [&](int64_t u) { shrink_unit(p, units[u].first, units[u].second); });

  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  run_units(segs * blocks, [&](int64_t u) {
    thread_local std::vector<float> bt;
    if (static_cast<int64_t>(bt.size()) < (rank + 16) * 16) bt.resize((rank + 16) * 16);
    expand_unit(p, u / blocks, u % blocks * kColBlock, bt.data());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "lora_delta(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor rows, Tensor seg_starts, "
      "Tensor seg_slots, Tensor slice_offsets, int rank) -> ()");
  m.impl("lora_delta", c10::DispatchKey::CPU, &lora_delta);
}
