// The c10d and ATen names that differ between the torch releases this extension supports
// (docs/compatibility.md). Every version-dependent spelling lives here, behind
// SMDDP_TORCH_AT_LEAST, so that a new torch release is ported in one file.
#pragma once

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/Types.hpp>

// True when the torch these headers come from is major.minor or newer.
#define SMDDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||        \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace smddp {
namespace compat {

// The PREMUL_SUM factor of a ReduceOp. Checked on: 2.11 (only NCCLPreMulSumSupplement),
// 2.13 (PreMulSumSupplement, the old name kept as an alias).
#if SMDDP_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

}  // namespace compat
}  // namespace smddp
