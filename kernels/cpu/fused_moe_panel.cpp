// Fused mixture-of-experts MLP for CPU, float32, on panel-packed expert weights: the same
// result as fused_moe.cpp (out[t] = sum over the token's k experts e of
// w[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))), with the dense MLP's register blocking.
//
// Why a second kernel: fused_moe.cpp reads the weights as loaded ([N, K] rows), so its
// micro-kernel takes dot products along K and sums 24 accumulators across lanes at the end; in
// float32 that ran the SmolLM2-size Mixtral layer (8 experts of 768, top-2) at 1.7-2.5x the
// time of the dense 1,536-wide MLP of the same FLOPs on the panel kernel (panel_linear.cpp).
// Here each expert's weights are packed once as the dense projections are, and the
// micro-kernel is the panel kernel's outer product: up to 12 rows x 32 columns in 24 vector
// accumulators, per k one 32-float panel row loaded and each row's x[k] broadcast, no lane sums.
//
// Packed layouts (engine/models/moe.py, pack_expert_panels):
//   gate_up [E, I / 16, H, 32]: panel p of expert e holds gate columns [16 p, 16 p + 16) then
//     the matching up columns, one 32-float row per k, so the tile ends in SiLU-and-mul;
//   down    [E, ceil(H / 32), I, 32]: panel p holds output columns [32 p, 32 p + 32),
//     zero-padded past H.
// Phases (fused_moe_common.h sorts, hands out units and combines):
//   A  per (expert, row block, panel group): act[pos, I] = silu(x[tok] . gate) * (x[tok] . up);
//      x rows are read in place through per-row pointers (no gathered copy);
//   B  per (expert, row block, panel group): y[pos, H] = (act[pos] . down) * routing weight;
//   C  combine: each token's k rows of y summed in expert order.
// Each output element is a sum over k in increasing order, one rounding per FMA; results differ
// from the PyTorch path's GEMMs only in the last bits, as any two BLAS libraries do.
//
// Work units go to threads from an atomic counter, each thread claiming its next unit before
// running the current one so that the last panel it computes can prefetch the first panel of
// the next (a decode batch streams every expert's weights from DRAM, ~42 MB a layer here).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "fused_moe_common.h"
#include "panel_layout.h"

namespace {

using namespace kvfleet_panel;  // NOLINT: the packed geometry and the vector helpers

// The next panel a tile helps to prefetch: its k row `row` first, then one every `every` k
// steps (the tiles over a panel share the work; null: nothing to fetch).
struct Prefetch {
  const float* row;
  int64_t every;
};

// Accumulates x rows a[0..MR) against one panel: acc0 = columns 0..15, acc1 = 16..31.
template <int MR>
__attribute__((always_inline)) inline void panel_tile(const float* const* a, const float* b,
                                                      int64_t k_len, const Prefetch& pf,
                                                      v16 (&acc0)[MR], v16 (&acc1)[MR]) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = v16{};
  int64_t countdown = 1;
  for (int64_t k = 0; k < k_len; ++k) {
    if (pf.row && --countdown == 0) {
      const char* p = reinterpret_cast<const char*>(pf.row + k * kPanel);
      __builtin_prefetch(p, 0, 2);
      __builtin_prefetch(p + 64, 0, 2);
      countdown = pf.every;
    }
    const v16 b0 = load16(b + k * kPanel), b1 = load16(b + k * kPanel + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const v16 ai = bcast(a[i][k]);
      acc0[i] += ai * b0;
      acc1[i] += ai * b1;
    }
  }
}

// Phase A tile: act rows (stride `ld`) get silu(gate) * up for the panel's 16 columns. The
// expression of silu_and_mul in fused_elementwise.cpp (libmvec expf under -ffast-math).
template <int MR>
void gate_up_tile(const float* const* a, const float* b, int64_t k_len, const Prefetch& pf,
                  float* act, int64_t ld, const float*, int) {
  v16 g[MR], u[MR];
  panel_tile<MR>(a, b, k_len, pf, g, u);
  for (int i = 0; i < MR; ++i) {
    alignas(64) float gs[16], us[16];
    store16(gs, g[i]);
    store16(us, u[i]);
    float* o = act + i * ld;
#pragma omp simd
    for (int c = 0; c < 16; ++c) o[c] = gs[c] / (1.f + std::exp(-gs[c])) * us[c];
  }
}

// Phase B tile: y rows (stride `ld`) get the panel's `cols` columns times the row's weight.
template <int MR>
void down_tile(const float* const* a, const float* b, int64_t k_len, const Prefetch& pf,
               float* y, int64_t ld, const float* scale, int cols) {
  v16 acc0[MR], acc1[MR];
  panel_tile<MR>(a, b, k_len, pf, acc0, acc1);
  for (int i = 0; i < MR; ++i) {
    const v16 s = bcast(scale[i]);
    if (cols == kPanel) {
      store16(y + i * ld, acc0[i] * s);
      store16(y + i * ld + 16, acc1[i] * s);
    } else {  // the last panel: only the real columns
      alignas(64) float tmp[kPanel];
      store16(tmp, acc0[i] * s);
      store16(tmp + 16, acc1[i] * s);
      std::memcpy(y + i * ld, tmp, sizeof(float) * cols);
    }
  }
}

using TileFn = void (*)(const float* const*, const float*, int64_t, const Prefetch&, float*,
                        int64_t, const float*, int);

template <bool GateUp>
TileFn pick(int rows) {
  static constexpr TileFn gu[kMaxRows + 1] = {
      nullptr,          gate_up_tile<1>,  gate_up_tile<2>,  gate_up_tile<3>, gate_up_tile<4>,
      gate_up_tile<5>,  gate_up_tile<6>,  gate_up_tile<7>,  gate_up_tile<8>, gate_up_tile<9>,
      gate_up_tile<10>, gate_up_tile<11>, gate_up_tile<12>};
  static constexpr TileFn dn[kMaxRows + 1] = {
      nullptr,       down_tile<1>,  down_tile<2>,  down_tile<3>,  down_tile<4>,
      down_tile<5>,  down_tile<6>,  down_tile<7>,  down_tile<8>,  down_tile<9>,
      down_tile<10>, down_tile<11>, down_tile<12>};
  return GateUp ? gu[rows] : dn[rows];
}

struct Unit {
  int64_t expert, r0, r1, p0, p1;
};

// Units over every expert's row blocks x panel groups, about eight per thread.
std::vector<Unit> make_units(const std::vector<int64_t>& offsets, int64_t panels, int64_t k_len) {
  const int64_t row_block = std::max<int64_t>(
      kMaxRows, kRowBlockBytes / (k_len * static_cast<int64_t>(sizeof(float))) / kMaxRows *
                    kMaxRows);
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  int64_t blocks = 0;
  for (int64_t e = 0; e < experts; ++e)
    blocks += (offsets[e + 1] - offsets[e] + row_block - 1) / row_block;
  const int64_t target = std::max<int64_t>(1, at::get_num_threads()) * 8;
  const int64_t group = std::clamp<int64_t>(blocks * panels / target, 1, panels);
  std::vector<Unit> units;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += row_block)
      for (int64_t p = 0; p < panels; p += group)
        units.push_back({e, r, std::min(offsets[e + 1], r + row_block), p,
                         std::min(panels, p + group)});
  return units;
}

// One phase: for each unit, each panel of it, each tile of up to 12 of its rows.
struct Phase {
  const float* panels;   // [E, P, K, 32]
  int64_t panels_per_e;  // P
  int64_t k_len;
  int64_t out_step;  // out columns per panel (16 for gate/up, 32 for down)
  int64_t out_cols;  // columns of out (I or H)
  float* out;        // [rows, out_cols] by position
  TileFn (*pick)(int);
  // The input row of a position (x's token row in A, the act row in B).
  const float* (*row)(const void* ctx, int64_t pos);
  const void* ctx;
  const float* scale;  // by position, or null
};

void run_phase(const Phase& ph, const std::vector<Unit>& units) {
  const int64_t panel_elems = ph.k_len * kPanel;
  const int64_t n_units = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n_units);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    int64_t u = next.fetch_add(1);
    while (u < n_units) {
      const int64_t u_next = next.fetch_add(1);
      const Unit& w = units[u];
      const float* base = ph.panels + w.expert * ph.panels_per_e * panel_elems;
      const float* after = nullptr;
      if (u_next < n_units) {
        const Unit& nw = units[u_next];
        after = ph.panels + (nw.expert * ph.panels_per_e + nw.p0) * panel_elems;
      }
      // Tiles of near-equal rows (13 rows: 7 + 6, not 12 + 1): a decode batch gives each
      // expert a few to a dozen-odd rows, and a 1- or 2-row tile streams a whole panel for a
      // few FMAs a k step whose latency it cannot hide. Each output is the same FMA chain
      // whichever tile holds its row.
      const int64_t n = w.r1 - w.r0, tiles = (n + kMaxRows - 1) / kMaxRows;
      const int64_t per = n / tiles, extra = n % tiles;  // the first `extra` tiles get one more
      for (int64_t p = w.p0; p < w.p1; ++p) {
        const float* b = base + p * panel_elems;
        const float* nxt = p + 1 < w.p1 ? b + panel_elems : after;
        const int cols =
            static_cast<int>(std::min<int64_t>(ph.out_step, ph.out_cols - p * ph.out_step));
        for (int64_t tile = 0, r = w.r0; tile < tiles; ++tile) {
          const int rows = static_cast<int>(per + (tile < extra ? 1 : 0));
          const float* a[kMaxRows];
          for (int i = 0; i < rows; ++i) a[i] = ph.row(ph.ctx, r + i);
          const Prefetch pf{nxt ? nxt + tile * kPanel : nullptr, tiles};
          ph.pick(rows)(a, b, ph.k_len, pf, ph.out + r * ph.out_cols + p * ph.out_step,
                        ph.out_cols, ph.scale ? ph.scale + r : nullptr, cols);
          r += rows;
        }
      }
      u = u_next;
    }
  });
}

struct Rows0 {
  const float* x;
  int64_t ldx;
  const int64_t* flat;
  int64_t topk;
};

const float* x_row(const void* ctx, int64_t pos) {
  const auto* c = static_cast<const Rows0*>(ctx);
  return c->x + c->flat[pos] / c->topk * c->ldx;
}

struct Rows1 {
  const float* act;
  int64_t inter;
};

const float* act_row(const void* ctx, int64_t pos) {
  const auto* c = static_cast<const Rows1*>(ctx);
  return c->act + pos * c->inter;
}

void fused_moe_panel(at::Tensor out, const at::Tensor& x, const at::Tensor& topk_ids,
                     const at::Tensor& topk_weights, const at::Tensor& gate_up,
                     const at::Tensor& down) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat,
              "fused_moe_panel: x, out and the packed weights must be float32");
  kvfleet::moe::check_routing(out, x, topk_ids, topk_weights);
  TORCH_CHECK(gate_up.dim() == 4 && down.dim() == 4 && gate_up.size(3) == kPanel &&
                  down.size(3) == kPanel && gate_up.is_contiguous() && down.is_contiguous(),
              "fused_moe_panel: gate_up must be packed [E, I/16, H, 32] and down "
              "[E, ceil(H/32), I, 32], contiguous");
  const int64_t hidden = x.size(1), experts = gate_up.size(0), inter = gate_up.size(1) * 16;
  const int64_t down_panels = (hidden + kPanel - 1) / kPanel;
  TORCH_CHECK(gate_up.size(2) == hidden && down.size(0) == experts &&
                  down.size(1) == down_panels && down.size(2) == inter,
              "fused_moe_panel: packed gate_up and down shapes disagree with x's hidden size");
  if (x.size(0) == 0) return;
  const int64_t topk = topk_ids.size(1), rows = topk_ids.numel();
  const kvfleet::moe::Routing routing = kvfleet::moe::sort_by_expert(topk_ids, experts);
  // The routing weight of each row, by position (phase B scales its tile rows by it).
  std::vector<float> scale(rows);
  const float* w = topk_weights.data_ptr<float>();
  for (int64_t pos = 0; pos < rows; ++pos) scale[pos] = w[routing.flat[pos]];
  at::Tensor act = at::empty({rows, inter}, x.options());
  at::Tensor y = at::empty({rows, hidden}, x.options());

  const Rows0 xs{x.data_ptr<float>(), x.stride(0), routing.flat.data(), topk};
  const Phase a{gate_up.data_ptr<float>(), inter / 16, hidden, 16, inter,
                act.data_ptr<float>(), pick<true>, x_row, &xs, nullptr};
  run_phase(a, make_units(routing.offsets, inter / 16, hidden));

  const Rows1 as{act.data_ptr<float>(), inter};
  const Phase b{down.data_ptr<float>(), down_panels, inter, kPanel, hidden,
                y.data_ptr<float>(), pick<false>, act_row, &as, scale.data()};
  run_phase(b, make_units(routing.offsets, down_panels, inter));

  kvfleet::moe::combine<float>(out, y.data_ptr<float>(), routing, topk, hidden);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "fused_moe_panel(Tensor(a!) out, Tensor x, Tensor topk_ids, Tensor topk_weights, "
      "Tensor gate_up_panels, Tensor down_panels) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("fused_moe_panel", &fused_moe_panel); }
