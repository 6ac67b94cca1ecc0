// The reduction kernels called directly, for the dtypes and ops the collective tests do not
// reach, against references computed here; and the small helpers of common.h.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "data.h"
#include "harness.h"
#include "smddp/algorithms/kernels.h"
#include "smddp/common/settings.h"

namespace smddp_test {
namespace {

using smddp::DType;
using smddp::RedOp;

// n = 1000 crosses the kernels' 256-element blocks; 2 sources take the fused pair loop,
// 3 the blocked one.
constexpr size_t kN = 1000;

template <typename T, typename F>
void check_kernel(DType t, RedOp op, int nsrc, F value, const char* what) {
  std::vector<std::vector<T>> srcs(nsrc, std::vector<T>(kN));
  for (int s = 0; s < nsrc; ++s) {
    for (size_t i = 0; i < kN; ++i) srcs[s][i] = value(s, i);
  }
  std::vector<const void*> ptrs;
  for (auto& s : srcs) ptrs.push_back(s.data());
  smddp::Reduction red;
  red.dtype = t;
  red.op = op;
  red.divisor = nsrc;
  std::vector<T> dst(kN);
  smddp::reduce(t, t, dst.data(), ptrs.data(), nsrc, kN, red, true);
  for (size_t i = 0; i < kN; ++i) {
    T want = srcs[0][i];
    for (int s = 1; s < nsrc; ++s) {
      const T v = srcs[s][i];
      switch (op) {
        case RedOp::SUM:
        case RedOp::PRODUCT:
          if constexpr (std::is_integral_v<T>) {  // modulo 2^bits, without signed overflow
            const uint64_t a = static_cast<uint64_t>(want), b = static_cast<uint64_t>(v);
            want = static_cast<T>(op == RedOp::SUM ? a + b : a * b);
          } else {
            want = op == RedOp::SUM ? want + v : want * v;
          }
          break;
        case RedOp::MIN:
          want = v < want ? v : want;
          break;
        case RedOp::MAX:
          want = v > want ? v : want;
          break;
        default:
          if constexpr (std::is_integral_v<T>) {
            if (op == RedOp::BAND) want = static_cast<T>(want & v);
            if (op == RedOp::BOR) want = static_cast<T>(want | v);
            if (op == RedOp::BXOR) want = static_cast<T>(want ^ v);
          }
          break;
      }
    }
    if (std::memcmp(&dst[i], &want, sizeof(T)) != 0) {
      EXPECT(false, what, " ", smddp::redop_name(op), " with ", nsrc, " sources: element ", i,
             " is ", +dst[i], ", expected ", +want);
      return;
    }
  }
}

}  // namespace

TEST_CASE(kernels_integer_types_wrap_around) {
  for (int nsrc : {2, 3}) {
    // Sums and products that overflow wrap around (two's complement), as torch's do.
    auto i8 = [](int s, size_t i) { return static_cast<int8_t>((i * 37 + s * 101) & 0xff); };
    for (RedOp op : {RedOp::SUM, RedOp::PRODUCT, RedOp::MIN, RedOp::MAX, RedOp::BXOR}) {
      check_kernel<int8_t>(DType::I8, op, nsrc, i8, "int8");
    }
    auto u8 = [](int s, size_t i) { return static_cast<uint8_t>((i * 13 + s * 71) & 0xff); };
    for (RedOp op : {RedOp::SUM, RedOp::MIN, RedOp::MAX, RedOp::BAND}) {
      check_kernel<uint8_t>(DType::U8, op, nsrc, u8, "uint8");
    }
    auto i16 = [](int s, size_t i) { return static_cast<int16_t>(i * 977 + s * 30011); };
    for (RedOp op : {RedOp::SUM, RedOp::MIN, RedOp::BOR}) {
      check_kernel<int16_t>(DType::I16, op, nsrc, i16, "int16");
    }
    auto i32 = [](int s, size_t i) {
      return static_cast<int32_t>(static_cast<uint32_t>(i) * 2654435761u + s * 0x7fffffffu);
    };
    for (RedOp op : {RedOp::SUM, RedOp::PRODUCT, RedOp::MAX, RedOp::BAND}) {
      check_kernel<int32_t>(DType::I32, op, nsrc, i32, "int32");
    }
  }
}

TEST_CASE(kernels_bool_stays_zero_or_one) {
  // bool: SUM/MAX are logical or, PRODUCT/MIN logical and, BXOR exclusive or.
  std::vector<std::vector<uint8_t>> srcs = {{0, 0, 1, 1, 1}, {0, 1, 0, 1, 1}, {0, 1, 1, 1, 0}};
  std::vector<const void*> ptrs = {srcs[0].data(), srcs[1].data(), srcs[2].data()};
  const std::vector<std::pair<RedOp, std::vector<uint8_t>>> cases = {
      {RedOp::SUM, {0, 1, 1, 1, 1}},
      {RedOp::MAX, {0, 1, 1, 1, 1}},
      {RedOp::PRODUCT, {0, 0, 0, 1, 0}},
      {RedOp::MIN, {0, 0, 0, 1, 0}},
      {RedOp::BXOR, {0, 0, 0, 1, 0}}};
  for (const auto& [op, want] : cases) {
    smddp::Reduction red;
    red.dtype = DType::BOOL;
    red.op = op;
    std::vector<uint8_t> dst(5, 9);
    smddp::reduce(DType::BOOL, DType::BOOL, dst.data(), ptrs.data(), 3, 5, red, true);
    EXPECT(dst == want, "bool ", smddp::redop_name(op));
  }
}

TEST_CASE(kernels_f64_and_f16) {
  // f64: sums of integers are exact. f16: accumulated in fp32, rounded once to nearest even;
  // the reference rounds with the compiler's own _Float16 conversion.
  auto f64 = [](int s, size_t i) {
    return static_cast<double>(int64_t(i * 7 + s * 1000003) - 500000);
  };
  for (RedOp op : {RedOp::SUM, RedOp::MIN, RedOp::MAX})
    check_kernel<double>(DType::F64, op, 3, f64, "float64");
#if defined(__FLT16_MAX__)
  for (int nsrc : {2, 3}) {
    // Values up to 2^13 with a fractional part, so most sums need rounding; some large
    // enough that the sum overflows to infinity, some subnormal.
    auto value = [](int s, size_t i) -> float {
      if (i % 97 == 0) return 60000.0f;           // sum overflows fp16
      if (i % 89 == 0) return 3.0e-6f * (s + 1);  // subnormal range
      return static_cast<float>(int(i * 53 + s * 7919) % 16384 - 8192) + 0.375f * s;
    };
    std::vector<std::vector<uint16_t>> srcs(nsrc, std::vector<uint16_t>(kN));
    std::vector<std::vector<float>> exact(nsrc, std::vector<float>(kN));
    for (int s = 0; s < nsrc; ++s) {
      for (size_t i = 0; i < kN; ++i) {
        _Float16 h = static_cast<_Float16>(value(s, i));
        exact[s][i] = static_cast<float>(h);
        std::memcpy(&srcs[s][i], &h, 2);
      }
    }
    std::vector<const void*> ptrs;
    for (auto& s : srcs) ptrs.push_back(s.data());
    for (RedOp op : {RedOp::SUM, RedOp::AVG, RedOp::MAX}) {
      smddp::Reduction red;
      red.dtype = DType::F16;
      red.op = op;
      red.divisor = nsrc;
      std::vector<uint16_t> dst(kN);
      smddp::reduce(DType::F16, DType::F16, dst.data(), ptrs.data(), nsrc, kN, red, true);
      for (size_t i = 0; i < kN; ++i) {
        float acc = exact[0][i];
        for (int s = 1; s < nsrc; ++s)
          acc = op == RedOp::MAX ? std::max(acc, exact[s][i]) : acc + exact[s][i];
        if (op == RedOp::AVG) acc /= static_cast<float>(nsrc);
        _Float16 want = static_cast<_Float16>(acc);
        uint16_t want_bits;
        std::memcpy(&want_bits, &want, 2);
        if (dst[i] != want_bits) {
          EXPECT(false, "float16 ", smddp::redop_name(op), " with ", nsrc, " sources: element ", i,
                 " is 0x", std::hex, dst[i], ", expected 0x", want_bits, " (", acc, ")");
          break;
        }
      }
    }
  }
#else
  std::printf("     (no _Float16 in this compiler: the float16 half of this case did not run)\n");
#endif
}

TEST_CASE(kernels_mixed_sources_accumulate_in_fp32) {
  // Note [Half precision on the wire]: bf16 partials that crossed hosts beside this host's
  // fp32 one. The reference converts the bf16 sources itself, sums in fp32 in source order
  // and rounds once (data.h's to_bf16, not the kernels' bit trick).
  for (int nsrc : {2, 3, 5}) {
    std::vector<DType> types;
    for (int s = 0; s < nsrc; ++s) types.push_back(s == 1 ? DType::F32 : DType::BF16);
    std::vector<std::vector<uint16_t>> half(nsrc, std::vector<uint16_t>(kN));
    std::vector<std::vector<float>> full(nsrc, std::vector<float>(kN)), exact = full;
    for (int s = 0; s < nsrc; ++s) {
      for (size_t i = 0; i < kN; ++i) {
        // Fractions, so that the fp32 source is not a bf16 value and most sums round.
        const float v = static_cast<float>(int(i * 131 + s * 977) % 2000 - 1000) / 7.0f;
        half[s][i] = to_bf16(v);
        full[s][i] = v;
        exact[s][i] = types[s] == DType::BF16 ? from_bf16(half[s][i]) : v;
      }
    }
    std::vector<const void*> ptrs;
    for (int s = 0; s < nsrc; ++s) {
      ptrs.push_back(types[s] == DType::BF16 ? static_cast<const void*>(half[s].data())
                                             : static_cast<const void*>(full[s].data()));
    }
    for (RedOp op : {RedOp::SUM, RedOp::AVG, RedOp::MIN}) {
      smddp::Reduction red;
      red.dtype = DType::BF16;
      red.op = op;
      red.divisor = nsrc;
      std::vector<uint16_t> out(kN);
      std::vector<float> partial(kN);
      smddp::reduce_mixed(types, DType::BF16, out.data(), ptrs.data(), kN, red, true);
      smddp::reduce_mixed(types, DType::F32, partial.data(), ptrs.data(), kN, red, false);
      for (size_t i = 0; i < kN; ++i) {
        float acc = exact[0][i];
        for (int s = 1; s < nsrc; ++s) {
          acc = op == RedOp::MIN ? std::min(acc, exact[s][i]) : acc + exact[s][i];
        }
        EXPECT(partial[i] == acc, "mixed ", smddp::redop_name(op), " ", nsrc,
               " sources, fp32 partial: element ", i, " is ", partial[i], ", expected ", acc);
        if (op == RedOp::AVG) acc /= static_cast<float>(nsrc);
        if (out[i] != to_bf16(acc)) {
          EXPECT(false, "mixed ", smddp::redop_name(op), " ", nsrc, " sources: element ", i, " is ",
                 from_bf16(out[i]), ", expected ", from_bf16(to_bf16(acc)));
          break;
        }
      }
    }
  }
  // Sources of one type take the ordinary kernels.
  std::vector<uint16_t> a = {to_bf16(1.5f)}, b = {to_bf16(2.25f)}, out(1);
  const void* both[2] = {a.data(), b.data()};
  smddp::Reduction red;
  red.dtype = DType::BF16;
  smddp::reduce_mixed({DType::BF16, DType::BF16}, DType::BF16, out.data(), both, 1, red, true);
  EXPECT(from_bf16(out[0]) == 3.75f, "bf16 + bf16 gave ", from_bf16(out[0]));
}

TEST_CASE(kernels_scale_copy_and_streaming_copy) {
  std::vector<float> src(333), dst(333);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) - 100.0f;
  smddp::scale_copy(DType::F32, dst.data(), src.data(), src.size(), 0.25);
  for (size_t i = 0; i < src.size(); ++i) EXPECT(dst[i] == src[i] * 0.25f, "element ", i);
  EXPECT_THROW_WITH(smddp::scale_copy(DType::I32, dst.data(), src.data(), 1, 2.0),
                    "cannot scale int32 tensors");
  // Streaming copies at every alignment of the destination and around the 1 KiB cut-over.
  std::vector<char> from(5000), to(5100);
  for (size_t i = 0; i < from.size(); ++i) from[i] = static_cast<char>(i * 31 + 7);
  for (size_t shift : {0, 1, 7, 15, 16, 63}) {
    for (size_t bytes : {0, 5, 1023, 1024, 1025, 4999}) {
      std::fill(to.begin(), to.end(), '\x5a');
      smddp::copy_streaming(to.data() + shift, from.data(), bytes);
      bool same = std::memcmp(to.data() + shift, from.data(), bytes) == 0;
      bool untouched = to[shift + bytes] == '\x5a' && (shift == 0 || to[shift - 1] == '\x5a');
      EXPECT(same && untouched, "copy_streaming shift ", shift, " bytes ", bytes);
    }
  }
}

TEST_CASE(common_size_arithmetic_and_partition) {
  const size_t big = std::numeric_limits<size_t>::max() / 2 + 1;
  EXPECT_THROW_WITH(smddp::checked_mul(big, 2, "the test product"), "the test product overflows");
  EXPECT_THROW_WITH(smddp::checked_add(big, big, "the test sum"), "the test sum overflows");
  EXPECT_THROW_WITH(smddp::round_up(std::numeric_limits<size_t>::max() - 10, 4096, "rounding"),
                    "rounding overflows");
  EXPECT(smddp::round_up(4097, 4096, "x") == 8192);
  EXPECT(smddp::checked_mul(3, 5, "x") == 15);
  // Partitions cover [0, n) in order, without gaps, with aligned inner boundaries.
  for (size_t n : {0, 1, 15, 16, 17, 1000, 4099}) {
    for (int parts : {1, 2, 3, 7}) {
      size_t next = 0;
      for (int i = 0; i < parts; ++i) {
        smddp::Span s = smddp::partition(n, parts, i, 16);
        EXPECT(s.off == next, "n ", n, " parts ", parts, " span ", i, " starts at ", s.off);
        EXPECT(s.off + s.len == n || (s.off + s.len) % 16 == 0, "n ", n, " span ", i, " unaligned");
        next = s.off + s.len;
      }
      EXPECT(next == n, "n ", n, " parts ", parts, " covers ", next);
    }
  }
  EXPECT_THROW_WITH(smddp::check_reduction(DType::F32, RedOp::BAND, "all_reduce"),
                    "does not support ReduceOp.BAND for float32");
  EXPECT_THROW_WITH(smddp::check_reduction(DType::I64, RedOp::AVG, "all_reduce"),
                    "does not support ReduceOp.AVG for int64");
}

}  // namespace smddp_test

namespace smddp_test {

TEST_CASE(check_macros_name_file_and_line) {
  const int line = __LINE__ + 1;
  auto fail = [] { SMDDP_CHECK(1 + 1 == 3, "smddp: arithmetic is off by ", 1, " today"); };
  std::string msg = EXPECT_THROW_WITH(fail(), "smddp: arithmetic is off by 1 today");
  EXPECT(msg.rfind("tests/cpp/test_kernels.cpp:" + std::to_string(line) + ": smddp:", 0) == 0, msg);
  try {
    fail();
  } catch (const smddp::CommError&) {
  } catch (...) {
    EXPECT(false, "SMDDP_CHECK raised something other than CommError");
  }
  try {
    SMDDP_CHECK_VALUE(false, "bad value ", 2.5);
  } catch (const std::invalid_argument& e) {
    EXPECT(std::string(e.what()).find(": bad value 2.5") != std::string::npos, e.what());
  }
  SMDDP_CHECK(true, "never formatted");
  // Errors raised through the macro by the core point at their source line.
  std::string settings_error =
      EXPECT_THROW_WITH(smddp::resolve_settings({{"spin_us", "x"}},
                                                [](const char*) -> const char* { return nullptr; }),
                        "SMDDPOptions.spin_us=x is invalid");
  EXPECT(settings_error.rfind("smddp/common/settings.cpp:", 0) == 0, settings_error);
}

}  // namespace smddp_test
