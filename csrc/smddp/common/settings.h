// The settings of the smddp backend: one table, read from the environment and from a
// group's options here and nowhere else.
//
// Note [Settings]
// Every setting has a field name (the attribute of torch_sagemaker.distributed.SMDDPOptions,
// passed as `pg_options`), an environment variable (SMDDP_*), a default and a rule. A group
// takes, per setting, its options' value, else the environment's, else the default; both
// sources go through the same strict parser, so "12x" or "-1" raise a ValueError naming the
// variable (or option), the value, the rule and a fix instead of being read as 12 or as
// 2^64 - 1. kSettings is also the source of the table in docs/collectives.md
// (torch_sagemaker.distributed.options.settings_markdown(); a unit test keeps them equal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace smddp {

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
  double timeout_s = 0;  // 0: the timeout c10d passes (init_process_group / new_group)
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

}  // namespace smddp
