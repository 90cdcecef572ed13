// bfloat16 linear layer on Intel AMX tiles: out[M, N] = x[M, K] @ W[N, K]^T, out bfloat16
// (rounded once) or float32 (the sums as they are, for the screened greedy LM head).
//
// Why: on a CPU with AMX one TDPBF16PS does a 16x16x32 block (16,384 FLOPs) every 16 cycles,
// eight times the float32 FMA rate, so a decode-sized GEMM (16-64 rows) is bound by reading its
// weight from DRAM alone. oneDNN ran SmolLM2's decode projections at 2-3x that bound here (an
// Intel Xeon with AMX, 32 rows: gate/up 0.33-0.58 ms for 3.5 MB of weight); this kernel streams
// the weight once, in order, 1 KiB tiles one after another, which the hardware prefetcher follows
// (software prefetch of the next panel, as panel_linear.cpp does, measured 10-30% slower here:
// 30 SmolLM2 layers at 32 rows from DRAM 13.2-13.5 ms without it, 13.5-18.7 with it; only the
// next k step's tiles are prefetched, into L1, where two row blocks share them). The engine
// uses it only where start-up measurement finds it faster (engine/models/gemm_select.py).
//
// Packed weight (engine/models/linear.py, pack_amx): [P][Kp / 32][2][16][32] bfloat16 with K
// padded to Kp, a multiple of 32: per panel of 32 columns and k step of 32, the B tile of
// columns 0-15 then that of columns 16-31, each 16 k pairs x 16 columns x 2 (VNNI order), one
// contiguous 1 KiB.
//
// Micro-kernel: 32 rows x 32 columns in four float32 C tiles (tmm0-3), two A tiles of 16 rows
// x 32 k (tmm4-5, loaded from x in place, rows at x's stride) and two B tiles (tmm6-7). Every
// tile is full: the rows of a last partial 16-row block come from a zero-padded copy, and a K
// that is not a multiple of 32 takes a zero-padded copy of x.
//
// Numerics: each product of two bfloat16 values is exact in float32 and the sums are float32
// (TDPBF16PS, denormal inputs and outputs flushed to zero, like VDPBF16PS); the order of the
// sums differs from oneDNN's, so bfloat16 results differ in the last bit now and then.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVFLEET_AMX 1
#endif

namespace {

#if KVFLEET_AMX

constexpr int kPanel = 32;
constexpr int kTileK = 32;                   // k per tile step (16 pairs)
constexpr int64_t kTileElems = 16 * 32;      // bf16 elements of one 1 KiB tile
// Rows of x per work unit: its A tiles stay in L2 while the unit's panels pass over them.
constexpr int64_t kUnitRows = 256;

// Linux hands out the AMX tile state only on request: the permission is process-wide (every
// thread, the OpenMP workers included) and re-requesting it is harmless.
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;  // C: 16 floats; A: 32 bf16; B: 16 pairs of bf16
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

template <typename OutT>
inline void store_rows(const float* c, OutT* out, int64_t ldc, int rows, int cols) {
  for (int r = 0; r < rows; ++r) {
    const float* src = c + r * kPanel;
    OutT* dst = out + r * ldc;
    if constexpr (std::is_same_v<OutT, float>) {
      std::memcpy(dst, src, sizeof(float) * cols);
    } else {
      uint16_t tmp[kPanel];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + 16)));
      std::memcpy(dst, tmp, sizeof(uint16_t) * cols);
    }
  }
}

// A 16-row block of x as AMX reads it: `rows` at `stride_bytes` apart, k contiguous.
struct ABlock {
  const char* rows;
  int64_t stride_bytes;
};

// 32 (two_blocks) or 16 rows of x against one panel, all of K; C tiles to `c` [32][32] floats.
// `b`: the panel ([k step][half][16][32], contiguous 1 KiB tiles).
template <bool two_blocks>
inline void micro(ABlock a0, ABlock a1, const uint16_t* b, int64_t k_steps, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (two_blocks) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_steps; ++kb) {
    const uint16_t* bk = b + kb * kTileElems * 2;
    if constexpr (two_blocks) {
      // The next k step's two B tiles into L1: with four TDPs per step the tile loads' latency
      // from L2 shows (no tile renaming); one step ahead took 32 rows x 30 SmolLM2 layers from
      // DRAM 7-19% faster in a C microbenchmark. 16 rows stream at DRAM speed without it.
      const char* ahead = reinterpret_cast<const char*>(bk + 2 * kTileElems);
#pragma GCC unroll 32
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    }
    _tile_loadd(4, a0.rows + kb * kTileK * 2, a0.stride_bytes);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bk + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (two_blocks) {
      _tile_loadd(5, a1.rows + kb * kTileK * 2, a1.stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int ldc_bytes = kPanel * 4;
  _tile_stored(0, c, ldc_bytes);
  _tile_stored(1, c + 16, ldc_bytes);
  if constexpr (two_blocks) {
    _tile_stored(2, c + 16 * kPanel, ldc_bytes);
    _tile_stored(3, c + 16 * kPanel + 16, ldc_bytes);
  }
}

// Units (a block of rows x a group of panels) come from an atomic counter, as in
// panel_linear.cpp's drive: a thread that loses its core for a while does not hold the other
// at the barrier with a fixed half of the work. Full 16-row blocks of A are read from x in
// place; a last partial block (M % 16 rows) from a zero-padded copy, `tail`.
template <typename OutT>
void drive(OutT* out, int64_t ldc, const uint16_t* x, int64_t lda, const uint16_t* tail,
           int64_t m, const uint16_t* w, int64_t k_pad, int64_t n, int64_t panels) {
  const int64_t panel_elems = k_pad / 2 * 2 * kPanel;
  const int64_t k_steps = k_pad / kTileK;
  const int64_t m_pad = (m + 15) / 16 * 16;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t group = std::max<int64_t>(1, panels / (threads * 8));
  const int64_t groups = (panels + group - 1) / group;
  const int64_t row_units = (m_pad + kUnitRows - 1) / kUnitRows;
  const int64_t units = row_units * groups;
  const int64_t full_blocks = m / 16;
  auto block = [&](int64_t r) -> ABlock {
    if (r / 16 < full_blocks)
      return {reinterpret_cast<const char*>(x + r * lda), lda * 2};
    return {reinterpret_cast<const char*>(tail), k_pad * 2};
  };
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min(threads, units), 1, [&](int64_t, int64_t) {
    configure_tiles();
    alignas(64) float c[2 * 16 * kPanel];
    for (int64_t u = next_unit.fetch_add(1); u < units; u = next_unit.fetch_add(1)) {
      const int64_t r0 = u / groups * kUnitRows, r1 = std::min(m_pad, r0 + kUnitRows);
      const int64_t p0 = u % groups * group, p1 = std::min(panels, p0 + group);
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* b = w + p * panel_elems;
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        for (int64_t r = r0; r < r1; r += 32) {
          const int valid = static_cast<int>(std::min<int64_t>(32, m - r));
          if (r + 32 <= r1)
            micro<true>(block(r), block(r + 16), b, k_steps, c);
          else
            micro<false>(block(r), block(r), b, k_steps, c);
          store_rows<OutT>(c, out + r * ldc + p * kPanel, ldc, valid, cols);
        }
      }
    }
    _tile_release();
  });
}

uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

template <typename OutT>
void amx_linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     at::ScalarType out_dtype) {
  TORCH_CHECK(request_amx(), "amx_linear: the kernel did not grant AMX tile state");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 3, "amx_linear: bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == out_dtype,
              "amx_linear: x and packed must be bfloat16, out of the op's dtype");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const int64_t k_pad = packed.size(1) * 2;
  TORCH_CHECK(packed.is_contiguous() && packed.size(2) == 2 * kPanel && k_pad % kTileK == 0 &&
                  k <= k_pad && k_pad - k < kTileK,
              "amx_linear: packed weight must be [P, Kp / 2, 64] with Kp = K padded to 32");
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "amx_linear: N mismatch");
  TORCH_CHECK(out.size(0) == m && out.size(1) == n && out.stride(1) == 1 && x.stride(1) == 1,
              "amx_linear: out must be [M, N] and both rows unit-stride");
  if (m == 0) return;
  // Whole tiles only: a K that is not a multiple of 32 takes a zero-padded copy of x; the
  // rows of a partial last 16-row block are copied into a zero-padded block of their own.
  at::Tensor a = x;
  if (k_pad != k) {
    a = at::zeros({m, k_pad}, x.options());
    a.narrow(1, 0, k).copy_(x);
  }
  const int64_t full = m / 16 * 16;
  at::Tensor tail;
  if (full != m) {
    tail = at::zeros({16, k_pad}, x.options());
    tail.narrow(0, 0, m - full).copy_(a.narrow(0, full, m - full));
  }
  drive<OutT>(reinterpret_cast<OutT*>(out.data_ptr()), out.stride(0), u16(a), a.stride(0),
              full != m ? u16(tail) : nullptr, m, u16(packed), k_pad, n, panels);
}

void amx_linear_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  amx_linear_impl<uint16_t>(out, x, packed, n, at::kBFloat16);
}

void amx_linear_bf16_f32(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                         int64_t n) {
  amx_linear_impl<float>(out, x, packed, n, at::kFloat);
}

#endif

}  // namespace

#if KVFLEET_AMX
TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("amx_linear_bf16(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
  m.def("amx_linear_bf16_f32(Tensor(a!) out, Tensor x, Tensor packed, int n) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("amx_linear_bf16", &amx_linear_bf16);
  m.impl("amx_linear_bf16_f32", &amx_linear_bf16_f32);
}
#endif
