// Candidate tokens of a screened greedy argmax (engine/greedy_screen.py).
//
// Input: approximate logits s [M, V] (float32 sums of bfloat16 products) and a per-element
// error bound e[r][v] = c * h_norm[r] * w_norm[v] with |exact - s| <= e. Row r's argmax can only
// be a token whose upper bound s + e reaches the largest lower bound T_r = max_v (s - e); the op
// returns the union over rows of those tokens, sorted by id.
//
// Invariant: every token whose exact logit could be a row's maximum (ties included) is
// returned, so the argmax over the returned tokens' exact logits is the argmax over the whole
// vocabulary. A relative slack on T_r covers this op's own float32 rounding.
//
// With a final logit soft-cap (Gemma 2: cap * tanh(x / cap), `cap` > 0) the argmax is over
// capped logits, and capping in float32 can round a slightly smaller logit to the same value
// as the maximum (a tie the first index wins). T_r is then lowered by `tie_margin`: any logit
// that far below T_r caps to a value strictly below every capped logit >= T_r, however each
// of the two was rounded, so the returned tokens still hold every possible capped maximum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kSlack = 1e-5f;
constexpr float kEverything = -3.0e38f;

// How far below t a logit must be for its capped value to be below every capped value of a
// logit >= t. One capped value, fl(fl(tanh(fl(x / cap))) * cap) (ATen may divide as a product
// by 1 / cap: one more rounding), is within 6 * 2^-24 * cap of cap * tanh(x / cap): the
// quotient's rounding moves tanh by at most max_z z sech^2 z < 0.45 of an ulp of 1, tanh's own
// error is taken as up to 4 ulps, the product's rounding 1. Two of them, with a 5x margin:
// 64 * 2^-24 * cap. The exact capped values of x <= t - d and y >= t differ by at least
// d * min sech^2 over [t - d, t], and |t - d| <= |t| + 1 while d <= 1. Past that (|t| many
// caps, tanh saturated) every token is a candidate and the caller takes the full logits.
double tie_margin(double t, double cap) {
  if (cap <= 0) return 0;
  const double z = (std::abs(t) + 1) / cap;
  if (z > 20) return -static_cast<double>(kEverything);
  const double sech = 1 / std::cosh(z);
  const double d = 64 * std::ldexp(1.0, -24) * cap / (sech * sech);
  return d <= 1 ? d : -static_cast<double>(kEverything);
}

// Marks row r's candidates in `mark` (one byte per token).
void screen_row(const float* s, float hn, const float* wn, int64_t v, float c, double cap,
                uint8_t* mark) {
  const float scale = c * hn;
  float t = kEverything;
  for (int64_t j = 0; j < v; ++j) t = std::max(t, s[j] - scale * wn[j]);
  t -= kSlack * (1.f + std::abs(t));
  t = static_cast<float>(std::max<double>(t - tie_margin(t, cap), kEverything));
  for (int64_t j = 0; j < v; ++j) mark[j] |= static_cast<uint8_t>(s[j] + scale * wn[j] >= t);
}

at::Tensor screen_candidates(const at::Tensor& scores, const at::Tensor& h_norm,
                             const at::Tensor& w_norm, double c, double cap) {
  TORCH_CHECK(cap >= 0, "screen_candidates: cap must be >= 0 (0: no soft-cap), got ", cap);
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "screen_candidates: scores must be contiguous float32 [M, V]");
  const int64_t m = scores.size(0), v = scores.size(1);
  TORCH_CHECK(h_norm.scalar_type() == at::kFloat && h_norm.is_contiguous() &&
                  h_norm.numel() == m,
              "screen_candidates: h_norm must be float32 [M]");
  TORCH_CHECK(w_norm.scalar_type() == at::kFloat && w_norm.is_contiguous() &&
                  w_norm.numel() == v,
              "screen_candidates: w_norm must be float32 [V]");
  const float* s = scores.data_ptr<float>();
  const float* hn = h_norm.data_ptr<float>();
  const float* wn = w_norm.data_ptr<float>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), m));
  std::vector<uint8_t> marks(static_cast<size_t>(threads * v), 0);
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    uint8_t* mark = marks.data() + std::min<int64_t>(at::get_thread_num(), threads - 1) * v;
    for (int64_t r = r0; r < r1; ++r)
      screen_row(s + r * v, hn[r], wn, v, static_cast<float>(c), cap, mark);
  });
  for (int64_t t = 1; t < threads; ++t)
    for (int64_t j = 0; j < v; ++j) marks[j] |= marks[t * v + j];
  std::vector<int64_t> ids;
  for (int64_t j = 0; j < v; ++j)
    if (marks[j]) ids.push_back(j);
  at::Tensor out = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

// Greedy ids of logits [M, V] (float32 or bfloat16): per row the index of the first maximum,
// as torch's max(dim).indices, or -1 where the row holds a NaN (the caller then takes torch's
// path, whose NaN ordering this does not reproduce). Why: torch's max over the last dim ran a
// 32 x 49,152 row set in ~1.5 ms on two cores, ten times the time to read it. Two passes that
// vectorise: the maximum (and a NaN test on the bits: -ffast-math drops x != x), then the first
// index holding it. Infinities compare as they should; NaN bit patterns are caught first.
inline float value_of(float x) { return x; }
inline float value_of(at::BFloat16 x) { return static_cast<float>(x); }
inline uint32_t abs_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u & 0x7fffffffu;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t v) {
  float best = value_of(row[0]);
  uint32_t worst_bits = 0;
  for (int64_t j = 0; j < v; ++j) {
    const float x = value_of(row[j]);
    best = std::max(best, x);
    worst_bits = std::max(worst_bits, abs_bits(x));
  }
  if (worst_bits > 0x7f800000u) return -1;  // a NaN
  for (int64_t j = 0; j < v; ++j)
    if (value_of(row[j]) == best) return j;
  return 0;  // unreachable: best is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "argmax_rows: logits must be contiguous float32 or bfloat16 [M, V]");
  const int64_t m = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({m}, at::kLong);
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ids[r] = logits.scalar_type() == at::kFloat
                   ? row_argmax(logits.data_ptr<float>() + r * v, v)
                   : row_argmax(logits.data_ptr<at::BFloat16>() + r * v, v);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def(
      "screen_candidates(Tensor scores, Tensor h_norm, Tensor w_norm, float c, float cap=0.) "
      "-> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("screen_candidates", &screen_candidates);
  m.impl("argmax_rows", &argmax_rows);
}
