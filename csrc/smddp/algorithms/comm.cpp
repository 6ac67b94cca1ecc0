// Communicator set-up: secret and nonce, host discovery, TCP listener, shm segments.
#include "smddp/algorithms/comm.h"

#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include "smddp/algorithms/shm_algos.h"
#include "smddp/transport/shm/shm_names.h"

namespace smddp {
namespace {

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  if (getrandom(raw.data(), bytes, 0) != static_cast<ssize_t>(bytes)) {
    throw CommError("smddp: getrandom() failed");
  }
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// Processes share /dev/shm only on the same machine, boot and IPC namespace.
std::string real_host_id() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/ipc", ns, sizeof(ns) - 1);
  if (n < 0) n = 0;
  return std::string(name) + "/" + read_first_line("/proc/sys/kernel/random/boot_id") + "/" +
         std::string(ns, static_cast<size_t>(n));
}

// This process's CPU affinity mask in hex, CPUs 4k..4k+3 in the k-th digit (least significant
// bit first), trailing zero digits dropped; "" when it cannot be read.
std::string cpu_mask_hex() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "";
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu += 4) {
    int d = 0;
    for (int b = 0; b < 4; ++b) d |= CPU_ISSET(cpu + b, &set) ? 1 << b : 0;
    out.push_back(digits[d]);
  }
  while (!out.empty() && out.back() == '0') out.pop_back();
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

// Waits until every key of `keys` (indexed by group rank) exists; names the missing ranks
// when the deadline passes.
void wait_keys(KeyValue& kv, const std::vector<std::string>& keys, const std::vector<int>& ranks,
               const Deadline& dl, const std::string& what,
               const std::function<void()>& health = {}) {
  std::vector<uint8_t> seen(keys.size(), 0);
  auto pause = std::chrono::microseconds(200);
  while (true) {
    if (health) health();
    bool all = true;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!seen[i]) seen[i] = kv.check(keys[i]) ? 1 : 0;
      all = all && seen[i];
    }
    if (all) return;
    if (dl.expired()) {
      std::vector<int> missing;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!seen[i]) missing.push_back(ranks[i]);
      }
      char secs[32];
      snprintf(secs, sizeof(secs), "%.1f", dl.seconds);
      throw CommError(what + " timed out after " + secs + " s (the timeout of this group): ranks " +
                      format_ranks(missing) + " never arrived");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

// Note [Step buffer minimum] in shm_algos.h: refuses a step buffer too small for the group,
// naming the setting, the minimum and the fix. Every rank computes it from the same records
// (the most ranks any host has), so every rank of the group raises, before any segment exists.
void check_buffer_bytes(const std::string& group, size_t requested,
                        const std::vector<std::vector<int>>& members, size_t group_size) {
  size_t most_local = 0;
  for (const auto& m : members) most_local = std::max(most_local, m.size());
  const char* what = "SMDDP_BUFFER_BYTES rounded to pages";
  const size_t buffer = round_up(requested, 4096, what);  // as setup_shm sizes the segments
  const size_t least = shm::min_buffer_bytes(most_local, group_size);
  if (buffer >= least) return;
  const std::string rounded =
      buffer == requested ? "" : " (" + std::to_string(buffer) + " once rounded up to pages)";
  throw std::invalid_argument(
      "smddp: creating group '" + group + "': SMDDP_BUFFER_BYTES (SMDDPOptions buffer_bytes) is " +
      std::to_string(requested) + " bytes" + rounded + ", too small for a group of " +
      std::to_string(group_size) + " ranks with " + std::to_string(most_local) +
      " on one host: each shared-memory step buffer needs at least " + std::to_string(least) +
      " bytes (" + std::to_string(shm::kScatterSlotMin) + " per rank on the host and " +
      std::to_string(shm::kLargestElement) +
      " per rank of the group, whichever is more); set SMDDP_BUFFER_BYTES to " +
      std::to_string(round_up(least, 4096, what)) +
      " or more, alike on every rank (the default is 1M)");
}

}  // namespace

// Note [Hosts that share CPUs]
// A rank of a shared-memory group spins while it waits for a local peer unless the group's
// ranks outnumber their CPUs (ShmComm's oversubscribed policy: yield, then sleep). Ranks of
// other hosts usually have CPUs of their own, but hosts may also be containers or network
// namespaces of one machine: the simulated hosts of bench multihost and the tests, or pods
// of one node. Their ranks then take turns on the same CPUs, and a spinning rank takes a
// core from a rank of the other host that this very collective waits for: on 2 simulated
// hosts of 2 ranks on 2 cores, one host's ranks started a 16 MiB reduce_scatter a scheduler
// slice (3-4 ms) after the other's (bench multihost --timeline). So the ranks of the group
// on this machine (one kernel: the same boot_id) are counted against the CPUs they may run
// on (the union of their affinity masks), whatever host they belong to. Every rank of a host
// reads the same records and so makes the same choice, which the automatic chunk size
// needs. Ranks of other groups on the machine are not seen: this errs toward the spin, as
// before. Measured at 2 Gbit/s (cubic; six alternating rounds, medians of the fraction of
// the NIC bound, counting from before to after): 2x2 reduce_scatter 1, 16 and 64 MiB 0.80,
// 0.85 and 0.94 -> 0.85, 0.94 and 0.94; all_reduce 0.80, 0.93 and 0.95 -> 0.88, 0.94 and
// 0.94; all_gather 0.86, 0.92 and 0.94 -> 0.93, 0.94 and 0.94; the bare-TCP ceiling of the
// same jobs 0.95 from 16 MiB either way. 4x2 (the ring, seven rounds from 16 MiB): level,
// 0.91-0.95 before and after.
bool ranks_outnumber_cpus(const std::vector<std::string>& boot_ids,
                          const std::vector<std::string>& masks, const std::string& my_boot) {
  if (my_boot.empty()) return false;
  int ranks = 0;
  std::string cpus;  // the union, one hex digit's value (0-15) per 4 CPUs
  for (size_t r = 0; r < boot_ids.size(); ++r) {
    if (boot_ids[r] != my_boot) continue;
    ++ranks;
    const std::string& m = masks[r];
    if (cpus.size() < m.size()) cpus.resize(m.size(), 0);
    for (size_t k = 0; k < m.size(); ++k) {
      const char ch = m[k];
      const int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : 0;
      cpus[k] = static_cast<char>(cpus[k] | v);
    }
  }
  int n_cpus = 0;
  for (char v : cpus) n_cpus += __builtin_popcount(static_cast<unsigned>(v));
  return n_cpus > 0 && ranks > n_cpus;
}

Communicator::Communicator(KeyValue& kv, CommConfig cfg) : cfg_(std::move(cfg)) {
  if (cfg_.global_ranks.empty()) {
    for (int i = 0; i < cfg_.size; ++i) cfg_.global_ranks.push_back(i);
  }
  Deadline dl = Deadline::after(cfg_.timeout_s);
  oneshot_bytes_ = cfg_.settings.oneshot_bytes;
  timeline_.enable(cfg_.settings.timeline);
  const std::string creating = "smddp: creating group '" + cfg_.group_name + "'";
  // Rank 0 of the group draws the shm nonce and the mesh secret; the store distributes them
  // (Note [TCP trust model] in tcp.h).
  if (cfg_.rank == 0) kv.set("smddp/keys", random_hex(16) + ":" + random_hex(32));
  wait_keys(kv, {"smddp/keys"}, {cfg_.global_ranks[0]}, dl, creating);
  auto keys = split(kv.get("smddp/keys"), ':');
  nonce_ = keys.at(0);
  secret_ = keys.at(1);
  net_ = make_transport(cfg_.rank, cfg_.size, secret_, cfg_.group_name);
  discover(kv, dl);
  // Every rank read the keys before it published its peer record: nobody needs them now.
  // Some stores cannot delete (FileStore); the key then stays (Note [TCP trust model]).
  if (cfg_.rank == 0) {
    try {
      kv.remove("smddp/keys");
    } catch (const std::exception&) {
    }
  }
  connect_mesh(kv, dl);
  setup_shm(kv, dl);
}

Communicator::~Communicator() {
  if (net_) net_->shutdown();
}

void Communicator::discover(KeyValue& kv, const Deadline& dl) {
  const std::string real = real_host_id();
  std::string host = real;
  const int forced = cfg_.settings.force_local_size;
  if (forced > 0) {
    host += "/forced-" + std::to_string(cfg_.global_ranks[cfg_.rank] / forced);
    layout_.forced = true;
  }
  if (!cfg_.force_hosts.empty()) {
    SMDDP_CHECK(cfg_.force_hosts.size() == static_cast<size_t>(cfg_.size),
                "smddp: force_hosts must name a host for every group rank");
    host += "/host-" + std::to_string(cfg_.force_hosts[cfg_.rank]);
    layout_.forced = true;
  }
  const size_t p2p = cfg_.settings.p2p_bytes;
  // Note [Settings every rank shares]: the record carries them, and this rank's CPU count.
  const auto shared = shared_settings(cfg_.settings);
  std::ostringstream me;
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  me << host << "|" << real << "|" << pid_namespace_id() << "|" << getpid() << "|" << online_cpus()
     << "|" << boot << "|" << cpu_mask_hex();
  for (const auto& [name, value] : shared) me << "|" << name << "=" << value;
  kv.set("smddp/peer/" + std::to_string(cfg_.rank), me.str());
  std::vector<std::string> keys;
  for (int r = 0; r < cfg_.size; ++r) keys.push_back("smddp/peer/" + std::to_string(r));
  wait_keys(kv, keys, cfg_.global_ranks, dl, "smddp: creating group '" + cfg_.group_name + "'");

  std::map<std::string, int> host_index;
  peers_.resize(cfg_.size);
  constexpr size_t kFields = 7;  // before the shared settings
  std::vector<std::string> boot_ids(cfg_.size), masks(cfg_.size);
  for (int r = 0; r < cfg_.size; ++r) {
    const std::string record = kv.get(keys[r]);
    auto f = split(record, '|');
    if (f.size() != kFields + shared.size()) {
      throw CommError("smddp: malformed peer record of rank " + std::to_string(r));
    }
    peers_[r].real_host = f[1];
    peers_[r].pid_ns = f[2];
    // The pid decides whether the peer is alive during set-up (check_local_peers_alive):
    // unlike the CPU count below, a wrong one has no safe default, so it raises.
    char* end = nullptr;
    errno = 0;
    const long pid = std::strtol(f[3].c_str(), &end, 10);
    if (f[3].empty() || *end || errno || pid < 1 || pid > INT_MAX) {
      throw CommError("smddp: creating group '" + cfg_.group_name + "': the peer record of rank " +
                      std::to_string(cfg_.global_ranks[r]) + " (store key " + keys[r] +
                      ") has the process id '" + f[3] + "', not a positive integer: '" + record +
                      "' (every rank must run the same version of smddp, and nothing else may "
                      "write the store's smddp/ keys of this group)");
    }
    peers_[r].pid = static_cast<int>(pid);
    // strtol saturates where atoi is undefined; a CPU count outside [1, 1M] is treated as 1.
    const long cpus = std::strtol(f[4].c_str(), nullptr, 10);
    peers_[r].cpus = cpus >= 1 && cpus <= (1 << 20) ? static_cast<int>(cpus) : 1;
    boot_ids[r] = f[5];
    // A CPU mask longer than CPU_SETSIZE CPUs, or not hex, is read as unknown.
    const bool hex = f[6].find_first_not_of("0123456789abcdef") == std::string::npos;
    masks[r] = hex && f[6].size() <= CPU_SETSIZE / 4 ? f[6] : "";
    for (size_t k = 0; k < shared.size(); ++k) {
      const std::string mine = shared[k].first + "=" + shared[k].second;
      if (f[kFields + k] == mine) continue;
      throw std::invalid_argument(
          "smddp: creating group '" + cfg_.group_name + "': rank " +
          std::to_string(cfg_.global_ranks[r]) + " has " + f[kFields + k] + " but rank " +
          std::to_string(cfg_.global_ranks[cfg_.rank]) + " has " + mine +
          "; every rank of a group must use the same value (set it alike for every rank, in "
          "the launcher's environment or the group's SMDDPOptions)");
    }
    auto it = host_index.find(f[0]);
    if (it == host_index.end()) {
      it = host_index.emplace(f[0], static_cast<int>(layout_.members.size())).first;
      layout_.members.emplace_back();
    }
    layout_.members[it->second].push_back(r);
  }
  // Unequal hosts keep their hierarchy (Note [Unequal hosts] in comm_hier.cpp).
  size_t l0 = layout_.members[0].size();
  for (const auto& m : layout_.members) layout_.uniform = layout_.uniform && m.size() == l0;
  layout_.hosts = static_cast<int>(layout_.members.size());
  for (int h = 0; h < layout_.hosts; ++h) {
    const auto& m = layout_.members[h];
    for (int l = 0; l < static_cast<int>(m.size()); ++l) {
      if (m[l] == cfg_.rank) {
        layout_.host = h;
        layout_.local_rank = l;
      }
    }
  }
  layout_.local_size = static_cast<int>(layout_.members[layout_.host].size());
  check_buffer_bytes(cfg_.group_name, cfg_.settings.buffer_bytes, layout_.members,
                     static_cast<size_t>(cfg_.size));
  plan_handlers();
  p2p_bytes_ = layout_.local_size > 1 ? p2p : 0;
  local_cpus_ = 0;
  for (int r : layout_.members[layout_.host]) {
    local_cpus_ = local_cpus_ ? std::min(local_cpus_, peers_[r].cpus) : peers_[r].cpus;
  }
  machine_oversubscribed_ = ranks_outnumber_cpus(boot_ids, masks, boot);
}

void Communicator::connect_mesh(KeyValue& kv, const Deadline& dl) {
  // Note [TCP connections]: a listener only where a peer will connect, on the address the
  // peers use: this host's interface across hosts, loopback for point-to-point messages
  // inside a host without shared-memory rings.
  const bool needed = layout_.hosts > 1 || (layout_.local_size > 1 && p2p_bytes_ == 0);
  if (!needed) return;
  const std::string endpoint = net_->listen(layout_.hosts > 1, cfg_.settings);
  kv.set("smddp/endpoint/" + std::to_string(cfg_.rank), endpoint);
  std::vector<std::string> keys;
  for (int r = 0; r < cfg_.size; ++r) keys.push_back("smddp/endpoint/" + std::to_string(r));
  wait_keys(kv, keys, cfg_.global_ranks, dl, "smddp: creating group '" + cfg_.group_name + "'");
  std::vector<std::string> endpoints;
  for (const auto& key : keys) endpoints.push_back(kv.get(key));
  net_->set_peers(endpoints);
}

void Communicator::check_local_peers_alive(const std::string& what) {
  // Set-up waits for the local peers through the store; one that died in the meantime
  // (killed during set-up) would otherwise be waited for until the timeout, and its
  // segment would stay in /dev/shm (Note [Segment lifetime] in shm.h).
  auto now = Clock::now();
  if (now - last_setup_check_ < std::chrono::milliseconds(20)) return;
  last_setup_check_ = now;
  const std::string& ns = pid_namespace_id();
  for (int r : layout_.members[layout_.host]) {
    const PeerInfo& p = peers_[r];
    if (r == cfg_.rank || p.real_host != peers_[cfg_.rank].real_host || p.pid_ns != ns ||
        ns.empty())
      continue;
    if (process_alive(p.pid)) continue;
    sweep_dead_segments();
    throw CommError(what + " failed: rank " + std::to_string(cfg_.global_ranks[r]) + " (pid " +
                    std::to_string(p.pid) + ") exited during set-up");
  }
}

void Communicator::setup_shm(KeyValue& kv, const Deadline& dl) {
  ShmConfig sc;
  sc.nonce = nonce_ + "_" + std::to_string(layout_.host);
  sc.group_name = cfg_.group_name;
  sc.local_rank = layout_.local_rank;
  sc.group_ranks = layout_.members[layout_.host];
  const Settings& set = cfg_.settings;
  sc.buffer_bytes = round_up(set.buffer_bytes, 4096, "SMDDP_BUFFER_BYTES rounded to pages");
  sc.chunk_bytes = set.chunk_bytes;
  sc.stream_bytes = set.stream_bytes;
  sc.spin_us = set.spin_us;
  sc.worker_spin_us = set.worker_spin_us;
  sc.spin_adapts = layout_.hosts > 1;
  sc.move_off_cpu = set.move_off_cpu;
  sc.cpus = local_cpus_;
  sc.machine_oversubscribed = machine_oversubscribed_;
  // Tensor pools (Note [Zero-copy operands] in shm_algos.h): on one host the collectives
  // read every operand in place; across hosts a host's ranks read each other's pooled
  // operands in their local steps (Note [Read from the pool]), which needs local peers. The
  // region is sparse until used, so the default is generous.
  if (layout_.hosts == 1 || layout_.local_size > 1) {
    sc.pool_bytes = round_up(set.pool_bytes, 4096, "SMDDP_POOL_BYTES rounded to pages");
  }
  zero_copy_ = sc.pool_bytes > 0;
  // Point-to-point rings (Note [Shared-memory point-to-point]); sparse until a pair talks.
  sc.p2p_bytes = round_up(p2p_bytes_, 4096, "SMDDP_P2P_BYTES rounded to pages");
  shm_ = std::make_unique<ShmComm>(sc);
  const auto& local = layout_.members[layout_.host];
  std::vector<int> local_global;
  for (int r : local) local_global.push_back(cfg_.global_ranks[r]);
  auto key = [&](const char* what, int r) {
    return std::string("smddp/") + what + "/" + std::to_string(r);
  };
  std::vector<std::string> created, attached;
  for (int r : local) {
    created.push_back(key("shm", r));
    attached.push_back(key("attached", r));
  }
  const std::string creating = "smddp: creating group '" + cfg_.group_name + "'";
  auto alive = [&] { check_local_peers_alive(creating); };
  // Create mine, wait for the local peers' segments, map them, and unlink mine once every
  // local peer mapped it (Note [Segment lifetime]). Any failure unlinks mine first.
  shm_->create();
  try {
    kv.set(key("shm", cfg_.rank), shm_->name());
    wait_keys(kv, created, local_global, dl, creating, alive);
    for (int l = 0; l < static_cast<int>(local.size()); ++l) {
      if (local[l] != cfg_.rank) shm_->attach(l, kv.get(created[l]));
    }
    kv.set(key("attached", cfg_.rank), "1");
    wait_keys(kv, attached, local_global, dl, creating, alive);
  } catch (...) {
    shm_->unlink_own();
    throw;
  }
  shm_->unlink_own();
  if (sc.p2p_bytes) p2p_ = std::make_unique<ShmP2P>(*shm_);
}

OpCtx Communicator::make_ctx(const char* name, CollDesc desc, OpArgs args, double timeout_s) {
  OpCtx ctx;
  ctx.name = name;
  ctx.desc = desc;
  ctx.desc.kind = hash_name(name);
  ctx.args = args;
  ctx.deadline = Deadline::after(timeout_s > 0 ? timeout_s : cfg_.timeout_s);
  return ctx;
}

// Note [Abort tells the peers]
// An abort fails this rank's calls in flight (the transports' flags), and the work queued
// behind them never starts (Note [Abort fails the queued work] in scheduler.cpp), so nothing of
// this rank reports the failure to its peers from inside a collective. A peer waiting in,
// or later entering, a collective of the group then waited for the whole group timeout (on
// one host; across hosts the closed sockets told it). So the abort itself marks the group
// failed, as any failure does (Note [Failure notices]): the peers' collectives on it fail
// at once, naming the rank that aborted. That comes after net_->abort(), so the notices to
// peers this rank has no connection to yet connect in spite of the abort (Note [Failure
// notices] in tcp.h).
void Communicator::abort() {
  shm_->abort();
  net_->abort();
  mark_broken(CommError("smddp: group '" + cfg_.group_name + "' was aborted on rank " +
                        std::to_string(cfg_.global_ranks[cfg_.rank]) + " (_abort_process_group)"));
}

}  // namespace smddp
