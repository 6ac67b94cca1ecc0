// The TCP mesh on its own (transport/tcp/tcp.h), two ranks in one process over loopback: what
// a failed exchange leaves on its connections.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "smddp/transport/tcp/tcp.h"

using smddp::CommError;
using smddp::TcpMesh;
using smddp::TransportOp;
using smddp_test::seconds_since;
using std::chrono::steady_clock;

namespace {

smddp::OpCtx ctx_for(const char* name, double timeout_s) {
  smddp::OpCtx ctx;
  ctx.name = name;
  ctx.deadline = smddp::Deadline::after(timeout_s);
  return ctx;
}

// Ranks 0 and 1 of a group named `group`, listening on loopback and knowing each other.
struct Pair {
  explicit Pair(const std::string& group) : a(0, 2, "secret", group), b(1, 2, "secret", group) {
    smddp::Settings settings;
    std::vector<std::string> endpoints = {a.listen(false, settings), b.listen(false, settings)};
    a.set_peers(endpoints);
    b.set_peers(endpoints);
  }
  TcpMesh a, b;
};

}  // namespace

// Note [A failed exchange's frames] (tcp_exchange.cpp): an exchange that fails (here its
// health check) while a message for its receive is half read leaves that connection unusable.
// Before, the next read of it (a receive waiting side by side, TcpMesh::take) wrote the rest of
// the message into the failed call's buffer, which its caller may have freed.
TEST_CASE(a_failed_exchange_leaves_no_message_arriving_into_its_buffer) {
  Pair p("failed_exchange");
  const size_t n = size_t(64) << 20;  // more than the socket buffers hold
  std::vector<char> src(n, 'x'), buf(n, 0);
  std::string sender_error;
  std::thread sender([&] {
    try {
      p.b.exchange({{0, 5, src.data(), n, 0}}, {}, ctx_for("send", 30));
    } catch (const std::exception& e) {
      sender_error = e.what();
    }
  });
  EXPECT_THROW_WITH(p.a.exchange({}, {{1, 5, buf.data(), n, 0}}, ctx_for("all_reduce", 30),
                                 [&] {
                                   if (p.a.stats().bytes_received > 0) {
                                     throw CommError("a local rank failed");
                                   }
                                 }),
                    "a local rank failed");
  const uint64_t got = p.a.stats().bytes_received;
  EXPECT(got > 0 && got < n, "the exchange failed after ", got, " bytes of ", n,
         ": no message was half read");
  std::fill(buf.begin(), buf.end(), 0);  // as if the buffer were gone
  char small[16];
  for (int attempt = 0; attempt < 20; ++attempt) {
    EXPECT_THROW_WITH(p.a.take(1, 7, small, sizeof(small), ctx_for("recv", 5), nullptr),
                      "connection from rank 1 is unusable", "all_reduce", "a local rank failed");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT(std::count(buf.begin(), buf.end(), 0) == static_cast<std::ptrdiff_t>(n),
         "a receive wrote into the failed exchange's buffer");
  EXPECT(p.a.stats().bytes_received == got,
         "the connection was read after the failure: ", p.a.stats().bytes_received, " bytes, not ",
         got);
  // Closing rank 0's side ends the sender's exchange.
  p.a.shutdown();
  sender.join();
  EXPECT(!sender_error.empty(), "the sender's exchange completed");
}

