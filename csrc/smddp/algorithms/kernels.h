// Element-wise reduction kernels with runtime CPU dispatch.
//
// Each entry point is compiled three times (AVX-512, AVX2+F16C+FMA, baseline x86-64)
// through GCC function multiversioning; the loader picks the best clone for the CPU the
// process runs on, so a machine without AVX-512 still works. Inner loops are written over
// fixed-size blocks so the compiler vectorizes them.
#pragma once

#include <vector>

#include "smddp/common/common.h"

namespace smddp {

// dst[i] = finish(src[0][i] (op) src[1][i] (op) ... (op) src[nsrc-1][i]) for i < n, combining
// the sources strictly in the order given (so every rank that reduces the same inputs gets
// bit-identical results).
//   in_t  : element type of the sources (the reduction dtype, or its accumulation type for
//           partial results that come from another stage)
//   out_t : element type of dst (same choice)
//   finish: when true, AVG divides by red.divisor; otherwise dst holds a partial result.
// bf16/fp16 are accumulated in fp32 and rounded once (round to nearest even) when stored.
// dst may alias one of the sources (same element index only).
void reduce(DType in_t, DType out_t, void* dst, const void* const* srcs, int nsrc, size_t n,
            const Reduction& red, bool finish);

// As reduce, for a bf16/fp16 reduction whose sources differ in type: source k holds
// elements of types[k], red.dtype or acc_type(red.dtype) (Note [Half precision on the wire]
// in net_algorithm.h). Accumulates in fp32, in source order, and rounds once where it stores
// into `out_t` (either type). Sources of one type take reduce().
void reduce_mixed(const std::vector<DType>& types, DType out_t, void* dst, const void* const* srcs,
                  size_t n, const Reduction& red, bool finish);

// dst[i] = src[i] * scale (in the element type; bf16/fp16 via fp32). Floating types only.
void scale_copy(DType t, void* dst, const void* src, size_t n, double scale);

// memcpy with non-temporal (cache-bypassing) stores for the aligned body, then a store
// fence. For copies into buffers that will not be read again soon and that together exceed
// the cache: an ordinary store first reads the destination line into the cache (a third
// memory pass) and evicts data that is still needed; a streaming store does neither.
// Measured on these machines: a 16 MiB chunked copy by each of 4 processes on 2 cores,
// 3.3 ms -> 2.1 ms. Plain memcpy on CPUs without SSE2 streaming stores.
void copy_streaming(void* dst, const void* src, size_t bytes);

// Name of the instruction set the kernels were dispatched to on this CPU ("avx512", ...).
const char* kernel_isa();

}  // namespace smddp
