// The TCP mesh on its own (transport/tcp/tcp.h), two ranks in one process over loopback: what
// a failed exchange leaves on its connections, and the stash for messages nobody waits for
// yet.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
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

// Runs `one_try(attempt)` until it returns true (it forced the order its case checks), at most
// kTries times; true when some try did.
constexpr int kTries = 5;
bool forced_within_tries(bool (*one_try)(int)) {
  for (int attempt = 0; attempt < kTries; ++attempt) {
    if (one_try(attempt)) return true;
  }
  return false;
}

}  // namespace

// Note [A failed exchange's frames] (tcp_exchange.cpp): an exchange that fails (here its
// health check) while a message for its receive is half read leaves that connection unusable.
// Before, the next read of it (a receive waiting side by side, TcpMesh::take) wrote the rest of
// the message into the failed call's buffer, which its caller may have freed.
namespace {

// One try of the case below. Returns false, having checked nothing, when the exchange read
// its whole message before its health check saw a part of it (so it did not fail).
bool exchange_failed_with_a_message_half_read(int attempt) {
  Pair p("failed_exchange_" + std::to_string(attempt));
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
  std::string error;
  try {
    p.a.exchange({}, {{1, 5, buf.data(), n, 0}}, ctx_for("all_reduce", 30), [&] {
      if (p.a.stats().bytes_received > 0) throw CommError("a local rank failed");
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (error.empty()) {  // the whole message came before a health check
    p.a.shutdown();
    sender.join();
    return false;
  }
  EXPECT(error.find("a local rank failed") != std::string::npos, "the exchange failed with '",
         error, "'");
  const uint64_t got = p.a.stats().bytes_received;
  EXPECT(got > 0 && got < n, "the exchange failed after ", got, " bytes of ", n,
         ": no message was half read");
  std::fill(buf.begin(), buf.end(), 0);  // as if the buffer were gone
  char small[16];
  for (int i = 0; i < 20; ++i) {
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
  return true;
}

}  // namespace

TEST_CASE(a_failed_exchange_leaves_no_message_arriving_into_its_buffer) {
  EXPECT(forced_within_tries(exchange_failed_with_a_message_half_read),
         "the exchange never saw its message half read in ", kTries, " tries");
}

namespace {

// One try of the case below. Returns false, having checked nothing, when the collective read
// its whole message before its health check saw a part of it (the peer's sender kept ahead
// of every read: seen once on a loaded machine), so the harmful order was not forced.
bool failed_send_beside_a_receive(int attempt) {
  Pair p("failed_send_" + std::to_string(attempt));
  const size_t n = size_t(64) << 20;  // more than the socket buffers hold
  std::vector<char> src(n, 'x'), buf(n, 0);
  // Rank 1 sends rank 0 the message rank 0's collective receives.
  std::thread peer([&] {
    try {
      p.b.exchange({{0, 5, src.data(), n, 0}}, {}, ctx_for("send", 30));
    } catch (const std::exception&) {  // reported by rank 0's receive
    }
  });
  // Rank 0's send lane sends rank 1 a message that rank 1 never receives, so it times out;
  // it starts once the collective has read part of its message, and the collective reads
  // on only after the send failed: the order that broke the collective, every time.
  std::atomic<bool> begun{false}, send_over{false}, not_forced{false};
  std::string send_error;
  std::thread send_lane([&] {
    while (!begun.load() && !not_forced.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (not_forced.load()) return;
    try {
      p.a.exchange({{1, 6, src.data(), n, 0}}, {}, ctx_for("send", 1));
    } catch (const std::exception& e) {
      send_error = e.what();
    }
    send_over.store(true);
  });
  std::string recv_error;
  try {
    p.a.exchange({}, {{1, 5, buf.data(), n, 0}}, ctx_for("all_reduce", 30), [&] {
      if (begun.load() || p.a.stats().bytes_received == 0) return;
      begun.store(true);  // the message is half read
      while (!send_over.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  } catch (const std::exception& e) {
    recv_error = e.what();
  }
  if (!begun.load()) not_forced.store(true);
  send_lane.join();
  if (!not_forced.load()) {
    EXPECT(send_error.find("timed out") != std::string::npos, "the send did not time out: '",
           send_error, "'");
    EXPECT(recv_error.empty(), "the collective's receive failed: ", recv_error);
    EXPECT(std::count(buf.begin(), buf.end(), 'x') == static_cast<std::ptrdiff_t>(n),
           "the collective's receive did not get the whole message");
  }
  p.a.shutdown();
  p.b.shutdown();
  peer.join();
  return !not_forced.load();
}

}  // namespace

// Note [Receive state belongs to the reader] (tcp_exchange.cpp): a send that fails (the send
// lane's exchange, outside the exclusive lock) while a collective on another thread receives
// a message leaves that collective's connection alone. Before, the failed send walked every
// connection without a lock (a data race with the collective's reads) and marked unusable the
// one whose message was arriving for the collective, which then failed with the send's error.
TEST_CASE(a_failed_send_leaves_a_concurrent_receive_alone) {
  EXPECT(forced_within_tries(failed_send_beside_a_receive),
         "the collective never saw its message half read in ", kTries, " tries");
}

namespace {

// Rank 1 sends `empty` messages with tag 9, which rank 0 never receives, then one byte with
// tag 5. Returns rank 0's error receiving the byte ("" when it arrived) and the seconds its
// exchange took.
std::pair<std::string, double> receive_behind_empty_messages(Pair& p, int empty) {
  std::vector<TransportOp> sends(static_cast<size_t>(empty), TransportOp{0, 9, nullptr, 0, 0});
  char one = 1, got = 0;
  sends.push_back({0, 5, &one, 1, 0});
  std::thread sender([&] {
    try {
      p.b.exchange(sends, {}, ctx_for("send", 30));
    } catch (const std::exception&) {  // rank 0 refused the messages and left
    }
  });
  std::string error;
  auto t0 = steady_clock::now();
  try {
    p.a.exchange({}, {{1, 5, &got, 1, 0}}, ctx_for("recv", 30));
    EXPECT(got == 1, "received ", int(got));
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double took = seconds_since(t0);
  p.a.shutdown();
  sender.join();
  return {error, took};
}

}  // namespace

// Note [TCP trust model]: each message nobody waits for costs its length and 256 bytes of the
// connection's budget. Before, empty messages cost nothing, and a peer could grow the stash
// without bound.
TEST_CASE(empty_messages_nobody_awaits_count_against_the_stash_budget) {
  Pair p("stash_budget");
  p.a.set_stash_budget(64 << 10);  // 256 such messages
  const std::string error = receive_behind_empty_messages(p, 1000).first;
  for (const char* part :
       {"rank 1: sent a message of 0 bytes (tag 9) that no receive here expects yet",
        "a connection holds at most 65536 bytes", "256 bytes for its keeping"}) {
    EXPECT(error.find(part) != std::string::npos, "the error '", error, "' does not say '", part,
           "'");
  }
  // Within the budget, the same messages wait and the receive completes.
  Pair q("stash_budget_enough");
  q.a.set_stash_budget(1000 * 256);
  const std::string none = receive_behind_empty_messages(q, 1000).first;
  EXPECT(none.empty(), "1000 empty messages did not fit 1000 * 256 bytes: ", none);
}

// A message that completes into the stash is matched against the receives on its own: a
// receive behind many waiting messages completes in time linear in their number. Before, each
// one rescanned the whole stash (20000 messages: 5.3 s on the plain build, 0.03 s after).
TEST_CASE(a_receive_behind_many_stashed_messages_completes_promptly) {
  Pair p("stash_many");
  const auto [error, took] = receive_behind_empty_messages(p, 20000);
  EXPECT(error.empty(), error);
  EXPECT(p.a.stats().messages_received == 20001, p.a.stats().messages_received, " messages");
  EXPECT(took < 1.0, "the receive took ", took, " s behind 20000 stashed messages");
}

// Note [Direct receives over TCP]: a receive claims the first message with its tag. A message
// of another tag still arriving when take() is called is not that claim: before, take() took
// it for one, so the message with its tag, read in the same call, went to the budget for
// messages nobody waits for, and the group failed ("no receive here expects yet") although
// its receive was posted. Whether a call starts with the other message half read depends on
// where the socket's reads stop (4 of 6 runs failed), so each way runs several rounds.
TEST_CASE(a_posted_receive_behind_a_message_still_arriving_keeps_its_claim) {
  const size_t big = size_t(6) << 20;  // each fits the budget alone, the two do not
  for (int round = 0; round < 8; ++round) {
    const bool direct = round % 2 == 1;
    Pair p(std::string("claim_behind_") + std::to_string(round));
    p.a.set_stash_budget(size_t(8) << 20);
    std::vector<char> first(big, 1), second(big, 2), got(big, 0);
    std::string send_error;
    std::thread sender([&] {
      try {
        p.b.exchange({{0, 1, first.data(), big, 0}, {0, 2, second.data(), big, 0}}, {},
                     ctx_for("send", 30));
      } catch (const std::exception& e) {
        send_error = e.what();
      }
    });
    auto owner = std::make_shared<int>(0);
    const std::shared_ptr<void> data_owner = direct ? owner : nullptr;
    std::string error;
    try {
      const smddp::OpCtx ctx = ctx_for("recv", 30);
      while (!p.a.take(1, 2, got.data(), big, ctx, data_owner)) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    p.a.shutdown();
    sender.join();
    EXPECT(error.empty(), "round ", round, direct ? " (direct)" : "", ": ", error);
    EXPECT(!error.empty() || got == second, "round ", round, ": the receive got other bytes");
    if (!error.empty()) break;
  }
}

// Note [Claims of a receive from any rank] (tcp_take.cpp): a receive from any rank whose take()
// on one peer claimed a message still arriving, and that completed from another peer,
// releases the claim; the message then counts against the budget for messages nobody waits
// for. Before, it stayed outside the budget until a later receive took it. Here rank 1's
// message is claimed by a take() into `claimer`, released, and completed into the stash:
// a second message nobody waits for that fits the budget only without the first is refused;
// in a second run the first is taken after the release, and a message that needs the whole
// budget is then accepted (the release's charge went with it).
namespace {

// One try; false, having checked nothing, when the first take() read the whole message (no
// claim was left to release).
bool released_claim_counts_against_the_budget(int attempt, bool take_it_first) {
  // Large enough that the socket cannot hold it: the reader catches up with the sender.
  const size_t big = size_t(48) << 20, budget = size_t(64) << 20;
  Pair p(std::string("release_") + (take_it_first ? "take_" : "keep_") + std::to_string(attempt));
  p.a.set_stash_budget(budget);
  std::vector<char> first(big, 1), claimer(big, 0), other(1, 0);
  std::thread sender([&] {
    try {
      p.b.exchange({{0, 5, first.data(), big, 0}}, {}, ctx_for("send", 30));
    } catch (const std::exception&) {  // reported by rank 0's side
    }
  });
  const smddp::OpCtx ctx = ctx_for("recv", 30);
  bool claimed = false;
  while (!claimed) {
    if (p.a.take(1, 5, claimer.data(), big, ctx, nullptr)) break;  // all of it in one call
    claimed = p.a.stats().bytes_received > 0;  // its header read, its body not all there
  }
  if (!claimed) {
    sender.join();
    p.a.shutdown();
    return false;
  }
  p.a.release_claims(claimer.data());  // as if the receive had completed from another rank
  while (p.a.stats().messages_received < 1) p.a.take(1, 99, other.data(), 1, ctx, nullptr);
  sender.join();
  std::vector<char> got(big, 0);
  if (take_it_first) {
    EXPECT(p.a.take(1, 5, got.data(), big, ctx, nullptr), "the released message is still there");
    EXPECT(got == first, "the released message kept its bytes");
  }
  // Fits the budget (with its entry's keeping) only while the first message is not counted.
  const size_t second = take_it_first ? budget - 1024 : size_t(24) << 20;
  std::vector<char> more(second, 2);
  std::thread sender2([&] {
    try {
      p.b.exchange({{0, 7, more.data(), second, 0}}, {}, ctx_for("send", 30));
    } catch (const std::exception&) {  // rank 0 refused it and closed
    }
  });
  std::string error;
  try {
    while (p.a.stats().messages_received < 2) p.a.take(1, 99, other.data(), 1, ctx, nullptr);
  } catch (const std::exception& e) {
    error = e.what();
  }
  p.a.shutdown();
  sender2.join();
  if (take_it_first) {
    EXPECT(error.empty(), "the budget was charged for a message already taken: ", error);
  } else {
    EXPECT(error.find("no receive here expects yet") != std::string::npos,
           "the released message was not counted: ", error.empty() ? "no error" : error);
  }
  return true;
}

}  // namespace

TEST_CASE(a_receive_from_any_rank_releases_what_it_claimed_from_other_peers) {
  bool kept = false, taken = false;
  for (int attempt = 0; attempt < 4 * kTries && !kept; ++attempt) {
    kept = released_claim_counts_against_the_budget(attempt, false);
  }
  for (int attempt = 0; attempt < 4 * kTries && !taken; ++attempt) {
    taken = released_claim_counts_against_the_budget(attempt, true);
  }
  EXPECT(kept && taken, "no try found the message still arriving after a take()");
}
