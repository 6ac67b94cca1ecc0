#include "smddp/algorithms/kernels.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2: part of every x86-64 CPU
#endif

// Clones for x86-64; other architectures get one generic build, and so does a ThreadSanitizer
// build: the clones' ifunc resolvers run while the program is being loaded, before the TSan
// runtime is initialised, and their instrumented entry crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define SMDDP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SMDDP_CLONES
#endif
#define SMDDP_INLINE inline __attribute__((always_inline))

namespace smddp {
namespace {

constexpr size_t kBlock = 256;  // elements per inner block (accumulator stays in L1)

struct bf16_t {
  uint16_t x;
};
struct f16_t {
  uint16_t x;
};

SMDDP_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
SMDDP_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16 <-> fp32. Rounds to nearest even; NaN stays a quiet NaN.
SMDDP_INLINE float load_f(bf16_t v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
SMDDP_INLINE bf16_t store_f(float f, bf16_t*) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return bf16_t{static_cast<uint16_t>(nan ? 0x7fc0u : rounded)};
}

// fp16 <-> fp32 with integer/float tricks that vectorize without F16C; subnormals,
// infinities and NaN are handled; rounds to nearest even.
SMDDP_INLINE float load_f(f16_t v) {
  uint32_t h = v.x;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  float scaled = bits_to_float(em << 13) * 0x1p112f;  // rebias normal and subnormal values
  uint32_t bits = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : float_to_bits(scaled);
  return bits_to_float(bits | sign);
}
SMDDP_INLINE f16_t store_f(float f, f16_t*) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // Subnormal results: let the FPU round by adding a magic number.
  const uint32_t denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23;
  uint32_t sub = float_to_bits(bits_to_float(u) + bits_to_float(denorm_magic)) - denorm_magic;
  // Normal results: rebias the exponent and round to nearest even on the dropped bits.
  uint32_t odd = (u >> 13) & 1u;
  uint32_t norm = (u + ((15u - 127u) << 23) + 0xfffu + odd) >> 13;
  uint32_t big = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  uint32_t o = u >= 0x47800000u ? big : (u < 0x38800000u ? sub : norm);
  return f16_t{static_cast<uint16_t>(o | (sign >> 16))};
}

template <typename T>
SMDDP_INLINE T load_f(T v) {
  return v;
}
template <typename T>
SMDDP_INLINE T store_f(T v, T*) {
  return v;
}

enum Kind { kSum, kProd, kMin, kMax, kAnd, kOr, kXor };

template <Kind K, typename A>
SMDDP_INLINE A combine(A a, A b) {
  if constexpr (K == kSum) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;  // wrap-around instead of signed-overflow UB
      return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  } else if constexpr (K == kProd) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  } else if constexpr (K == kMin) {
    return b < a ? b : a;
  } else if constexpr (K == kMax) {
    return b > a ? b : a;
  } else if constexpr (K == kAnd) {
    return a & b;
  } else if constexpr (K == kOr) {
    return a | b;
  } else {
    return a ^ b;
  }
}

// Two sources (every reduction of a 2-rank group): one fused pass, no accumulator.
template <Kind K, typename In, typename Out, typename A>
SMDDP_INLINE void reduce_pair(Out* dst, const In* a, const In* b, size_t n, bool divide,
                              A divisor) {
  if (divide) {
    for (size_t j = 0; j < n; ++j) {
      A v = combine<K, A>(static_cast<A>(load_f(a[j])), static_cast<A>(load_f(b[j])));
      dst[j] = store_f(static_cast<A>(v / divisor), static_cast<Out*>(nullptr));
    }
  } else {
    for (size_t j = 0; j < n; ++j) {
      A v = combine<K, A>(static_cast<A>(load_f(a[j])), static_cast<A>(load_f(b[j])));
      dst[j] = store_f(v, static_cast<Out*>(nullptr));
    }
  }
}

// The blocked loop: the accumulator for kBlock elements lives on the stack.
template <Kind K, typename In, typename Out, typename A>
SMDDP_INLINE void reduce_loop(Out* dst, const In* const* srcs, int nsrc, size_t n, bool divide,
                              A divisor) {
  if (nsrc == 2) return reduce_pair<K, In, Out, A>(dst, srcs[0], srcs[1], n, divide, divisor);
  A acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = n - base < kBlock ? n - base : kBlock;
    const In* s0 = srcs[0] + base;
    for (size_t j = 0; j < m; ++j) acc[j] = static_cast<A>(load_f(s0[j]));
    for (int k = 1; k < nsrc; ++k) {
      const In* s = srcs[k] + base;
      for (size_t j = 0; j < m; ++j) acc[j] = combine<K, A>(acc[j], static_cast<A>(load_f(s[j])));
    }
    if (divide) {
      for (size_t j = 0; j < m; ++j) acc[j] = acc[j] / divisor;
    }
    Out* d = dst + base;
    for (size_t j = 0; j < m; ++j) d[j] = store_f(acc[j], static_cast<Out*>(nullptr));
  }
}

template <typename In, typename Out, typename A>
SMDDP_INLINE void reduce_arith(void* dst, const void* const* srcs, int nsrc, size_t n, RedOp op,
                               bool divide, A divisor) {
  auto* d = static_cast<Out*>(dst);
  auto* s = reinterpret_cast<const In* const*>(srcs);
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
      return reduce_loop<kSum, In, Out, A>(d, s, nsrc, n, divide, divisor);
    case RedOp::PRODUCT:
      return reduce_loop<kProd, In, Out, A>(d, s, nsrc, n, false, divisor);
    case RedOp::MIN:
      return reduce_loop<kMin, In, Out, A>(d, s, nsrc, n, false, divisor);
    case RedOp::MAX:
      return reduce_loop<kMax, In, Out, A>(d, s, nsrc, n, false, divisor);
    default:
      break;
  }
  if constexpr (std::is_integral_v<A>) {
    switch (op) {
      case RedOp::BAND:
        return reduce_loop<kAnd, In, Out, A>(d, s, nsrc, n, false, divisor);
      case RedOp::BOR:
        return reduce_loop<kOr, In, Out, A>(d, s, nsrc, n, false, divisor);
      case RedOp::BXOR:
        return reduce_loop<kXor, In, Out, A>(d, s, nsrc, n, false, divisor);
      default:
        break;
    }
  }
  SMDDP_CHECK_VALUE(false, "smddp: unsupported reduce op");
}

// One multiversioned entry point per element type (the op switch lives inside, so each
// clone carries its own vectorized loops).
SMDDP_CLONES void k_f32(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                        int dv) {
  reduce_arith<float, float, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_f64(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                        int dv) {
  reduce_arith<double, double, double>(d, s, k, n, op, fin, static_cast<double>(dv));
}
SMDDP_CLONES void k_bf16(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                         int dv) {
  reduce_arith<bf16_t, bf16_t, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_bf16_acc(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                             int dv) {  // bf16 inputs -> fp32 partial
  reduce_arith<bf16_t, float, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_acc_bf16(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                             int dv) {  // fp32 partials -> bf16 result
  reduce_arith<float, bf16_t, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_f16(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                        int dv) {
  reduce_arith<f16_t, f16_t, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_f16_acc(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                            int dv) {
  reduce_arith<f16_t, float, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_acc_f16(void* d, const void* const* s, int k, size_t n, RedOp op, bool fin,
                            int dv) {
  reduce_arith<float, f16_t, float>(d, s, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void k_i8(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  reduce_arith<int8_t, int8_t, int8_t>(d, s, k, n, op, false, 1);
}
SMDDP_CLONES void k_u8(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  reduce_arith<uint8_t, uint8_t, uint8_t>(d, s, k, n, op, false, 1);
}
SMDDP_CLONES void k_i16(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  reduce_arith<int16_t, int16_t, int16_t>(d, s, k, n, op, false, 1);
}
SMDDP_CLONES void k_i32(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  reduce_arith<int32_t, int32_t, int32_t>(d, s, k, n, op, false, 1);
}
SMDDP_CLONES void k_i64(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  reduce_arith<int64_t, int64_t, int64_t>(d, s, k, n, op, false, 1);
}

// bool: SUM/MAX/BOR are logical or, PRODUCT/MIN/BAND logical and, BXOR exclusive or, so
// the result stays 0/1.
SMDDP_CLONES void k_bool(void* d, const void* const* s, int k, size_t n, RedOp op, bool, int) {
  RedOp mapped = RedOp::BXOR;
  if (op == RedOp::SUM || op == RedOp::MAX || op == RedOp::BOR) mapped = RedOp::BOR;
  if (op == RedOp::PRODUCT || op == RedOp::MIN || op == RedOp::BAND) mapped = RedOp::BAND;
  reduce_arith<uint8_t, uint8_t, uint8_t>(d, s, k, n, mapped, false, 1);
}

// Sources of two element types (Note [Half precision on the wire] in net_algorithm.h): source
// k holds H elements where half[k], else fp32; accumulated in fp32 in source order. The type
// test sits outside the element loops, so each loop stays one type and vectorizes.
template <Kind K, typename H, typename Out>
SMDDP_INLINE void mixed_loop(Out* dst, const void* const* srcs, const uint8_t* half, int nsrc,
                             size_t n, bool divide, float divisor) {
  float acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = n - base < kBlock ? n - base : kBlock;
    for (int k = 0; k < nsrc; ++k) {
      if (half[k]) {
        const H* s = static_cast<const H*>(srcs[k]) + base;
        if (k == 0) {
          for (size_t j = 0; j < m; ++j) acc[j] = load_f(s[j]);
        } else {
          for (size_t j = 0; j < m; ++j) acc[j] = combine<K, float>(acc[j], load_f(s[j]));
        }
      } else {
        const float* s = static_cast<const float*>(srcs[k]) + base;
        if (k == 0) {
          for (size_t j = 0; j < m; ++j) acc[j] = s[j];
        } else {
          for (size_t j = 0; j < m; ++j) acc[j] = combine<K, float>(acc[j], s[j]);
        }
      }
    }
    if (divide) {
      for (size_t j = 0; j < m; ++j) acc[j] = acc[j] / divisor;
    }
    Out* d = dst + base;
    for (size_t j = 0; j < m; ++j) d[j] = store_f(acc[j], static_cast<Out*>(nullptr));
  }
}

template <typename H, typename Out>
SMDDP_INLINE void reduce_mixed_arith(void* dst, const void* const* srcs, const uint8_t* half,
                                     int nsrc, size_t n, RedOp op, bool divide, float divisor) {
  auto* d = static_cast<Out*>(dst);
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
    case RedOp::PREMUL_SUM:
      return mixed_loop<kSum, H, Out>(d, srcs, half, nsrc, n, divide, divisor);
    case RedOp::PRODUCT:
      return mixed_loop<kProd, H, Out>(d, srcs, half, nsrc, n, false, divisor);
    case RedOp::MIN:
      return mixed_loop<kMin, H, Out>(d, srcs, half, nsrc, n, false, divisor);
    case RedOp::MAX:
      return mixed_loop<kMax, H, Out>(d, srcs, half, nsrc, n, false, divisor);
    default:
      break;
  }
  SMDDP_CHECK_VALUE(false, "smddp: unsupported reduce op for mixed sources");
}

SMDDP_CLONES void km_bf16(void* d, const void* const* s, const uint8_t* h, int k, size_t n,
                          RedOp op, bool fin, int dv) {  // -> bf16
  reduce_mixed_arith<bf16_t, bf16_t>(d, s, h, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void km_bf16_acc(void* d, const void* const* s, const uint8_t* h, int k, size_t n,
                              RedOp op, bool fin, int dv) {  // -> fp32
  reduce_mixed_arith<bf16_t, float>(d, s, h, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void km_f16(void* d, const void* const* s, const uint8_t* h, int k, size_t n, RedOp op,
                         bool fin, int dv) {
  reduce_mixed_arith<f16_t, f16_t>(d, s, h, k, n, op, fin, static_cast<float>(dv));
}
SMDDP_CLONES void km_f16_acc(void* d, const void* const* s, const uint8_t* h, int k, size_t n,
                             RedOp op, bool fin, int dv) {
  reduce_mixed_arith<f16_t, float>(d, s, h, k, n, op, fin, static_cast<float>(dv));
}

template <typename T>
SMDDP_INLINE void scale_loop(T* d, const T* s, size_t n, float f) {
  for (size_t i = 0; i < n; ++i) d[i] = store_f(load_f(s[i]) * f, static_cast<T*>(nullptr));
}
SMDDP_CLONES void scale_f32(void* d, const void* s, size_t n, double f) {
  scale_loop(static_cast<float*>(d), static_cast<const float*>(s), n, static_cast<float>(f));
}
SMDDP_CLONES void scale_f64(void* d, const void* s, size_t n, double f) {
  auto* dd = static_cast<double*>(d);
  auto* ss = static_cast<const double*>(s);
  for (size_t i = 0; i < n; ++i) dd[i] = ss[i] * f;
}
SMDDP_CLONES void scale_bf16(void* d, const void* s, size_t n, double f) {
  scale_loop(static_cast<bf16_t*>(d), static_cast<const bf16_t*>(s), n, static_cast<float>(f));
}
SMDDP_CLONES void scale_f16(void* d, const void* s, size_t n, double f) {
  scale_loop(static_cast<f16_t*>(d), static_cast<const f16_t*>(s), n, static_cast<float>(f));
}

}  // namespace

void reduce(DType in_t, DType out_t, void* dst, const void* const* srcs, int nsrc, size_t n,
            const Reduction& red, bool finish) {
  if (n == 0) return;
  bool div = finish && red.op == RedOp::AVG;
  int dv = red.divisor;
  const RedOp op = red.op;
  switch (red.dtype) {
    case DType::F32:
      return k_f32(dst, srcs, nsrc, n, op, div, dv);
    case DType::F64:
      return k_f64(dst, srcs, nsrc, n, op, div, dv);
    case DType::BF16:
      if (in_t == DType::BF16 && out_t == DType::BF16)
        return k_bf16(dst, srcs, nsrc, n, op, div, dv);
      if (in_t == DType::BF16) return k_bf16_acc(dst, srcs, nsrc, n, op, div, dv);
      if (out_t == DType::BF16) return k_acc_bf16(dst, srcs, nsrc, n, op, div, dv);
      return k_f32(dst, srcs, nsrc, n, op, div, dv);
    case DType::F16:
      if (in_t == DType::F16 && out_t == DType::F16) return k_f16(dst, srcs, nsrc, n, op, div, dv);
      if (in_t == DType::F16) return k_f16_acc(dst, srcs, nsrc, n, op, div, dv);
      if (out_t == DType::F16) return k_acc_f16(dst, srcs, nsrc, n, op, div, dv);
      return k_f32(dst, srcs, nsrc, n, op, div, dv);
    case DType::I8:
      return k_i8(dst, srcs, nsrc, n, op, div, dv);
    case DType::U8:
      return k_u8(dst, srcs, nsrc, n, op, div, dv);
    case DType::I16:
      return k_i16(dst, srcs, nsrc, n, op, div, dv);
    case DType::I32:
      return k_i32(dst, srcs, nsrc, n, op, div, dv);
    case DType::I64:
      return k_i64(dst, srcs, nsrc, n, op, div, dv);
    case DType::BOOL:
      return k_bool(dst, srcs, nsrc, n, op, div, dv);
  }
  SMDDP_CHECK_VALUE(false, "smddp: no reduction kernel from ", dtype_name(in_t), " to ",
                    dtype_name(out_t));
}

void reduce_mixed(const std::vector<DType>& types, DType out_t, void* dst, const void* const* srcs,
                  size_t n, const Reduction& red, bool finish) {
  const int nsrc = static_cast<int>(types.size());
  bool same = true;
  for (DType t : types) same = same && t == types[0];
  if (same) return reduce(types[0], out_t, dst, srcs, nsrc, n, red, finish);
  if (n == 0) return;
  const DType half_t = red.dtype, acc = acc_type(red.dtype);
  SMDDP_CHECK_VALUE(half_t != acc && (out_t == half_t || out_t == acc),
                    "smddp: mixed reduction sources for ", dtype_name(red.dtype), " (a bug)");
  std::vector<uint8_t> half(static_cast<size_t>(nsrc));
  for (int k = 0; k < nsrc; ++k) {
    SMDDP_CHECK_VALUE(types[k] == half_t || types[k] == acc, "smddp: a reduction source of ",
                      dtype_name(types[k]), " in a ", dtype_name(red.dtype), " reduction (a bug)");
    half[k] = types[k] == half_t;
  }
  const bool div = finish && red.op == RedOp::AVG;
  if (half_t == DType::BF16) {
    return out_t == half_t ? km_bf16(dst, srcs, half.data(), nsrc, n, red.op, div, red.divisor)
                           : km_bf16_acc(dst, srcs, half.data(), nsrc, n, red.op, div, red.divisor);
  }
  return out_t == half_t ? km_f16(dst, srcs, half.data(), nsrc, n, red.op, div, red.divisor)
                         : km_f16_acc(dst, srcs, half.data(), nsrc, n, red.op, div, red.divisor);
}

void scale_copy(DType t, void* dst, const void* src, size_t n, double scale) {
  switch (t) {
    case DType::F32:
      return scale_f32(dst, src, n, scale);
    case DType::F64:
      return scale_f64(dst, src, n, scale);
    case DType::BF16:
      return scale_bf16(dst, src, n, scale);
    case DType::F16:
      return scale_f16(dst, src, n, scale);
    default:
      SMDDP_CHECK_VALUE(false, "smddp: cannot scale ", dtype_name(t), " tensors");
  }
}

void copy_streaming(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (bytes < 1024) {  // not worth a fence
    std::memcpy(d, s, bytes);
    return;
  }
  // Ordinary stores up to a 16-byte boundary of dst, 64 bytes per iteration of streaming
  // stores (one cache line, so lines are written whole), ordinary stores for the tail.
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t body = bytes & ~static_cast<size_t>(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, bytes - body);
  // Streaming stores are weakly ordered: make them visible before anything that follows
  // (e.g. posting progress that lets a peer read this buffer).
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

const char* kernel_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "x86-64";
#else
  return "generic";
#endif
}

}  // namespace smddp
