#include "smddp/common/settings.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "smddp/common/common.h"

namespace smddp {
namespace {

constexpr int64_t kKiB = 1 << 10, kMiB = 1 << 20, kGiB = int64_t(1) << 30, kTiB = int64_t(1) << 40;

const std::vector<SettingInfo> kSettings = {
    {"buffer_bytes", "SMDDP_BUFFER_BYTES", "bytes", "1M",
     "each of the two shared-memory data buffers per rank and group (4K to 1G)"},
    {"chunk_bytes", "SMDDP_CHUNK_BYTES", "bytes or auto", "auto",
     "bytes per rank per pipelined step (256 to 1G, at most the buffer); auto: 512K, 1M when "
     "the host's ranks outnumber the CPUs the most restricted of them may use"},
    {"oneshot_bytes", "SMDDP_ONESHOT_BYTES", "bytes", "4K",
     "all_reduce up to this size uses the one-shot algorithm (0 to 1G)"},
    {"pool_bytes", "SMDDP_POOL_BYTES", "bytes", "1G",
     "address space of each rank's tensor pool, committed as used (0: no pool; up to 1T)"},
    {"p2p_bytes", "SMDDP_P2P_BYTES", "bytes", "1M + 64K",
     "ring of each ordered pair of local ranks for send/recv, committed as used (0: send/recv "
     "over TCP; else 4K to 1G)"},
    {"stream_bytes", "SMDDP_STREAM_BYTES", "bytes or auto", "auto",
     "per-rank output size from which copies into it use streaming stores (0: never); auto: "
     "L3 / (2 x local ranks)"},
    {"spin_us", "SMDDP_SPIN_US", "microseconds", "200",
     "busy-wait budget before sleeping, caller thread (0 to 1000000)"},
    {"worker_spin_us", "SMDDP_WORKER_SPIN_US", "microseconds", "20",
     "busy-wait budget before sleeping, async worker threads (0 to 1000000)"},
    {"move_off_cpu", "SMDDP_MOVE_OFF_CPU", "flag", "0",
     "1: a waiting thread whose peer the scheduler put on its CPU moves itself to another "
     "CPU (narrows its affinity for an instant); 0: it sleeps instead"},
    {"force_local_size", "SMDDP_FORCE_LOCAL_SIZE", "count", "0",
     "treat blocks of k consecutive global ranks as separate hosts (tests the inter-host path "
     "on one machine); 0: hosts as they are"},
    {"socket_addr", "SMDDP_SOCKET_ADDR", "address", "",
     "IPv4 address (or name of one) other hosts reach this rank at; the listener binds it"},
    {"socket_ifname", "SMDDP_SOCKET_IFNAME", "name", "",
     "network interface whose IPv4 address to use instead (default: the first non-loopback "
     "interface); set at most one of the two"},
    {"net_chunk_bytes", "SMDDP_NET_CHUNK_BYTES", "bytes", "512K",
     "collectives across hosts send each part in messages of this many bytes, so what "
     "arrived is reduced and sent on while the rest still arrives (4K to 1G)"},
    {"net_algo", "SMDDP_NET_ALGO", "name", "auto",
     "how collectives cross hosts: mesh (every host sends to every other at once), ring "
     "(each host to the next, from 3 hosts), halving_doubling (log2 H rounds of one peer "
     "each), tree (every all_reduce by log2 H rounds of the whole data, other collectives as "
     "auto sends them), or auto (the cost model's choice by host count and size: the ring "
     "from 3 hosts, the mesh on 2; small all_reduces by the tree and small collectives by "
     "halving_doubling); hosts of unequal rank counts take the mesh"},
    {"net_reduce_dtype", "SMDDP_NET_REDUCE_DTYPE", "name", "auto",
     "the type bf16/fp16 reductions send their partial sums between hosts in: auto (the "
     "tensor's own, half of fp32's bytes; each host's partial rounded once, sums in fp32) or "
     "fp32 (twice the bytes, no rounding before the owner's)"},
    {"connect_attempt_timeout", "SMDDP_CONNECT_ATTEMPT_TIMEOUT", "seconds", "20",
     "how long one attempt to connect to another rank over TCP waits for the network's "
     "answer before it is made afresh (0.1 to 60); attempts the network does not carry go "
     "on for 60 s from the first, or to the operation's timeout"},
    {"timeline", "SMDDP_TIMELINE", "flag", "0",
     "1: record when each collective and each of its phases across hosts began and ended "
     "(bench multihost --timeline prints them), and the phases of staged calls on device "
     "tensors (bench gpu --timeline)"},
    {"staging_chunk_bytes", "SMDDP_STAGING_CHUNK_BYTES", "bytes", "4M",
     "device tensors: the all-reduce copies and reduces this many bytes at a time, so the "
     "copies of one chunk overlap the reduction of the next (4K to 1G)"},
    {"staging_memory", "SMDDP_STAGING_MEMORY", "name", "auto",
     "device tensors: host memory the copies land in: pinned (asynchronous copies), pool (the "
     "shared-memory pool: no extra host copy, synchronous copies) or auto (pinned where the "
     "device has a pinned allocator)"},
    {"stage_cpu", "SMDDP_STAGE_CPU", "flag", "0",
     "1: CPU tensors take the device staging path (tests of its pipeline on CPU)"},
    {"timeout", "", "seconds", "",
     "timeout of the group's set-up and collectives, instead of the one given to "
     "init_process_group / new_group (options only)"},
};

// The message of a value that breaks its rule (raised with SMDDP_CHECK_VALUE).
std::string invalid(const std::string& source, const std::string& value, const std::string& rule) {
  return "smddp: " + source + "=" + value + " is invalid: " + rule;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// "4096", "64K", "1M", "1MiB", "2G": digits, then at most one binary unit. No sign, no
// spaces, nothing after the unit.
int64_t parse_bytes(const std::string& source, const std::string& text) {
  const std::string rule =
      "expected a byte count: digits with an optional K, M, G or T suffix (e.g. 4096, 64K, 1M)";
  size_t i = 0;
  uint64_t v = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const bool overflow =
        __builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, uint64_t(text[i] - '0'), &v);
    SMDDP_CHECK_VALUE(!overflow, invalid(source, text, "does not fit in 64 bits"));
    ++i;
  }
  SMDDP_CHECK_VALUE(i > 0, invalid(source, text, rule));
  std::string unit = lower(text.substr(i));
  uint64_t scale = 1;
  if (unit == "k" || unit == "kib" || unit == "kb")
    scale = kKiB;
  else if (unit == "m" || unit == "mib" || unit == "mb")
    scale = kMiB;
  else if (unit == "g" || unit == "gib" || unit == "gb")
    scale = kGiB;
  else if (unit == "t" || unit == "tib" || unit == "tb")
    scale = kTiB;
  else
    SMDDP_CHECK_VALUE(unit.empty(), invalid(source, text, rule));
  const bool overflow = __builtin_mul_overflow(v, scale, &v) || v > uint64_t(INT64_MAX);
  SMDDP_CHECK_VALUE(!overflow, invalid(source, text, "does not fit in 63 bits"));
  return static_cast<int64_t>(v);
}

int64_t parse_count(const std::string& source, const std::string& text, int64_t hi) {
  size_t i = 0;
  int64_t v = 0;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i) {
    v = std::min<int64_t>(hi + 1, v * 10 + (text[i] - '0'));  // saturates above hi
  }
  SMDDP_CHECK_VALUE(i > 0 && i == text.size(),
                    invalid(source, text, "expected a whole number, digits only"));
  SMDDP_CHECK_VALUE(v <= hi, invalid(source, text, "must be at most " + std::to_string(hi)));
  return v;
}

bool parse_flag(const std::string& source, const std::string& text) {
  std::string t = lower(text);
  const bool on = t == "1" || t == "true" || t == "yes" || t == "on";
  const bool off = t == "0" || t == "false" || t == "no" || t == "off";
  SMDDP_CHECK_VALUE(on || off,
                    invalid(source, text, "expected 1 or 0 (true/false, yes/no, on/off)"));
  return on;
}

void in_range(const std::string& source, const std::string& text, int64_t v, int64_t lo, int64_t hi,
              bool zero_ok) {
  if (zero_ok && v == 0) return;
  auto fmt = [](int64_t b) {
    if (b >= kTiB && b % kTiB == 0) return std::to_string(b / kTiB) + "T";
    if (b >= kGiB && b % kGiB == 0) return std::to_string(b / kGiB) + "G";
    if (b >= kMiB && b % kMiB == 0) return std::to_string(b / kMiB) + "M";
    if (b >= kKiB && b % kKiB == 0) return std::to_string(b / kKiB) + "K";
    return std::to_string(b);
  };
  const bool or_zero = zero_ok && lo > 0;  // "0 or between 0 and ..." says it twice
  SMDDP_CHECK_VALUE(v >= lo && v <= hi, invalid(source, text,
                                                std::string("must be ") + (or_zero ? "0 or " : "") +
                                                    "between " + fmt(lo) + " and " + fmt(hi)));
}

void apply(Settings& s, const std::string& field, const std::string& source,
           const std::string& text) {
  auto bytes = [&](int64_t lo, int64_t hi, bool zero_ok) {
    int64_t v = parse_bytes(source, text);
    in_range(source, text, v, lo, hi, zero_ok);
    return static_cast<size_t>(v);
  };
  auto bytes_or_auto = [&](int64_t lo, int64_t hi, bool zero_ok) -> int64_t {
    if (lower(text) == "auto") return -1;
    return static_cast<int64_t>(bytes(lo, hi, zero_ok));
  };
  auto seconds = [&] {
    // A decimal number only: strtod alone would also take leading spaces and hex ("0x10").
    const bool decimal = !text.empty() &&
                         (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.') &&
                         text.find_first_not_of("0123456789.eE+-") == std::string::npos;
    char* end = nullptr;
    const double v = decimal ? std::strtod(text.c_str(), &end) : 0;
    SMDDP_CHECK_VALUE(decimal && !*end && std::isfinite(v) && v > 0,
                      invalid(source, text, "expected a positive number of seconds"));
    return v;
  };
  if (field == "buffer_bytes") {
    s.buffer_bytes = bytes(4 * kKiB, kGiB, false);
  } else if (field == "chunk_bytes") {
    int64_t v = bytes_or_auto(256, kGiB, false);
    s.chunk_bytes = v < 0 ? 0 : static_cast<size_t>(v);
  } else if (field == "oneshot_bytes") {
    s.oneshot_bytes = bytes(0, kGiB, true);
  } else if (field == "pool_bytes") {
    s.pool_bytes = bytes(0, kTiB, true);
  } else if (field == "p2p_bytes") {
    s.p2p_bytes = bytes(4 * kKiB, kGiB, true);
  } else if (field == "stream_bytes") {
    s.stream_bytes = bytes_or_auto(1, INT64_MAX, true);
  } else if (field == "spin_us") {
    s.spin_us = static_cast<int>(parse_count(source, text, 1000000));
  } else if (field == "worker_spin_us") {
    s.worker_spin_us = static_cast<int>(parse_count(source, text, 1000000));
  } else if (field == "move_off_cpu") {
    s.move_off_cpu = parse_flag(source, text);
  } else if (field == "force_local_size") {
    s.force_local_size = static_cast<int>(parse_count(source, text, 1 << 20));
  } else if (field == "socket_addr") {
    s.socket_addr = text;
  } else if (field == "socket_ifname") {
    s.socket_ifname = text;
  } else if (field == "net_chunk_bytes") {
    s.net_chunk_bytes = bytes(4 * kKiB, kGiB, false);
  } else if (field == "net_algo") {
    const std::string v = lower(text);
    SMDDP_CHECK_VALUE(
        v == "auto" || v == "mesh" || v == "ring" || v == "halving_doubling" || v == "tree",
        invalid(source, text, "expected auto, mesh, ring, halving_doubling or tree"));
    s.net_algo = v == "mesh"               ? NetAlgo::MESH
                 : v == "ring"             ? NetAlgo::RING
                 : v == "halving_doubling" ? NetAlgo::HALVING_DOUBLING
                 : v == "tree"             ? NetAlgo::TREE
                                           : NetAlgo::AUTO;
  } else if (field == "net_reduce_dtype") {
    const std::string v = lower(text);
    SMDDP_CHECK_VALUE(v == "auto" || v == "fp32", invalid(source, text, "expected auto or fp32"));
    s.net_reduce_fp32 = v == "fp32";
  } else if (field == "timeline") {
    s.timeline = parse_flag(source, text);
  } else if (field == "staging_chunk_bytes") {
    s.staging_chunk_bytes = bytes(4 * kKiB, kGiB, false);
  } else if (field == "staging_memory") {
    const std::string v = lower(text);
    SMDDP_CHECK_VALUE(v == "auto" || v == "pinned" || v == "pool",
                      invalid(source, text, "expected auto, pinned or pool"));
    s.staging_memory = v;
  } else if (field == "stage_cpu") {
    s.stage_cpu = parse_flag(source, text);
  } else if (field == "timeout") {
    s.timeout_s = seconds();
  } else if (field == "connect_attempt_timeout") {
    const double v = seconds();
    // At most the unreachable window (kUnreachableMs in transport/tcp/tcp_wire.h), which no
    // attempt outlasts.
    SMDDP_CHECK_VALUE(v >= 0.1 && v <= 60,
                      invalid(source, text, "must be between 0.1 and 60 seconds"));
    s.connect_attempt_s = v;
  }
}

}  // namespace

const std::vector<SettingInfo>& setting_table() { return kSettings; }

Settings resolve_settings(const std::map<std::string, std::string>& options, const EnvLookup& env) {
  for (const auto& kv : options) {
    bool known = false;
    for (const SettingInfo& info : kSettings) known = known || kv.first == info.field;
    SMDDP_CHECK_VALUE(known, "smddp: SMDDPOptions has no setting '", kv.first,
                      "' (see the settings table in docs/collectives.md)");
  }
  Settings s;
  for (const SettingInfo& info : kSettings) {
    auto opt = options.find(info.field);
    if (opt != options.end()) {
      apply(s, info.field, std::string("SMDDPOptions.") + info.field, opt->second);
      continue;
    }
    if (!*info.env) continue;
    const char* v = env ? env(info.env) : std::getenv(info.env);
    // An empty variable counts as unset, as a shell's `VAR= cmd` means.
    if (v && *v) apply(s, info.field, info.env, v);
  }
  SMDDP_CHECK_VALUE(s.socket_addr.empty() || s.socket_ifname.empty(), "smddp: SMDDP_SOCKET_ADDR (",
                    s.socket_addr, ") and SMDDP_SOCKET_IFNAME (", s.socket_ifname,
                    ") are both set; set one of them");
  return s;
}

std::map<std::string, std::string> describe(const Settings& s) {
  auto num = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  return {
      {"buffer_bytes", std::to_string(s.buffer_bytes)},
      {"chunk_bytes", s.chunk_bytes ? std::to_string(s.chunk_bytes) : "auto"},
      {"oneshot_bytes", std::to_string(s.oneshot_bytes)},
      {"pool_bytes", std::to_string(s.pool_bytes)},
      {"p2p_bytes", std::to_string(s.p2p_bytes)},
      {"stream_bytes", s.stream_bytes < 0 ? "auto" : std::to_string(s.stream_bytes)},
      {"spin_us", std::to_string(s.spin_us)},
      {"worker_spin_us", std::to_string(s.worker_spin_us)},
      {"move_off_cpu", s.move_off_cpu ? "1" : "0"},
      {"force_local_size", std::to_string(s.force_local_size)},
      {"socket_addr", s.socket_addr},
      {"socket_ifname", s.socket_ifname},
      {"net_chunk_bytes", std::to_string(s.net_chunk_bytes)},
      {"net_algo", s.net_algo == NetAlgo::MESH               ? "mesh"
                   : s.net_algo == NetAlgo::RING             ? "ring"
                   : s.net_algo == NetAlgo::HALVING_DOUBLING ? "halving_doubling"
                   : s.net_algo == NetAlgo::TREE             ? "tree"
                                                             : "auto"},
      {"net_reduce_dtype", s.net_reduce_fp32 ? "fp32" : "auto"},
      {"connect_attempt_timeout", num(s.connect_attempt_s)},
      {"timeline", s.timeline ? "1" : "0"},
      {"staging_chunk_bytes", std::to_string(s.staging_chunk_bytes)},
      {"staging_memory", s.staging_memory},
      {"stage_cpu", s.stage_cpu ? "1" : "0"},
      {"timeout", s.timeout_s > 0 ? num(s.timeout_s) : ""},
  };
}

std::vector<std::pair<std::string, std::string>> shared_settings(const Settings& s) {
  // Note [Settings every rank shares]: the fields, valued as describe() shows them.
  static const char* const kShared[] = {"buffer_bytes",    "pool_bytes", "chunk_bytes",
                                        "oneshot_bytes",   "p2p_bytes",  "force_local_size",
                                        "net_chunk_bytes", "net_algo",   "net_reduce_dtype"};
  const std::map<std::string, std::string> text = describe(s);
  std::vector<std::pair<std::string, std::string>> out;
  for (const SettingInfo& info : kSettings) {
    for (const char* field : kShared) {
      if (info.field == std::string(field)) out.emplace_back(info.env, text.at(field));
    }
  }
  return out;
}

}  // namespace smddp
