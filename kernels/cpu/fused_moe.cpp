// Fused mixture-of-experts MLP for CPU, float32 and bfloat16: out[t] = sum over the token's k
// routed experts e of w[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t])), in one call.
//
// Why: the PyTorch path (engine/models/moe.py) makes an argsort, a bincount, a host sync and
// then five to six ATen calls per expert hit (index_select, two GEMMs, SiLU, mul, index_add);
// at decode sizes that dispatch costs more than the math, and its intermediates round-trip
// through memory. Here the routing is grouped once (a counting sort, stable: an expert's rows
// stay in token order, as the PyTorch path's stable argsort keeps them), and each expert's
// rows run as one grouped GEMM against that expert's weights.
//
// Weights stay in the model's layout, no packed copy: gate_up [E, 2I, H] (gate rows, then up)
// and down [E, H, I], both row-major (a row per output column). The micro-kernel therefore
// takes dot products along K: up to 4 rows x 6 weight rows in 24 vector accumulators, the rows'
// K chunks loaded once per chunk and each weight row's chunk once, summed across lanes at the
// end. The gate/up tile holds 3 gate rows and their 3 up rows, so SiLU-and-mul is applied in
// registers and only the [rows, I] activation is stored.
//
// Phases (each a pass of work units over an atomic counter, as lora_delta's):
//   A  per (expert, row block, column group): act[pos] = silu(x[tok] . gate) * (x[tok] . up),
//      pos being the row's place in expert order; bfloat16 act is rounded once.
//   B  per (expert, row block, column group): y[pos] = (act[pos] . down) * routing weight,
//      float32.
//   C  per token: out[t] = sum of its k rows of y in expert order (the PyTorch path's
//      index_add_ order), rounded to out's dtype once.
// Float32 results equal the PyTorch path's to rounding (only the dot products' summation
// order differs). bfloat16 sums bf16 x bf16 products in float32 (VDPBF16PS where the CPU has
// AVX512-BF16, else widened FMAs) and rounds the activation and the output only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVFLEET_MOE_BF16 1
#endif

#include "fused_moe_common.h"
#include "simd.h"

namespace {

using BF16 = c10::BFloat16;
using kvfleet::load16;
using kvfleet::v16;

constexpr int kMr = 4;           // rows per register tile
constexpr int kNc = 6;           // weight rows per register tile
constexpr int kPairs = kNc / 2;  // gate/up tile: 3 gate rows + their 3 up rows
constexpr int64_t kRowBlock = 32;

inline float to_float(float v) { return v; }
inline float to_float(BF16 v) { return static_cast<float>(v); }

// res[r][c] = the sum of acc[r][c]'s lanes, 16 accumulators per transpose-and-add network
// (simd.h's reduce16): a horizontal sum each cost about as much as a quarter of the K loop.
template <int MR>
inline void reduce_tile(v16 (&acc)[MR][kNc], float (*res)[kNc]) {
  constexpr int kCount = MR * kNc;
  v16 rows[32];
  for (int i = 0; i < 32; ++i) rows[i] = i < kCount ? acc[i / kNc][i % kNc] : v16{};
  alignas(64) float sums[32];
  kvfleet::store16(sums, kvfleet::reduce16(rows));
  if (kCount > 16) kvfleet::store16(sums + 16, kvfleet::reduce16(rows + 16));
  for (int i = 0; i < kCount; ++i) res[i / kNc][i % kNc] = sums[i];
}

// res[r][c] = a[r] . w[c] over k_len elements.
template <int MR, typename T>
inline void dot_tile(const T* const* a, const T* const* w, int64_t k_len, float (*res)[kNc]) {
  int64_t k = 0;
#if KVFLEET_MOE_BF16
  if constexpr (std::is_same_v<T, BF16>) {
    // Pairs of bf16 products summed exactly into float32 lanes, 32 elements per step.
    __m512 acc[MR][kNc];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 6
      for (int c = 0; c < kNc; ++c) acc[r][c] = _mm512_setzero_ps();
    for (; k + 32 <= k_len; k += 32) {
      __m512bh xa[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) xa[r] = (__m512bh)_mm512_loadu_si512(a[r] + k);
#pragma GCC unroll 6
      for (int c = 0; c < kNc; ++c) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[c] + k);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xa[r], wv);
      }
    }
    v16 sums[MR][kNc];
    std::memcpy(sums, acc, sizeof sums);  // the same 16 floats per register
    reduce_tile<MR>(sums, res);
  } else
#endif
  {
    v16 acc[MR][kNc];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 6
      for (int c = 0; c < kNc; ++c) acc[r][c] = v16{};
    for (; k + 16 <= k_len; k += 16) {
      v16 xa[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) xa[r] = load16(a[r] + k);
#pragma GCC unroll 6
      for (int c = 0; c < kNc; ++c) {
        const v16 wv = load16(w[c] + k);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) acc[r][c] += xa[r] * wv;
      }
    }
    reduce_tile<MR>(acc, res);
  }
  for (; k < k_len; ++k)  // K not a multiple of the step: the rest one element at a time
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kNc; ++c) res[r][c] += to_float(a[r][k]) * to_float(w[c][k]);
}

template <typename T>
using DotFn = void (*)(const T* const*, const T* const*, int64_t, float (*)[kNc]);

template <typename T>
DotFn<T> pick(int rows) {
  static constexpr DotFn<T> table[kMr + 1] = {nullptr, dot_tile<1, T>, dot_tile<2, T>,
                                              dot_tile<3, T>, dot_tile<4, T>};
  return table[rows];
}

template <typename T>
struct Problem {
  const T* x;
  int64_t ldx;
  const T* gate_up;  // [E, 2I, H]
  const T* down;     // [E, H, I]
  int64_t hidden, inter;
  const int64_t* offsets;  // [E + 1]: expert e's rows are positions [offsets[e], offsets[e+1])
  const int64_t* flat;     // [T * k]: position -> flat index t * k + slot
  const float* weights;    // [T * k] by flat index
  int64_t topk;
  T* act;    // [T * k, I] by position
  float* y;  // [T * k, H] by position
};

struct Unit {
  int64_t expert, r0, r1, c0, c1;
};

// Units over every expert's row blocks x column groups (columns: `cols` in steps of `step`),
// about eight per thread so a core slowed by another process does not leave a long tail.
std::vector<Unit> make_units(const int64_t* offsets, int64_t experts, int64_t cols, int64_t step) {
  const int64_t tiles = (cols + step - 1) / step;
  int64_t blocks = 0;
  for (int64_t e = 0; e < experts; ++e)
    blocks += (offsets[e + 1] - offsets[e] + kRowBlock - 1) / kRowBlock;
  const int64_t target = std::max<int64_t>(1, at::get_num_threads()) * 8;
  const int64_t group = std::max<int64_t>(1, blocks * tiles / target) * step;
  std::vector<Unit> units;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRowBlock)
      for (int64_t c = 0; c < cols; c += group)
        units.push_back({e, r, std::min(offsets[e + 1], r + kRowBlock), c,
                         std::min(cols, c + group)});
  return units;
}

// Phase A: silu(gate) * up for columns [c0, c1) of the unit's rows.
template <typename T>
void gate_up_unit(const Problem<T>& p, const Unit& u) {
  const T* base = p.gate_up + u.expert * 2 * p.inter * p.hidden;
  for (int64_t j = u.c0; j < u.c1; j += kPairs) {
    const int n = static_cast<int>(std::min<int64_t>(kPairs, u.c1 - j));
    const T* w[kNc];
    for (int c = 0; c < kPairs; ++c) {  // past the last column: repeat it (results unused)
      const int64_t col = j + std::min(c, n - 1);
      w[c] = base + col * p.hidden;
      w[kPairs + c] = base + (p.inter + col) * p.hidden;
    }
    for (int64_t r = u.r0; r < u.r1; r += kMr) {
      const int rows = static_cast<int>(std::min<int64_t>(kMr, u.r1 - r));
      const T* a[kMr];
      for (int i = 0; i < rows; ++i) a[i] = p.x + p.flat[r + i] / p.topk * p.ldx;
      float res[kMr][kNc];
      pick<T>(rows)(a, w, p.hidden, res);
      for (int i = 0; i < rows; ++i)
        for (int c = 0; c < n; ++c) {
          const float g = res[i][c];
          p.act[(r + i) * p.inter + j + c] = static_cast<T>(g / (1.f + std::exp(-g)) * res[i][kPairs + c]);
        }
    }
  }
}

// Phase B: y = (act . down) * routing weight for columns [c0, c1) of the unit's rows.
template <typename T>
void down_unit(const Problem<T>& p, const Unit& u) {
  const T* base = p.down + u.expert * p.hidden * p.inter;
  for (int64_t j = u.c0; j < u.c1; j += kNc) {
    const int n = static_cast<int>(std::min<int64_t>(kNc, u.c1 - j));
    const T* w[kNc];
    for (int c = 0; c < kNc; ++c) w[c] = base + (j + std::min(c, n - 1)) * p.inter;
    for (int64_t r = u.r0; r < u.r1; r += kMr) {
      const int rows = static_cast<int>(std::min<int64_t>(kMr, u.r1 - r));
      const T* a[kMr];
      for (int i = 0; i < rows; ++i) a[i] = p.act + (r + i) * p.inter;
      float res[kMr][kNc];
      pick<T>(rows)(a, w, p.inter, res);
      for (int i = 0; i < rows; ++i) {
        const float weight = p.weights[p.flat[r + i]];
        for (int c = 0; c < n; ++c) p.y[(r + i) * p.hidden + j + c] = res[i][c] * weight;
      }
    }
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
         const at::Tensor& gate_up, const at::Tensor& down) {
  const int64_t hidden = x.size(1), topk = ids.size(1);
  const int64_t experts = gate_up.size(0), inter = down.size(2), rows = ids.numel();
  const kvfleet::moe::Routing routing = kvfleet::moe::sort_by_expert(ids, experts);
  const int64_t* offsets = routing.offsets.data();
  at::Tensor act = at::empty({rows, inter}, x.options());
  at::Tensor y = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  const Problem<T> p{x.data_ptr<T>(), x.stride(0), gate_up.data_ptr<T>(), down.data_ptr<T>(),
                     hidden, inter, offsets, routing.flat.data(), weights.data_ptr<float>(),
                     topk, act.data_ptr<T>(), y.data_ptr<float>()};
  const std::vector<Unit> a_units = make_units(offsets, experts, inter, kPairs);
  kvfleet::moe::run_units(static_cast<int64_t>(a_units.size()),
                          [&](int64_t u) { gate_up_unit(p, a_units[u]); });
  const std::vector<Unit> b_units = make_units(offsets, experts, hidden, kNc);
  kvfleet::moe::run_units(static_cast<int64_t>(b_units.size()),
                          [&](int64_t u) { down_unit(p, b_units[u]); });
  kvfleet::moe::combine<T>(out, p.y, routing, topk, hidden);
}

void fused_moe(at::Tensor out, const at::Tensor& x, const at::Tensor& topk_ids,
               const at::Tensor& topk_weights, const at::Tensor& gate_up, const at::Tensor& down) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "fused_moe: x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype && gate_up.scalar_type() == dtype &&
                  down.scalar_type() == dtype,
              "fused_moe: out, gate_up and down must have x's dtype");
  kvfleet::moe::check_routing(out, x, topk_ids, topk_weights);
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3,
              "fused_moe: gate_up [E, 2I, H], down [E, H, I]");
  const int64_t hidden = x.size(1), experts = gate_up.size(0), inter = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && gate_up.size(2) == hidden &&
                  down.size(0) == experts && down.size(1) == hidden,
              "fused_moe: gate_up and down shapes disagree with x's hidden size");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(),
              "fused_moe: gate_up and down must be contiguous");
  if (x.size(0) == 0) return;
  if (dtype == at::kFloat)
    run<float>(out, x, topk_ids, topk_weights, gate_up, down);
  else
    run<BF16>(out, x, topk_ids, topk_weights, gate_up, down);
}

// One token's routing: softmax in float32 over its E logits, the k largest probabilities
// (descending; on equal ones the lower expert first), renormalised to sum 1 when asked. The
// operations and their order are engine/models/moe.py's PyTorch route (max-subtracted exp,
// divide by the sum, top-k, divide by the k weights' sum); only exp's last bit may differ.
void route_row(const float* logits, int64_t experts, int64_t topk, bool renorm, float* probs,
               float* weights, int64_t* ids) {
  float top = logits[0];  // not -inf: -ffast-math assumes finite values
  for (int64_t e = 1; e < experts; ++e) top = std::max(top, logits[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < experts; ++e) {
    probs[e] = std::exp(logits[e] - top);
    sum += probs[e];
  }
  for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
  float picked = 0.f;
  for (int64_t s = 0; s < topk; ++s) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    ids[s] = best;
    weights[s] = probs[best];
    picked += probs[best];
    probs[best] = -1.f;  // taken
  }
  if (renorm)
    for (int64_t s = 0; s < topk; ++s) weights[s] /= picked;
}

// (weights [T, k], ids [T, k] int64) from float32 router logits [T, E]: route_row per token,
// in place of five ATen calls (softmax, topk, sum, divide, and the copies) per MoE layer.
// float32 only: bfloat16 logits tie often, and on ties torch.topk's choice (unspecified) is
// what the PyTorch path and transformers make, so bfloat16 keeps that path.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t topk,
                                             bool renorm) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "moe_route: logits must be float32");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "moe_route: logits must be a contiguous [T, experts] tensor");
  const int64_t rows = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(topk >= 1 && topk <= experts, "moe_route: top_k must be in [1, experts], got ",
              topk);
  at::Tensor weights = at::empty({rows, topk}, logits.options());
  at::Tensor ids = at::empty({rows, topk}, logits.options().dtype(at::kLong));
  const float* l = logits.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  // Decode batches run inline (no thread barrier); prefill chunks split.
  at::parallel_for(0, rows, 256, [&](int64_t t0, int64_t t1) {
    std::vector<float> probs(experts);
    for (int64_t t = t0; t < t1; ++t)
      route_row(l + t * experts, experts, topk, renorm, probs.data(), w + t * topk,
                id + t * topk);
  });
  return {weights, ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "fused_moe(Tensor(a!) out, Tensor x, Tensor topk_ids, Tensor topk_weights, "
      "Tensor gate_up, Tensor down) -> ()");
  m.def("moe_route(Tensor logits, int top_k, bool renorm) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("moe_route", &moe_route);
}
