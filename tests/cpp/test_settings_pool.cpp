// Settings parsing, the tensor pool allocator and the segment names/sweep.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "harness.h"
#include "smddp/common/settings.h"
#include "smddp/transport/shm/shm_names.h"
#include "smddp/transport/shm/shm_pool.h"

namespace smddp_test {
namespace {

smddp::EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

}  // namespace

TEST_CASE(settings_parse_and_reject) {
  using smddp::resolve_settings;
  smddp::Settings s = resolve_settings({}, env_of({}));
  EXPECT(s.buffer_bytes == (1u << 20) && s.chunk_bytes == 0 && s.stream_bytes == -1, "defaults");
  s = resolve_settings({{"buffer_bytes", "64K"}}, env_of({{"SMDDP_BUFFER_BYTES", "2M"},
                                                          {"SMDDP_POOL_BYTES", "0"},
                                                          {"SMDDP_CHUNK_BYTES", "auto"},
                                                          {"SMDDP_MOVE_OFF_CPU", "yes"},
                                                          {"SMDDP_SPIN_US", ""}}));
  EXPECT(s.buffer_bytes == 64u << 10, "options win over the environment: ", s.buffer_bytes);
  EXPECT(s.pool_bytes == 0 && s.chunk_bytes == 0 && s.move_off_cpu && s.spin_us == 200,
         "environment values (an empty variable is unset)");
  EXPECT_THROW_WITH(resolve_settings({}, env_of({{"SMDDP_BUFFER_BYTES", "12x"}})),
                    "SMDDP_BUFFER_BYTES=12x is invalid", "expected a byte count");
  EXPECT_THROW_WITH(resolve_settings({}, env_of({{"SMDDP_POOL_BYTES", "-1"}})),
                    "SMDDP_POOL_BYTES=-1 is invalid");
  EXPECT_THROW_WITH(resolve_settings({}, env_of({{"SMDDP_BUFFER_BYTES", "99999999999999999999"}})),
                    "does not fit in 64 bits");
  EXPECT_THROW_WITH(resolve_settings({}, env_of({{"SMDDP_BUFFER_BYTES", "8589934592G"}})),
                    "does not fit in 63 bits");
  EXPECT_THROW_WITH(resolve_settings({{"chunk_bytes", "12"}}, env_of({})),
                    "SMDDPOptions.chunk_bytes=12 is invalid", "between 256 and 1G");
  EXPECT_THROW_WITH(resolve_settings({{"spin_us", "1000001"}}, env_of({})),
                    "must be at most 1000000");
  EXPECT_THROW_WITH(resolve_settings({{"move_off_cpu", "maybe"}}, env_of({})), "expected 1 or 0");
  EXPECT_THROW_WITH(resolve_settings({{"timeout", "nan"}}, env_of({})),
                    "expected a positive number of seconds");
  EXPECT_THROW_WITH(resolve_settings({{"bufer_bytes", "1M"}}, env_of({})),
                    "SMDDPOptions has no setting 'bufer_bytes'");
  EXPECT_THROW_WITH(resolve_settings({}, env_of({{"SMDDP_SOCKET_ADDR", "127.0.0.1"},
                                                 {"SMDDP_SOCKET_IFNAME", "lo"}})),
                    "are both set");
  // Every row of the table round-trips through describe().
  auto described = smddp::describe(resolve_settings({}, env_of({})));
  for (const auto& info : smddp::setting_table()) {
    EXPECT(described.count(info.field) == 1, "describe() lacks ", info.field);
  }
}

TEST_CASE(pool_allocates_reuses_and_coalesces) {
  const size_t bytes = 1 << 20;
  int fd = memfd_create("smddp_pool_test", 0);
  EXPECT(fd >= 0, "memfd_create failed");
  if (fd < 0) return;
  EXPECT(ftruncate(fd, bytes) == 0);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT(base != MAP_FAILED);
  if (base == MAP_FAILED) return;
  smddp::ShmPool pool(fd, 0, static_cast<char*>(base), bytes);  // owns fd and the mapping
  void* a = pool.allocate(1);
  void* b = pool.allocate(1000);
  void* c = pool.allocate(300 << 10);
  EXPECT(a && b && c, "allocations failed");
  EXPECT(reinterpret_cast<uintptr_t>(b) % smddp::ShmPool::kAlign == 0, "unaligned");
  EXPECT(pool.in_use() == 256 + 1024 + (300 << 10), "in use: ", pool.in_use());
  EXPECT(pool.offset_of(b, 1000) == 256, "offset ", pool.offset_of(b, 1000));
  EXPECT(pool.offset_of(b, bytes) == -1, "a range past the end is not in the pool");
  int outside = 0;
  EXPECT(pool.offset_of(&outside, 4) == -1);
  EXPECT(pool.allocate(bytes) == nullptr, "more than is left");
  std::memset(c, 1, 300 << 10);  // committed pages are writable
  pool.release(b);
  pool.release(a);
  EXPECT(pool.allocate(1280) == a, "the coalesced first block is reused");
  pool.release(a);
  pool.release(c);
  pool.release(c);  // a second release of the same block is ignored
  EXPECT(pool.in_use() == 0, "in use: ", pool.in_use());
  EXPECT(pool.allocate(bytes) == base, "everything coalesced into one block");
}

TEST_CASE(segment_names_and_dead_creator_sweep) {
  const std::string name = smddp::segment_name("feedc0de", "0_1");
  const std::string ns = smddp::pid_namespace_id();
  EXPECT(name == "/smddp_" + (ns.empty() ? std::string("0") : ns) + "_" + std::to_string(getpid()) +
                     "_feedc0de_0_1",
         name);
  EXPECT(smddp::process_alive(getpid()));
  // A child that exited and was reaped is dead; a segment named after it is swept, one
  // named after this live process is not.
  pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT(!smddp::process_alive(child), "reaped child ", child, " counts as alive");
  if (ns.empty()) return;  // liveness cannot be judged: the sweep does nothing
  const std::string dead = "/smddp_" + ns + "_" + std::to_string(child) + "_sweeptest_0";
  const std::string live = smddp::segment_name("sweeptest", "0");
  for (const auto& n : {dead, live}) {
    int fd = shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT(fd >= 0, "cannot create ", n);
    if (fd >= 0) close(fd);
  }
  EXPECT(smddp::sweep_dead_segments() >= 1);
  EXPECT(access(("/dev/shm" + dead).c_str(), F_OK) != 0, dead, " survived the sweep");
  EXPECT(access(("/dev/shm" + live).c_str(), F_OK) == 0, live, " was swept");
  shm_unlink(live.c_str());
  shm_unlink(dead.c_str());
}

}  // namespace smddp_test
