// Test data for the collectives: deterministic inputs per rank and the results computed
// here, independently of the kernels, for exact comparison.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "smddp/common/common.h"

namespace smddp_test {

using Bytes = std::vector<char>;

// Input element k of `rank` for the call numbered `salt`: integers in [-40, 40] for
// floating types, so that every sum of up to 6 of them is an integer below 2^8 in magnitude,
// exact in bf16: the reduction order cannot matter, nor can the rounding of a host's partial
// or a ring's running sum to bf16 between hosts (Note [Half precision on the wire] in
// net_algorithm.h; the precision itself is measured in test_smddp_net_precision.py). Values
// above 2^40 for int64.
inline double float_value(int rank, size_t k, int salt) {
  return static_cast<double>(static_cast<int64_t>((rank * 37 + (k + salt) * 11) % 81) - 40);
}
inline int64_t int_value(int rank, size_t k, int salt) {
  return (int64_t(rank + 1) << 40) +
         static_cast<int64_t>((k * 7919 + rank * 104729 + salt) % 100003) - 50000;
}

// fp32 -> bf16 rounding to nearest, ties to even, computed from the two neighbours (not the
// bit trick the kernels use).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  auto back = [](uint16_t b) {
    uint32_t w = uint32_t(b) << 16;
    float g;
    std::memcpy(&g, &w, 4);
    return static_cast<double>(g);
  };
  const double x = f, dl = std::fabs(x - back(lo)), dh = std::fabs(back(hi) - x);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}
inline float from_bf16(uint16_t b) {
  uint32_t w = uint32_t(b) << 16;
  float g;
  std::memcpy(&g, &w, 4);
  return g;
}

// `n` elements of `rank`'s input, starting at element `first`.
inline Bytes make_input(smddp::DType t, int rank, size_t n, int salt, size_t first = 0) {
  Bytes b(n * smddp::dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    const size_t k = first + i;
    if (t == smddp::DType::F32) {
      float v = static_cast<float>(float_value(rank, k, salt));
      std::memcpy(b.data() + 4 * i, &v, 4);
    } else if (t == smddp::DType::BF16) {
      uint16_t v = to_bf16(static_cast<float>(float_value(rank, k, salt)));
      std::memcpy(b.data() + 2 * i, &v, 2);
    } else {
      int64_t v = int_value(rank, k, salt);
      std::memcpy(b.data() + 8 * i, &v, 8);
    }
  }
  return b;
}

// The reduction over ranks 0..nranks-1 of elements [first, first + n) of make_input().
inline Bytes expected_reduction(smddp::DType t, const smddp::Reduction& red, int nranks, size_t n,
                                int salt, size_t first = 0) {
  using smddp::RedOp;
  Bytes out(n * smddp::dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    const size_t k = first + i;
    if (t == smddp::DType::I64) {
      int64_t acc = int_value(0, k, salt);
      for (int r = 1; r < nranks; ++r) {
        int64_t v = int_value(r, k, salt);
        if (red.op == RedOp::SUM) acc += v;
        if (red.op == RedOp::MIN) acc = std::min(acc, v);
        if (red.op == RedOp::MAX) acc = std::max(acc, v);
        if (red.op == RedOp::BXOR) acc ^= v;
      }
      std::memcpy(out.data() + 8 * i, &acc, 8);
      continue;
    }
    auto in = [&](int r) {
      float v = static_cast<float>(float_value(r, k, salt));
      if (red.op == RedOp::PREMUL_SUM) v = static_cast<float>(v * red.premul);
      return v;
    };
    float acc = in(0);
    for (int r = 1; r < nranks; ++r) {
      float v = in(r);
      if (red.op == RedOp::MIN)
        acc = std::min(acc, v);
      else if (red.op == RedOp::MAX)
        acc = std::max(acc, v);
      else
        acc += v;
    }
    if (red.op == RedOp::AVG) acc = acc / static_cast<float>(red.divisor);
    if (t == smddp::DType::F32) {
      std::memcpy(out.data() + 4 * i, &acc, 4);
    } else {
      uint16_t v = to_bf16(acc);
      std::memcpy(out.data() + 2 * i, &v, 2);
    }
  }
  return out;
}

// "" when equal, else the first differing element with both values.
inline std::string compare(smddp::DType t, const char* got, const Bytes& want) {
  const size_t esz = smddp::dtype_size(t);
  for (size_t i = 0; i < want.size() / esz; ++i) {
    if (std::memcmp(got + i * esz, want.data() + i * esz, esz) == 0) continue;
    double g = 0, w = 0;
    if (t == smddp::DType::F32) {
      float a, b;
      std::memcpy(&a, got + 4 * i, 4);
      std::memcpy(&b, want.data() + 4 * i, 4);
      g = a, w = b;
    } else if (t == smddp::DType::BF16) {
      uint16_t a, b;
      std::memcpy(&a, got + 2 * i, 2);
      std::memcpy(&b, want.data() + 2 * i, 2);
      g = from_bf16(a), w = from_bf16(b);
    } else {
      int64_t a, b;
      std::memcpy(&a, got + 8 * i, 8);
      std::memcpy(&b, want.data() + 8 * i, 8);
      g = static_cast<double>(a), w = static_cast<double>(b);
    }
    return "element " + std::to_string(i) + " is " + std::to_string(g) + ", expected " +
           std::to_string(w);
  }
  return "";
}

// Byte k of `rank`'s payload number `salt` (for the byte-moving collectives).
inline char byte_value(int rank, size_t k, int salt) {
  return static_cast<char>((rank * 131 + k * 7 + salt * 17 + (k >> 8)) & 0xff);
}
inline Bytes make_bytes(int rank, size_t n, int salt) {
  Bytes b(n);
  for (size_t k = 0; k < n; ++k) b[k] = byte_value(rank, k, salt);
  return b;
}
inline std::string compare_bytes(const char* got, const Bytes& want) {
  for (size_t k = 0; k < want.size(); ++k) {
    if (got[k] != want[k]) {
      return "byte " + std::to_string(k) + " of " + std::to_string(want.size()) + " is " +
             std::to_string(int(uint8_t(got[k]))) + ", expected " +
             std::to_string(int(uint8_t(want[k])));
    }
  }
  return "";
}

}  // namespace smddp_test
