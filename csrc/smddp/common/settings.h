// The settings of the smddp backend: one table, read from the environment and from a
// group's options here and nowhere else.
//
// Note [Settings]
// Every setting has a field name (the attribute of torch_sagemaker.smddp.SMDDPOptions,
// passed as `pg_options`), an environment variable (SMDDP_*), a default and a rule. A group
// takes, per setting, its options' value, else the environment's, else the default; both
// sources go through the same strict parser, so "12x" or "-1" raise a ValueError naming the
// variable (or option), the value, the rule and a fix instead of being read as 12 or as
// 2^64 - 1. kSettings is also the source of the table in docs/collectives.md
// (torch_sagemaker.smddp.options.settings_markdown(); a unit test keeps them equal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace smddp {

// How collectives cross hosts (Note [Rail rings] in algorithms/net_ring.cpp).
enum class NetAlgo { AUTO, MESH, RING, HALVING_DOUBLING, TREE };
constexpr size_t kNetAlgos = 5;

struct Settings {
  size_t buffer_bytes = 1 << 20;
  size_t chunk_bytes = 0;          // 0: automatic (see ShmComm)
  size_t oneshot_bytes = 4 << 10;  // Note [One-shot threshold] in shm_algos.h
  size_t pool_bytes = size_t(1) << 30;
  // 1 MiB + 64 KiB: a 1 MiB message fits with its header, so it is written by the caller
  // instead of streamed through the send lane (2-rank 1 MiB exchange: 254-334 -> 86-92 us).
  size_t p2p_bytes = (1 << 20) + (64 << 10);
  int64_t stream_bytes = -1;  // -1: automatic (see ShmComm::stream_output)
  int spin_us = 200;
  int worker_spin_us = 20;
  int force_local_size = 0;  // 0: hosts as they are
  bool move_off_cpu = false;
  std::string socket_addr;  // "": see socket_ifname, else the first non-loopback address
  std::string socket_ifname;
  // Note [Pipelined exchanges] in comm_hier.cpp: 512K measured best (bench multihost).
  size_t net_chunk_bytes = 512 << 10;
  NetAlgo net_algo = NetAlgo::AUTO;
  // bf16/fp16 partial sums cross hosts in fp32 instead of their own type (Note [Half
  // precision on the wire] in algorithms/net_algorithm.h).
  bool net_reduce_fp32 = false;
  bool timeline = false;  // Note [Timeline] in timeline.h
  double timeout_s = 0;   // 0: the timeout c10d passes (init_process_group / new_group)
  // One connection attempt to another rank over TCP waits this long for the network's answer
  // (Note [Admission] in transport/tcp/tcp.h).
  double connect_attempt_s = 20;
  // Device tensors (Note [Device staging] in device_staging.h).
  size_t staging_chunk_bytes = 4 << 20;
  std::string staging_memory = "auto";  // "auto", "pinned" or "pool"
  bool stage_cpu = false;               // CPU tensors take the staging path too (tests)
};

// One row of the table.
struct SettingInfo {
  const char* field;     // SMDDPOptions attribute
  const char* env;       // environment variable
  const char* kind;      // "bytes", "bytes or auto", "microseconds", "count", "flag", "address",
                         // "name", "seconds"
  const char* fallback;  // the default, as the docs show it
  const char* meaning;
};
const std::vector<SettingInfo>& setting_table();

// Looks up an environment variable; nullptr when unset.
using EnvLookup = std::function<const char*(const char*)>;

// The settings of one group: `options` (field -> value as text, from SMDDPOptions) over the
// environment (read through `env`, default: getenv) over the defaults. Throws
// std::invalid_argument for an unknown field or a value that breaks its rule.
Settings resolve_settings(const std::map<std::string, std::string>& options,
                          const EnvLookup& env = {});

// The settings as text, field -> value (what a group resolved; for tests and messages).
std::map<std::string, std::string> describe(const Settings& s);

// Note [Settings every rank shares]
// The algorithms' choices (one-shot or two-step, chunk and buffer sizes, the point-to-point
// rings, the pool, the host grouping) follow from some settings, and ranks that chose
// differently read each other's buffers at the wrong places: a 16-element all-reduce with
// SMDDP_ONESHOT_BYTES=0 on one rank only gave wrong sums, and a different SMDDP_CHUNK_BYTES
// wrong reduce-scatters and then a hang. So every rank publishes these in its peer record
// when a group is created, and a difference fails the creation on every rank, naming the
// variable and both values. The automatic chunk size depends on whether the host's ranks
// outnumber its CPUs; each rank's affinity mask may differ, so the record also carries the
// rank's CPU count and every rank decides with the host's smallest. The other settings
// (spin budgets, streaming stores, staging, the socket address) are each rank's own.
//
// shared_settings: those settings, as (environment variable, value).
std::vector<std::pair<std::string, std::string>> shared_settings(const Settings& s);

}  // namespace smddp
