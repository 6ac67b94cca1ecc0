// Groups that listen for TCP connections share one acceptor thread per process (Acceptor in
// transport/tcp/tcp.cpp; Note [One transport per process] in backend/work.h).
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "smddp/transport/tcp/tcp.h"

using smddp::Communicator;
using smddp_test::run_group;

namespace {

int threads_of_this_process() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Threads of this process while `groups` groups of 3 ranks, each rank its own "host", are
// connected at once (one thread runs each group, one thread each rank, plus the shared ones).
int threads_with_tcp_groups(int groups) {
  std::mutex mu;
  std::condition_variable cv;
  int connected = 0, counted = -1;
  std::vector<std::thread> runners;
  for (int g = 0; g < groups; ++g) {
    runners.emplace_back([&, g] {
      smddp::CommConfig cfg;
      cfg.group_name = "acceptor_" + std::to_string(groups) + "_" + std::to_string(g);
      cfg.timeout_s = 60;
      cfg.settings.force_local_size = 1;
      cfg.settings.socket_addr = "127.0.0.1";
      cfg.settings.pool_bytes = 0;
      run_group(3, cfg, [&](Communicator& c, int rank) {
        c.barrier(c.make_ctx("barrier", smddp::CollDesc{}, smddp::OpArgs{}, 0));
        std::unique_lock<std::mutex> lk(mu);
        ++connected;
        cv.notify_all();
        if (connected == 3 * groups) counted = threads_of_this_process();
        cv.wait_for(lk, std::chrono::seconds(30), [&] { return counted >= 0; });
      });
    });
  }
  for (auto& t : runners) t.join();
  return counted;
}

}  // namespace

// Each group adds its runner and rank threads and nothing else: no listener thread of its
// own. (Before the shared acceptor, every listening group added one thread.)
TEST_CASE(tcp_groups_share_one_acceptor_thread) {
  const int with2 = threads_with_tcp_groups(2);
  const int with6 = threads_with_tcp_groups(6);
  EXPECT(with2 > 0 && with6 > 0, "thread counts ", with2, " and ", with6);
  EXPECT(with6 - with2 == 4 * (1 + 3), "4 more groups added ", with6 - with2,
         " threads; their runner and rank threads are 16");
}

// Note [Admission] (transport/tcp/tcp.h): more real peers than the listener keeps unadmitted
// handshakes (kMaxHandshakes, 64) connect to it at once, and every one gets in. Before,
// the listener dropped the oldest handshake for each one beyond 64, and a dropped rank
// failed with "refused our credentials".
TEST_CASE(more_peers_than_the_handshake_cap_connect_at_once) {
  constexpr int kRanks = 80;
  smddp::CommConfig cfg;
  cfg.group_name = "acceptor_many_peers";
  cfg.timeout_s = 120;
  cfg.settings.force_local_size = 1;
  cfg.settings.socket_addr = "127.0.0.1";
  cfg.settings.pool_bytes = 0;
  run_group(kRanks, cfg, [&](Communicator& c, int rank) {
    // Every rank sends its byte to rank 0 at once: 79 connections reach one listener.
    char mine = static_cast<char>(rank);
    std::vector<char> got(kRanks, -1);
    std::vector<char*> outs;
    for (int r = 0; r < kRanks; ++r) outs.push_back(rank == 0 ? &got[r] : nullptr);
    smddp::CollDesc d;
    d.count = 1;
    d.extra = 1;  // root 0
    smddp::OpArgs a;
    a.root = 0;
    c.gather(&mine, 1, rank == 0 ? outs : std::vector<char*>(), 0, c.make_ctx("gather", d, a, 0));
    if (rank == 0) {
      for (int r = 0; r < kRanks; ++r) EXPECT(got[r] == static_cast<char>(r), "part ", r);
    }
  });
}

// A peer's mesh record names its listener by a numeric IPv4 address (listen() resolves any
// name on its own host), so connecting never calls a name resolver, whose temporary failures
// (EAI_AGAIN) would otherwise fail a connection. A record with a name or a bad port is
// refused when the group learns its peers, naming the rank and the record.
TEST_CASE(mesh_records_are_numeric_addresses) {
  smddp::TcpMesh mesh(0, 3, "secret", "records");
  mesh.set_peers({"", "127.0.0.1|5000", "10.9.0.2|65535"});  // rank 0: itself, no record
  EXPECT_THROW_WITH(mesh.set_peers({"", "localhost|5000", "10.9.0.2|1"}),
                    "malformed mesh record of rank 1", "'localhost|5000'", "IPv4-address|port");
  EXPECT_THROW_WITH(mesh.set_peers({"", "127.0.0.1|5000", "10.9.0.2|0"}),
                    "malformed mesh record of rank 2", "'10.9.0.2|0'");
  EXPECT_THROW_WITH(mesh.set_peers({"", "127.0.0.1|5000", "10.9.0.2"}),
                    "malformed mesh record of rank 2");
}
