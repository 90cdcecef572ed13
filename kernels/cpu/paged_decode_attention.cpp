// Paged decode attention for CPU: one query token per request, K/V read in place from the
// block-paged cache through each request's block table (no gather copy of the context).
//
// Shapes: q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] (contiguous);
// block_tables [B, max_blocks] int32; context_lens [B] int32; out [B, H, D].
// Work is split over requests; a task walks its context token by token and reads each K (then
// V) row once for all heads (GQA: H / KVH query heads share a KV head), so the cache streams
// contiguously from memory. Accumulation is in float32 with a numerically safe softmax (max
// subtracted); each head's arithmetic order is the same as one head at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
}

template <typename T>
void decode_request(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                    int32_t ctx_len, T* out, int64_t h, int64_t num_kv_heads, int64_t d,
                    int64_t block_size, float scale) {
  const int64_t group = h / num_kv_heads, row = num_kv_heads * d;
  std::vector<float> qf(h * d), scores(h * ctx_len), acc(h * d, 0.f);
  for (int64_t i = 0; i < h * d; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  // Token-major: each token's K (then V) row, all KV heads, is read once and contiguously.
  for (int32_t t = 0; t < ctx_len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const T* k_row = k_cache + slot * row;
    for (int64_t head = 0; head < h; ++head)
      scores[head * ctx_len + t] = dot(&qf[head * d], k_row + (head / group) * d, d);
  }
  for (int64_t head = 0; head < h; ++head) {
    float* s = &scores[head * ctx_len];
    // Built with -ffast-math (vectorised expf from libmvec), so no infinities: start from s[0].
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int32_t t = 0; t < ctx_len; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int32_t t = 0; t < ctx_len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int32_t t = 0; t < ctx_len; ++t) s[t] *= inv;
  }
  for (int32_t t = 0; t < ctx_len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const T* v_row = v_cache + slot * row;
    for (int64_t head = 0; head < h; ++head)
      axpy(scores[head * ctx_len + t], v_row + (head / group) * d, &acc[head * d], d);
  }
  for (int64_t i = 0; i < h * d; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
         double scale) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      decode_request<T>(qp + r * h * d, kp, vp, tp + r * max_blocks, lp[r], op + r * h * d, h,
                        num_kv_heads, d, block_size, static_cast<float>(scale));
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
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
