// Linear layer on a panel-packed weight: out[M, N] = x[M, K] @ W[N, K]^T, float32 and (where
// the CPU has AVX512-BF16) bfloat16.
//
// Why: at decode-sized M (8-64 rows) oneDNN ran this model's projections at 110-155 GFLOP/s on
// a 2-core Zen 4 against ~218 at large M; a register-blocked kernel over a layout made for it
// keeps the FMA units busy at small M as well. The engine uses it only where start-up
// measurement shows it faster (engine/models/gemm_select.py).
//
// Packed layout (made by engine/models/linear.py): [P = ceil(N / 32)][K][32]: panel p holds
// columns [32 p, 32 p + 32) of W^T, one 32-float row per k, zero-padded past N. A panel is
// read front to back (hardware prefetch streams it from memory once per call) and stays in
// L2 while every row block of x passes over it.
//
// Micro-kernel: up to 12 rows x 32 columns of out in 24 vector accumulators; per k, two panel
// vectors are loaded and each row's x[m][k] is broadcast into two FMAs. Each output element is
// the sum over k in increasing order (one rounding per FMA); results differ from other GEMMs
// only in the last bits, like any two BLAS libraries.
//
// Gate/up projections may be packed gate/up interleaved instead, [I / 16][K][32] (float32;
// bfloat16 for GeGLU only, in its pair layout) (engine/models/linear.py, pack_gate_up_panels):
// the same micro-kernel then ends in SiLU-and-mul or GeGLU (gelu_tanh(gate) * up, Gemma)
// (panel_gate_up, panel_gate_up_bf16), or stores gate and up to their halves of a [M, 2I] out.
//
// bfloat16: the panel holds k in pairs, [P][ceil(K / 2)][32][2], and one VDPBF16PS per vector
// adds both products of a pair (exact bf16 x bf16 products, float32 sums, as oneDNN's bf16
// GEMM); the float32 sums are rounded to bfloat16 once, to nearest even, on store.
//
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVFLEET_PANEL_BF16 1
#endif

#include "fused_gemma.h"
#include "panel_layout.h"

namespace {

using namespace kvfleet_panel;  // NOLINT: the packed geometry and the vector helpers

// Epilogues of the float32 micro-kernel: the 32 columns as they are; or, on a gate/up
// interleaved panel (16 gate columns, then the matching 16 up columns; see panel_gate_up),
// either silu(gate) * up or gelu_tanh(gate) * up into 16 columns, or gate and up stored to
// their own halves of out. The same expressions, vectorised the same way (libmvec expf), as
// silu_and_mul in fused_elementwise.cpp and gelu_tanh_and_mul in fused_gemma.cpp, so the fused
// and unfused paths agree bit for bit.
inline void silu_mul16(float* __restrict o, const float* __restrict g,
                       const float* __restrict u) {
#pragma omp simd
  for (int i = 0; i < 16; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

inline void gelu_mul16(float* __restrict o, const float* __restrict g,
                       const float* __restrict u) {
#pragma omp simd
  for (int i = 0; i < 16; ++i) o[i] = kvfleet_cpu::gelu_tanh_mul(g[i], u[i]);
}

enum class Epilogue { kPlain, kSiluMul, kGeluMul, kSplit };

// Software prefetch of the next panel into L2 while this one is computed: a decode step's
// weights come from DRAM (the whole model does not fit in L3) and the hardware prefetcher
// restarts at every 4 KiB page; without it the 64-row projections of SmolLM2 ran at 177
// GFLOP/s from DRAM against 280 with the weights in cache. The T row tiles over a panel share
// the work, tile t fetching the next panel's k rows t, t + T, ... (`pf` points at row t; null:
// none), so the requests are spread over the whole panel's compute instead of bursting. "Next"
// is the panel the same thread computes next (see drive): prefetching the panel that follows
// in memory fetched, at a unit's end, a panel the other thread was already computing, and
// with one-panel units (SmolLM2's qkv, o and down projections at two threads) that was every
// prefetch; fixed, a 30-layer decode sweep from DRAM took 10-18% less time (64 to 8 rows).
struct Prefetch {
  const void* row;     // the next panel's k row this tile fetches first
  int64_t row_bytes;   // bytes per k row of a panel
  int64_t every;       // fetch one k row every `every` k steps (the tile count)
};
inline void prefetch_row(const void* pf, int64_t offset_bytes) {
  const char* p = static_cast<const char*>(pf) + offset_bytes;
  __builtin_prefetch(p, 0, 2);
  __builtin_prefetch(p + 64, 0, 2);
}

template <int MR, Epilogue E = Epilogue::kPlain>
inline void micro(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t k_len,
                  float* __restrict c, int64_t ldc, int cols, const Prefetch& pf) {
  v16 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = v16{};
  int64_t countdown = 1;
  for (int64_t k = 0; k < k_len; ++k) {
    if (pf.row && --countdown == 0) {
      prefetch_row(pf.row, k * pf.row_bytes);
      countdown = pf.every;
    }
    const v16 b0 = load16(b + k * kPanel), b1 = load16(b + k * kPanel + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const v16 ai = bcast(a[i * lda + k]);
      acc0[i] += ai * b0;
      acc1[i] += ai * b1;
    }
  }
  if constexpr (E == Epilogue::kSiluMul || E == Epilogue::kGeluMul) {
    for (int i = 0; i < MR; ++i) {
      float g[16], u[16];
      store16(g, acc0[i]);
      store16(u, acc1[i]);
      if constexpr (E == Epilogue::kSiluMul)
        silu_mul16(c + i * ldc, g, u);
      else
        gelu_mul16(c + i * ldc, g, u);
    }
    return;
  } else if constexpr (E == Epilogue::kSplit) {  // `cols` is the offset of the up half
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      store16(c + i * ldc, acc0[i]);
      store16(c + i * ldc + cols, acc1[i]);
    }
    return;
  }
  if (cols == kPanel) {
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      store16(c + i * ldc, acc0[i]);
      store16(c + i * ldc + 16, acc1[i]);
    }
    return;
  }
  for (int i = 0; i < MR; ++i) {  // last panel: only the real columns
    float tmp[kPanel];
    store16(tmp, acc0[i]);
    store16(tmp + 16, acc1[i]);
    std::memcpy(c + i * ldc, tmp, sizeof(float) * cols);
  }
}

#if KVFLEET_PANEL_BF16
// Rounds 16 float32 sums to bfloat16, to nearest even: the integer form of c10::BFloat16(float)
// (fused_gemma_bf16.cpp's stores), exact for subnormals too, which VCVTNEPS2BF16 flushes.
inline __m256i round_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// bf16(gelu_tanh(g) * u) for 16 columns from their float32 sums: g and u rounded to bfloat16
// as the plain GEMM stores them, gelu from the table of F.gelu's own results, the product in
// float32 rounded once: fused_gemma_bf16.cpp's gelu_tanh_and_mul on the GEMM's output, bit for
// bit.
inline void gelu_mul16_bf16(uint16_t* __restrict o, __m512 g, __m512 u, const uint16_t* table) {
  const __m512i gi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(g));
  const __m512 gelu =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(gi, table, 2), 16));
  const __m512 ur = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(u)), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), round_bf16_bits(_mm512_mul_ps(gelu, ur)));
}

// OutT uint16_t: bfloat16 out, rounded once; float: the float32 sums as they are (the LM head's
// screening pass, engine/greedy_screen.py, bounds their error and must not add a rounding).
// E: kGeluMul and kSplit as the float32 kernel's, on bfloat16 gate/up panels.
template <int MR, typename OutT, Epilogue E = Epilogue::kPlain>
inline void micro_bf16(const uint16_t* __restrict a, int64_t lda, const uint16_t* __restrict b,
                       int64_t k_len, OutT* __restrict c, int64_t ldc, int cols,
                       const Prefetch& pf) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const int64_t pairs = k_len / 2;
  int64_t countdown = 1;
  for (int64_t k = 0; k < pairs; ++k) {
    if (pf.row && --countdown == 0) {
      prefetch_row(pf.row, k * pf.row_bytes);
      countdown = pf.every;
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k * 2 * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + k * 2 * kPanel + kPanel);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * k, sizeof pair);
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], ai, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], ai, b1);
    }
  }
  if (k_len % 2) {  // odd K: the last x element pairs with the panel's zero padding
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + pairs * 2 * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + pairs * 2 * kPanel + kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(a[i * lda + k_len - 1]);
      acc0[i] = _mm512_dpbf16_ps(acc0[i], ai, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], ai, b1);
    }
  }
  if constexpr (E == Epilogue::kGeluMul) {  // a gate/up panel: 16 gate, then 16 up columns
    const uint16_t* table = kvfleet_cpu::gelu_tanh_table();
    for (int i = 0; i < MR; ++i) gelu_mul16_bf16(c + i * ldc, acc0[i], acc1[i], table);
    return;
  } else if constexpr (E == Epilogue::kSplit) {  // `cols` is the offset of the up half
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc),
                          (__m256i)_mm512_cvtneps_pbh(acc0[i]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * ldc + cols),
                          (__m256i)_mm512_cvtneps_pbh(acc1[i]));
    }
    return;
  }
  for (int i = 0; i < MR; ++i) {
    OutT tmp[kPanel];
    if constexpr (std::is_same_v<OutT, float>) {
      _mm512_storeu_ps(tmp, acc0[i]);
      _mm512_storeu_ps(tmp + 16, acc1[i]);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp), (__m256i)_mm512_cvtneps_pbh(acc0[i]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16),
                          (__m256i)_mm512_cvtneps_pbh(acc1[i]));
    }
    std::memcpy(c + i * ldc, tmp, sizeof(OutT) * cols);
  }
}
#endif

template <typename T, typename OutT = T>
using MicroFn = void (*)(const T*, int64_t, const T*, int64_t, OutT*, int64_t, int,
                         const Prefetch&);

// Work is handed out in units (a row block x a group of panels) from an atomic counter, not
// split evenly up front: when another process takes one core for a while (a router or a
// client on the same machine), the other thread keeps taking units instead of finishing its
// fixed half and then idling at the barrier (a thread holds at most one unit claimed ahead,
// for its prefetch). Units go row block by row block so x's active rows stay in cache; about
// eight units per thread per row block keep the tail short.
template <typename T, typename OutT, MicroFn<T, OutT> (*Pick)(int)>
// out_step: out columns per panel (32; 16 for gate/up panels, whose micro-kernels get
// `fixed_cols` instead of the panel's column count).
void drive(OutT* op, int64_t ldc, const T* xp, int64_t lda, const T* wp, int64_t m,
           int64_t k_len, int64_t n, int64_t panels, int64_t panel_elems,
           int64_t out_step = kPanel, int fixed_cols = -1) {
  const int64_t row_block =
      std::max<int64_t>(kMaxRows, kRowBlockBytes / (k_len * static_cast<int64_t>(sizeof(T))) /
                                      kMaxRows * kMaxRows);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t group = std::max<int64_t>(1, panels / (threads * 8));
  const int64_t groups = (panels + group - 1) / group;
  const int64_t units = (m + row_block - 1) / row_block * groups;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, units), 1, [&](int64_t, int64_t) {
    // A thread claims its next unit before working on this one, so the last panel of this
    // unit can prefetch the first panel of the unit it will really run next (with small
    // groups, "the following panel" is usually another thread's).
    int64_t u = next.fetch_add(1);
    while (u < units) {
      const int64_t u_next = next.fetch_add(1);
      const int64_t r0 = u / groups * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t p0 = u % groups * group, p1 = std::min(panels, p0 + group);
      const T* after = u_next < units ? wp + (u_next % groups * group) * panel_elems : nullptr;
      for (int64_t p = p0; p < p1; ++p) {
        const T* b = wp + p * panel_elems;
        const int cols = fixed_cols >= 0
                             ? fixed_cols
                             : static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        // The panel this thread computes next: the unit's following one, or after its last,
        // the first of the unit claimed next.
        const T* nxt = p + 1 < p1 ? b + panel_elems : after;
        const int64_t tiles = (r1 - r0 + kMaxRows - 1) / kMaxRows;
        // A k row of a panel: 32 floats, or 32 bfloat16 pairs.
        constexpr int64_t row_bytes = kPanel * sizeof(float);
        for (int64_t r = r0; r < r1; r += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, r1 - r));
          const int64_t tile = (r - r0) / kMaxRows;
          const Prefetch pf{nxt ? reinterpret_cast<const char*>(nxt) + tile * row_bytes
                                : nullptr,
                            row_bytes, tiles};
          Pick(rows)(xp + r * lda, lda, b, k_len, op + r * ldc + p * out_step, ldc, cols, pf);
        }
      }
      u = u_next;
    }
  });
}

template <Epilogue E>
MicroFn<float> pick_f32(int rows) {
  static constexpr MicroFn<float> table[kMaxRows + 1] = {
      nullptr,        micro<1, E>,  micro<2, E>,  micro<3, E>, micro<4, E>,
      micro<5, E>,    micro<6, E>,  micro<7, E>,  micro<8, E>, micro<9, E>,
      micro<10, E>,   micro<11, E>, micro<12, E>};
  return table[rows];
}

#if KVFLEET_PANEL_BF16
template <typename OutT, Epilogue E = Epilogue::kPlain>
MicroFn<uint16_t, OutT> pick_bf16(int rows) {
  static constexpr MicroFn<uint16_t, OutT> table[kMaxRows + 1] = {
      nullptr,
      micro_bf16<1, OutT, E>,
      micro_bf16<2, OutT, E>,
      micro_bf16<3, OutT, E>,
      micro_bf16<4, OutT, E>,
      micro_bf16<5, OutT, E>,
      micro_bf16<6, OutT, E>,
      micro_bf16<7, OutT, E>,
      micro_bf16<8, OutT, E>,
      micro_bf16<9, OutT, E>,
      micro_bf16<10, OutT, E>,
      micro_bf16<11, OutT, E>,
      micro_bf16<12, OutT, E>};
  return table[rows];
}
#endif

// Checks shared by both dtypes (k_rows: the packed weight's K rows); returns the panel count.
int64_t check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n,
              at::ScalarType dtype, at::ScalarType out_dtype, int64_t k_rows,
              int64_t panels_needed = -1) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3, "panel_linear: bad ranks");
  TORCH_CHECK(x.scalar_type() == dtype && packed.scalar_type() == dtype &&
                  out.scalar_type() == out_dtype,
              "panel_linear: x, packed and out do not have the op's dtypes");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k_rows && packed.is_contiguous(),
              "panel_linear: packed weight does not match x's K");
  TORCH_CHECK(panels_needed >= 0 ? panels == panels_needed
                                  : n > (panels - 1) * kPanel && n <= panels * kPanel,
              "panel_linear: N mismatch");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n && out.stride(1) == 1 &&
                  x.stride(1) == 1,
              "panel_linear: out must be [M, N] and both rows unit-stride");
  return panels;
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const int64_t k_len = x.size(1);
  const int64_t panels = check(out, x, packed, n, at::kFloat, at::kFloat, k_len);
  TORCH_CHECK(packed.size(2) == kPanel, "panel_linear: packed weight must be [P, K, 32]");
  drive<float, float, pick_f32<Epilogue::kPlain>>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0),
                         packed.data_ptr<float>(), x.size(0), k_len, n, panels,
                         k_len * kPanel);
}

// Gate/up projection on gate/up interleaved panels ([I / 16][K][32]: panel p holds gate
// columns [16 p, 16 p + 16) then up columns [16 p, 16 p + 16)), float32. act "silu" or
// "gelu_tanh": out [M, I] = act(gate) * up, the MLP's activation without the [M, 2I]
// intermediate ever reaching memory; "none": out [M, 2I] = [gate | up], what the unfused
// projection returns.
void panel_gate_up(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                   c10::string_view act) {
  const int64_t k_len = x.size(1);
  TORCH_CHECK(inter % 16 == 0, "panel_gate_up: intermediate size must be a multiple of 16");
  const bool silu = act == "silu", gelu = act == "gelu_tanh";
  TORCH_CHECK(silu || gelu || act == "none",
              "panel_gate_up: act must be 'silu', 'gelu_tanh' or 'none', got '", act, "'");
  const bool fused = silu || gelu;
  const int64_t panels = check(out, x, packed, fused ? inter : 2 * inter, at::kFloat,
                               at::kFloat, k_len, inter / 16);
  TORCH_CHECK(packed.size(2) == kPanel, "panel_gate_up: packed weight must be [I/16, K, 32]");
  float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const int64_t m = x.size(0), ldc = out.stride(0), lda = x.stride(0);
  if (silu)
    drive<float, float, pick_f32<Epilogue::kSiluMul>>(op, ldc, xp, lda, wp, m, k_len, inter,
                                                      panels, k_len * kPanel, 16);
  else if (gelu)
    drive<float, float, pick_f32<Epilogue::kGeluMul>>(op, ldc, xp, lda, wp, m, k_len, inter,
                                                      panels, k_len * kPanel, 16);
  else
    drive<float, float, pick_f32<Epilogue::kSplit>>(op, ldc, xp, lda, wp, m, k_len, 2 * inter,
                                                    panels, k_len * kPanel, 16,
                                                    static_cast<int>(inter));
}

#if KVFLEET_PANEL_BF16
uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void panel_linear_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       int64_t n) {
  const int64_t k_len = x.size(1);
  const int64_t panels = check(out, x, packed, n, at::kBFloat16, at::kBFloat16, (k_len + 1) / 2);
  TORCH_CHECK(packed.size(2) == 2 * kPanel, "panel_linear: packed weight must be [P, K/2, 64]");
  drive<uint16_t, uint16_t, pick_bf16<uint16_t>>(u16(out), out.stride(0), u16(x), x.stride(0),
                                                 u16(packed), x.size(0), k_len, n, panels,
                                                 (k_len + 1) / 2 * 2 * kPanel);
}

// panel_gate_up in bfloat16, on gate/up interleaved panels packed as panel_linear_bf16's
// ([I / 16][ceil(K / 2)][64]). act "gelu_tanh" (Gemma's GeGLU; SiLU-and-mul has no bfloat16
// epilogue yet) or "none".
void panel_gate_up_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                        int64_t inter, c10::string_view act) {
  const int64_t k_len = x.size(1);
  TORCH_CHECK(inter % 16 == 0, "panel_gate_up: intermediate size must be a multiple of 16");
  const bool gelu = act == "gelu_tanh";
  TORCH_CHECK(gelu || act == "none",
              "panel_gate_up: act must be 'gelu_tanh' or 'none' in bfloat16, got '", act, "'");
  const int64_t panels = check(out, x, packed, gelu ? inter : 2 * inter, at::kBFloat16,
                               at::kBFloat16, (k_len + 1) / 2, inter / 16);
  TORCH_CHECK(packed.size(2) == 2 * kPanel,
              "panel_gate_up: packed weight must be [I/16, K/2, 64]");
  const int64_t panel_elems = (k_len + 1) / 2 * 2 * kPanel;
  if (gelu) {
    kvfleet_cpu::gelu_tanh_table();  // built (by ATen's gelu) outside the parallel region
    drive<uint16_t, uint16_t, pick_bf16<uint16_t, Epilogue::kGeluMul>>(
        u16(out), out.stride(0), u16(x), x.stride(0), u16(packed), x.size(0), k_len, inter,
        panels, panel_elems, 16);
  } else {
    drive<uint16_t, uint16_t, pick_bf16<uint16_t, Epilogue::kSplit>>(
        u16(out), out.stride(0), u16(x), x.stride(0), u16(packed), x.size(0), k_len, 2 * inter,
        panels, panel_elems, 16, static_cast<int>(inter));
  }
}

// bfloat16 x and weight, float32 out (sums not rounded to bfloat16).
void panel_linear_bf16_f32(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                           int64_t n) {
  const int64_t k_len = x.size(1);
  const int64_t panels = check(out, x, packed, n, at::kBFloat16, at::kFloat, (k_len + 1) / 2);
  TORCH_CHECK(packed.size(2) == 2 * kPanel, "panel_linear: packed weight must be [P, K/2, 64]");
  drive<uint16_t, float, pick_bf16<float>>(out.data_ptr<float>(), out.stride(0), u16(x),
                                           x.stride(0), u16(packed), x.size(0), k_len, n,
                                           panels, (k_len + 1) / 2 * 2 * kPanel);
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("panel_gate_up(Tensor(a!) out, Tensor x, Tensor packed, int inter, str act) -> ()");
#if KVFLEET_PANEL_BF16
  m.def("panel_linear_bf16(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("panel_linear_bf16_f32(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("panel_gate_up_bf16(Tensor(a!) out, Tensor x, Tensor packed, int inter, str act) -> ()");
#endif
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_gate_up", &panel_gate_up);
#if KVFLEET_PANEL_BF16
  m.impl("panel_linear_bf16", &panel_linear_bf16);
  m.impl("panel_linear_bf16_f32", &panel_linear_bf16_f32);
  m.impl("panel_gate_up_bf16", &panel_gate_up_bf16);
#endif
}
