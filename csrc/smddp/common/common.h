// Shared vocabulary of the smddp backend: dtypes, reduce ops, deadlines, errors.
//
// Everything below csrc/smddp/ except backend*.cpp and bindings.cpp is plain C++ on raw
// pointers and byte counts (no ATen), so the algorithms can later be reused on pinned
// staging buffers for accelerator tensors.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace smddp {

enum class DType : uint8_t { F32, F64, BF16, F16, I8, U8, I16, I32, I64, BOOL };
enum class RedOp : uint8_t { SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* redop_name(RedOp op);
bool is_floating(DType t);

// The type a reduction accumulates in: fp32 for bf16/fp16 (rounded once at the end),
// the element type itself otherwise.
DType acc_type(DType t);

// What to do with the elements of one reduction.
struct Reduction {
  DType dtype = DType::F32;
  RedOp op = RedOp::SUM;
  double premul = 1.0;  // PREMUL_SUM: every input is scaled by this before it is summed
  int divisor = 1;      // AVG: the final sum is divided by this (the group size)
};

// Throws unless `op` is defined for `dtype` (e.g. no bitwise ops on floats, no AVG on ints).
void check_reduction(DType dtype, RedOp op, const char* collective);

using Clock = std::chrono::steady_clock;

// A point in time after which a wait gives up.
struct Deadline {
  Clock::time_point at;
  double seconds = 0;  // the original budget, for messages
  static Deadline after(double seconds);
  bool expired() const { return Clock::now() >= at; }
  int remaining_ms() const;
};

// Identifies one call for error messages and mismatch detection. `desc` is compared
// across ranks: two ranks that issue different collectives (kind, dtype, op, count) at the
// same sequence number raise instead of exchanging garbage.
struct CollDesc {
  uint32_t kind = 0;  // hash of the collective's name
  uint32_t dtype_op = 0;
  uint64_t count = 0;  // element or byte count, as the collective defines it
  uint64_t extra = 0;  // root rank etc.
  bool operator==(const CollDesc& o) const {
    return kind == o.kind && dtype_op == o.dtype_op && count == o.count && extra == o.extra;
  }
  bool operator!=(const CollDesc& o) const { return !(*this == o); }
};

// A collective's arguments as messages show them. Kept as pointers to static strings and
// numbers, and formatted only when a message is built: every collective carries one, and
// formatting eagerly cost a measurable share of a small all-reduce.
struct OpArgs {
  const char* dtype = nullptr;  // "float32"; nullptr: no tensor arguments (barrier)
  const char* op = nullptr;     // "sum"; nullptr: not a reduction
  int64_t numel = 0;
  int peer = -1;         // send/recv: the other rank (kAnyPeer: recv from any rank)
  bool to_peer = false;  // send (true) or recv (false)
  int64_t root = -1;     // rooted collectives (broadcast, reduce, gather, scatter)
};

constexpr int kAnyPeer = -2;

// "all_reduce (float32, sum, 1024 elements)", or just the name when `args` has no dtype.
std::string describe_op(const char* name, const OpArgs& args);

struct OpCtx {
  const char* name = "";  // user-facing collective name, e.g. "all_reduce"
  uint64_t seq = 0;       // per-group collective sequence number (same on all ranks)
  CollDesc desc;
  Deadline deadline;
  OpArgs args;
  std::string describe() const { return describe_op(name, args); }
};

// What a rank called, copied into plain bytes so that another process can print it: the
// shared-memory descriptor slots and the TCP message headers carry one (Note [Mismatch
// detection] in shm.h, Note [Mismatches across hosts] in tcp.h).
struct CallSummary {
  char name[32] = {0};
  char dtype[16] = {0};
  char op[16] = {0};
  int64_t numel = 0;
  int64_t root = -1;
  static CallSummary of(const OpCtx& ctx);  // copies, does not format
  std::string describe() const;             // as OpCtx::describe()
};

// "smddp: mismatched collectives on group 'g': rank 0 called <mine> as collective #3 but
// rank 1 called <theirs> as collective #3; every rank must ...".
std::string mismatch_message(const std::string& group, int me, const std::string& mine,
                             uint64_t my_seq, int them, const std::string& theirs,
                             uint64_t their_seq);

uint32_t hash_name(const char* s);

// True on the executor's worker threads. Waits there spin less: a spinning worker would
// steal the core from the computation the async collective is meant to overlap with.
bool& on_worker_thread();

// Formats "[0, 2, 3]".
std::string format_ranks(const std::vector<int>& ranks);

// A collective failed on this or another rank. Surfaces as RuntimeError in Python.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A piece of a buffer: [off, off + len) in some unit (elements or bytes).
struct Span {
  size_t off = 0;
  size_t len = 0;
};

// Size arithmetic on values that come from users or peers (split sizes, element counts,
// settings): each throws std::invalid_argument (ValueError in Python) naming `what` when
// the exact result does not fit in 64 bits, instead of wrapping around.
size_t checked_mul(size_t a, size_t b, const char* what);
size_t checked_add(size_t a, size_t b, const char* what);
// `x` rounded up to a multiple of `align` (a power of two).
size_t round_up(size_t x, size_t align, const char* what);

// Splits n units into `parts` contiguous spans whose boundaries are multiples of `align`
// (except the end); the first spans get the extra blocks.
Span partition(size_t n, int parts, int i, size_t align);

// Note [Check macros]
// SMDDP_CHECK(cond, parts...) throws a CommError (RuntimeError in Python) and
// SMDDP_CHECK_VALUE(cond, parts...) a std::invalid_argument (ValueError) when `cond` is
// false. The message is "<file>:<line>: " followed by the parts streamed together, the file
// relative to csrc/, so a report points at the check without a debugger:
//   SMDDP_CHECK_VALUE(v <= hi, "smddp: ", source, "=", text, " is invalid: must be at most ", hi);
namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
[[noreturn]] void check_failed(const char* file, int line, bool value_error,
                               const std::string& message);
}  // namespace detail

#define SMDDP_CHECK_IMPL(cond, value_error, ...)                           \
  do {                                                                     \
    if (__builtin_expect(!(cond), 0)) {                                    \
      ::smddp::detail::check_failed(__FILE__, __LINE__, value_error,       \
                                    ::smddp::detail::concat(__VA_ARGS__)); \
    }                                                                      \
  } while (0)
#define SMDDP_CHECK(cond, ...) SMDDP_CHECK_IMPL(cond, false, __VA_ARGS__)
#define SMDDP_CHECK_VALUE(cond, ...) SMDDP_CHECK_IMPL(cond, true, __VA_ARGS__)

}  // namespace smddp
