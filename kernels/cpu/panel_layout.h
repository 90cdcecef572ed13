// The packed-panel weight geometry shared by the panel GEMM (panel_linear.cpp) and the fused
// MoE kernel on packed experts (fused_moe_panel.cpp); engine/models/linear.py and
// engine/models/moe.py pack weights to match it.
//
// A panel holds 32 output columns, one 32-float row per k (zero-padded past N); the
// micro-kernels keep up to 12 rows x 32 columns of out in 24 vector accumulators; rows of x are
// processed in blocks of about 512 KiB so that they stay in L2 beside the panel they pass over.
// Changing any of these changes the packed layout for both kernels and both packers at once.
#pragma once

#include <cstdint>

#include "simd.h"

namespace kvfleet_panel {

using kvfleet::bcast;
using kvfleet::load16;
using kvfleet::store16;
using kvfleet::v16;

constexpr int kPanel = 32;
constexpr int kMaxRows = 12;
constexpr int64_t kRowBlockBytes = 512 * 1024;

}  // namespace kvfleet_panel
