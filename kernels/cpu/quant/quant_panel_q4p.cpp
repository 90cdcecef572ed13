// The panel-ordered Q4 ops (engine/quant/qlinear.py's PANEL_Q4P path): `quant_q4_panel_pack`
// re-lays a Q4_0 / Q4_1 weight at load into quant_panel_q4p.h's layout (same bytes as the
// GGUF rows, the last panel zero-padded), `quant_linear_q4p` multiplies bfloat16 x by it, each line
// decoded inside the micro-kernel; the start-up plan times it against the other paths
// (engine/quant/select.py). Built only with AVX512_BF16 and AVX512_VBMI
// (quant_has_q4_panel_packed); elsewhere the ops refuse and the plan never picks the path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"
#include "quant_panel.h"
#include "quant_panel_q4p.h"

namespace {

using namespace kvfleet::quant;

bool quant_has_q4_panel_packed() {
#ifdef KVFLEET_Q4_PANEL_FACTORED
  return true;
#else
  return false;
#endif
}

void check_q4(int64_t qtype, const char* op) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, op, ": qtype must be Q4_0 or Q4_1, got ", qtype);
}

// w [N, row bytes] uint8 of Q4_0 / Q4_1 -> the packed panels, uint8 [ceil(N / 32) * 32,
// row bytes] (viewed as rows only for its size: the bytes are panel-ordered).
at::Tensor quant_q4_panel_pack(const at::Tensor& w, int64_t qtype) {
  check_q4(qtype, "quant_q4_panel_pack");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "quant_q4_panel_pack: w must be contiguous uint8 [N, row bytes]");
  const int64_t n = w.size(0), row_bytes = w.size(1), bb = block_bytes(qtype);
  TORCH_CHECK(row_bytes % bb == 0, "quant_q4_panel_pack: row bytes must be whole blocks");
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows, nb = row_bytes / bb;
  at::Tensor packed = at::zeros({panels * kPanelRows, row_bytes}, w.options());
#ifdef KVFLEET_Q4_PANEL_FACTORED
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = kPanelRows * row_bytes;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t r0 = p0 * kPanelRows, r1 = std::min(n, p1 * kPanelRows);
    if (qtype == kQ4_1)
      q4p_pack<kQ4_1>(src + r0 * row_bytes, r1 - r0, nb, dst + p0 * panel_bytes);
    else
      q4p_pack<kQ4_0>(src + r0 * row_bytes, r1 - r0, nb, dst + p0 * panel_bytes);
  });
#else
  TORCH_CHECK(false, "quant_q4_panel_pack: not built (needs AVX512_BF16 and AVX512_VBMI)");
#endif
  return packed;
}

// out [M, N] bfloat16 = x [M, K] bfloat16 @ W^T, W given as quant_q4_panel_pack's `packed`
// (N = out's columns; out may be a column slice of a wider output).
void quant_linear_q4p(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      int64_t qtype) {
  check_q4(qtype, "quant_linear_q4p");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "quant_linear_q4p: x must be bfloat16 [M, K], unit column stride");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "quant_linear_q4p: out must be bfloat16 [M, N], unit column stride");
  const int64_t m_rows = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(k % kBlock == 0, "quant_linear_q4p: K must be a multiple of 32");
  const int64_t nb = k / kBlock, row_bytes = nb * block_bytes(qtype);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == panels * kPanelRows * row_bytes,
              "quant_linear_q4p: packed must be quant_q4_panel_pack's output for N = ", n,
              ", K = ", k);
#ifdef KVFLEET_Q4_PANEL_FACTORED
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  std::vector<float> sx(m_rows * nb);
  q4f_block_sums(xp, ldx, m_rows, nb, sx.data());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = p0 * kPanelRows, n1 = std::min(n, p1 * kPanelRows);
    if (qtype == kQ4_1)
      panels_q4p<kQ4_1>(xp, ldx, sx.data(), m_rows, wp, row_bytes, nb, n0, n1, op, ldo);
    else
      panels_q4p<kQ4_0>(xp, ldx, sx.data(), m_rows, wp, row_bytes, nb, n0, n1, op, ldo);
  });
#else
  TORCH_CHECK(false, "quant_linear_q4p: not built (needs AVX512_BF16 and AVX512_VBMI)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_quant, m) {
  m.def("quant_q4_panel_pack(Tensor w, int qtype) -> Tensor");
  m.def("quant_linear_q4p(Tensor(a!) out, Tensor x, Tensor packed, int qtype) -> ()");
  m.def("quant_has_q4_panel_packed() -> bool");
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CPU, m) {
  m.impl("quant_q4_panel_pack", &quant_q4_panel_pack);
  m.impl("quant_linear_q4p", &quant_linear_q4p);
}

TORCH_LIBRARY_IMPL(kvfleet_quant, CompositeExplicitAutograd, m) {
  m.impl("quant_has_q4_panel_packed", &quant_has_q4_panel_packed);
}
