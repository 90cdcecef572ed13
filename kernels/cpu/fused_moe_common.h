// Shared by the fused MoE kernels: fused_moe.cpp (weights as loaded, float32 and bfloat16) and
// fused_moe_panel.cpp (float32 on panel-packed weights).
//
// Both group a batch's (token, slot) rows by expert with one stable counting sort (within an
// expert, rows stay in token order, as the PyTorch path's stable argsort keeps them), run the
// expert GEMMs over those groups into float32 rows y (one per (token, slot), in expert order,
// already scaled by the routing weight), and end with `combine`: each token's k rows of y
// summed in expert order (the PyTorch path's index_add_ order), rounded to out's dtype once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvfleet::moe {

// The batch's rows in expert order: expert e owns positions [offsets[e], offsets[e + 1]);
// flat[pos] is the row's index t * k + slot; position[t * k + slot] is its place.
struct Routing {
  std::vector<int64_t> offsets, flat, position;
};

inline Routing sort_by_expert(const at::Tensor& ids, int64_t experts) {
  const int64_t rows = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  Routing r{std::vector<int64_t>(experts + 1, 0), std::vector<int64_t>(rows),
            std::vector<int64_t>(rows)};
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "fused_moe: topk_ids holds expert ", id[i],
                " outside [0, ", experts, ")");
    ++r.offsets[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) r.offsets[e + 1] += r.offsets[e];
  std::vector<int64_t> fill(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t i = 0; i < rows; ++i) {
    r.position[i] = fill[id[i]]++;
    r.flat[r.position[i]] = i;
  }
  return r;
}

// Hands units [0, units) to the torch threads from an atomic counter rather than splitting
// them evenly up front: when another process takes a core for a while, the other thread keeps
// taking units instead of waiting at the barrier for a fixed half.
template <typename F>
void run_units(int64_t units, F&& body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) body(u);
  });
}

// out[t] = the sum of y's rows of token t in position (= expert) order.
template <typename T>
void combine(at::Tensor& out, const float* y, const Routing& routing, int64_t topk,
             int64_t hidden) {
  T* o = out.data_ptr<T>();
  const int64_t ldo = out.stride(0), tokens = out.size(0);
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> pos(topk);
    std::vector<float> sum(hidden);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t s = 0; s < topk; ++s) pos[s] = routing.position[t * topk + s];
      std::sort(pos.begin(), pos.end());
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t s = 0; s < topk; ++s) {
        const float* row = y + pos[s] * hidden;
        for (int64_t c = 0; c < hidden; ++c) sum[c] += row[c];
      }
      for (int64_t c = 0; c < hidden; ++c) o[t * ldo + c] = static_cast<T>(sum[c]);
    }
  });
}

// Argument checks shared by both ops (the weights' own shapes are each op's).
inline void check_routing(const at::Tensor& out, const at::Tensor& x, const at::Tensor& ids,
                          const at::Tensor& weights) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat,
              "fused_moe: topk_ids must be int64 and topk_weights float32");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && ids.dim() == 2,
              "fused_moe: x/out [T, H], topk_ids/topk_weights [T, k]");
  TORCH_CHECK(ids.size(0) == x.size(0) && weights.sizes() == ids.sizes() &&
                  out.sizes() == x.sizes(),
              "fused_moe: topk_ids, topk_weights and out must have x's rows");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && ids.is_contiguous() &&
                  weights.is_contiguous(),
              "fused_moe: rows must be unit-stride and the routing contiguous");
}

}  // namespace kvfleet::moe
