#include "smddp/common/common.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace smddp {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
    case DType::I16:
      return 2;
    default:
      return 1;
  }
}

const char* dtype_name(DType t) {
  static const char* names[] = {"float32", "float64", "bfloat16", "float16", "int8",
                                "uint8",   "int16",   "int32",    "int64",   "bool"};
  return names[static_cast<int>(t)];
}

const char* redop_name(RedOp op) {
  static const char* names[] = {"SUM",  "AVG", "PRODUCT", "MIN",       "MAX",
                                "BAND", "BOR", "BXOR",    "PREMUL_SUM"};
  return names[static_cast<int>(op)];
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16;
}

DType acc_type(DType t) { return (t == DType::BF16 || t == DType::F16) ? DType::F32 : t; }

void check_reduction(DType dtype, RedOp op, const char* collective) {
  bool bitwise = op == RedOp::BAND || op == RedOp::BOR || op == RedOp::BXOR;
  bool scaling = op == RedOp::AVG || op == RedOp::PREMUL_SUM;
  if (bitwise && is_floating(dtype)) {
    throw std::invalid_argument(
        std::string("smddp: ") + collective + " does not support ReduceOp." + redop_name(op) +
        " for " + dtype_name(dtype) + " tensors; bitwise ops need an integer or bool dtype");
  }
  if (scaling && !is_floating(dtype)) {
    throw std::invalid_argument(
        std::string("smddp: ") + collective + " does not support ReduceOp." + redop_name(op) +
        " for " + dtype_name(dtype) + " tensors; use a floating-point dtype or ReduceOp.SUM");
  }
}

Deadline Deadline::after(double seconds) {
  Deadline d;
  d.seconds = seconds;
  // Beyond about 292 years the clock's nanoseconds overflow int64 and the deadline would lie
  // in the past; a longer timeout means the same as this one.
  constexpr double kLongest = 1e9;  // about 31 years
  const double wait = std::isnan(seconds) ? 0.0 : std::clamp(seconds, 0.0, kLongest);
  d.at = Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait));
  return d;
}

int Deadline::remaining_ms() const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left > 1 << 30 ? 1 << 30 : left);
}

std::string describe_op(const char* name, const OpArgs& args) {
  std::string s(name);
  if (!args.dtype) return s;
  s.append(" (").append(args.dtype);
  if (args.op) s.append(", ").append(args.op);
  s.append(", ").append(std::to_string(args.numel)).append(" elements");
  if (args.peer >= 0)
    s.append(args.to_peer ? ", to rank " : ", from rank ").append(std::to_string(args.peer));
  if (args.peer == kAnyPeer) s.append(", from any rank");
  if (args.root >= 0) s.append(", root ").append(std::to_string(args.root));
  return s.append(")");
}

namespace {
// Copies a NUL-terminated string (nullptr: empty) into a fixed array, truncating.
template <size_t N>
void copy_cstr(char (&dst)[N], const char* src) {
  size_t n = src ? strnlen(src, N - 1) : 0;
  std::memcpy(dst, src ? src : "", n);
  dst[n] = '\0';
}
template <size_t N>
std::string from_cstr(const char (&src)[N]) {
  return std::string(src, strnlen(src, N));
}
}  // namespace

CallSummary CallSummary::of(const OpCtx& ctx) {
  CallSummary c;
  copy_cstr(c.name, ctx.name);
  copy_cstr(c.dtype, ctx.args.dtype);
  copy_cstr(c.op, ctx.args.op);
  c.numel = ctx.args.numel;
  c.root = ctx.args.root;
  return c;
}

std::string CallSummary::describe() const {
  std::string n = from_cstr(name), d = from_cstr(dtype), o = from_cstr(op);
  OpArgs args;
  args.dtype = d.empty() ? nullptr : d.c_str();
  args.op = o.empty() ? nullptr : o.c_str();
  args.numel = numel;
  args.root = root;
  return describe_op(n.c_str(), args);
}

std::string mismatch_message(const std::string& group, int me, const std::string& mine,
                             uint64_t my_seq, int them, const std::string& theirs,
                             uint64_t their_seq) {
  return "smddp: mismatched collectives on group '" + group + "': rank " + std::to_string(me) +
         " called " + mine + " as collective #" + std::to_string(my_seq) + " but rank " +
         std::to_string(them) + " called " + theirs + " as collective #" +
         std::to_string(their_seq) +
         "; every rank must issue the same collectives with the same dtype, op, size and root "
         "in the same order";
}

uint32_t hash_name(const char* s) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (; *s; ++s) h = (h ^ static_cast<uint8_t>(*s)) * 16777619u;
  return h;
}

bool& on_worker_thread() {
  thread_local bool flag = false;
  return flag;
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

namespace {
[[noreturn]] void overflow(const char* what, const std::string& expr) {
  throw std::invalid_argument(std::string("smddp: ") + what + " overflows: " + expr +
                              " does not fit in 64 bits");
}
}  // namespace

size_t checked_mul(size_t a, size_t b, const char* what) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r))
    overflow(what, std::to_string(a) + " x " + std::to_string(b));
  return r;
}

size_t checked_add(size_t a, size_t b, const char* what) {
  size_t r;
  if (__builtin_add_overflow(a, b, &r))
    overflow(what, std::to_string(a) + " + " + std::to_string(b));
  return r;
}

size_t round_up(size_t x, size_t align, const char* what) {
  return checked_add(x, align - 1, what) & ~(align - 1);
}

Span partition(size_t n, int parts, int i, size_t align) {
  size_t blocks = (n + align - 1) / align;
  size_t base = blocks / parts, extra = blocks % parts;
  size_t b0 = i * base + (static_cast<size_t>(i) < extra ? i : extra);
  size_t nb = base + (static_cast<size_t>(i) < extra ? 1 : 0);
  size_t begin = b0 * align, end = (b0 + nb) * align;
  if (begin > n) begin = n;
  if (end > n) end = n;
  return {begin, end - begin};
}

namespace detail {

void check_failed(const char* file, int line, bool value_error, const std::string& message) {
  // Note [Check macros]: the path from csrc/ on, whatever directory the build ran in.
  const char* rel = std::strstr(file, "csrc/");
  std::string where = std::string(rel ? rel + 5 : file) + ":" + std::to_string(line) + ": ";
  if (value_error) throw std::invalid_argument(where + message);
  throw CommError(where + message);
}

}  // namespace detail

}  // namespace smddp
