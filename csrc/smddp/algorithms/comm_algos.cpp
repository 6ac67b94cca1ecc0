// The collectives of a Communicator: shared memory inside a host, hierarchical across
// hosts (Note [Hierarchical collectives] in comm.h).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "smddp/algorithms/comm.h"
#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_algos.h"
#include "smddp/algorithms/shm_rooted.h"

namespace smddp {

void Communicator::refuse_if_broken(const OpCtx& ctx) {
  std::lock_guard<std::mutex> g(broken_mu_);
  if (!broken_.empty()) {
    throw CommError("smddp: " + ctx.describe() + " on group '" + cfg_.group_name +
                    "' refused: the group is unusable after an earlier error: " + broken_);
  }
}

void Communicator::mark_broken(const std::exception& e) {
  // Peers learn about the failure through our control block and failure notices instead
  // of timing out.
  {
    std::lock_guard<std::mutex> g(broken_mu_);
    if (broken_.empty()) broken_ = e.what();
  }
  shm_->mark_failed(e.what());
  net_->announce_failure(e.what(), tell_);  // Note [Failure notices]
}

template <typename F>
void Communicator::guarded(OpCtx& ctx, bool numbered, F&& body) {
  refuse_if_broken(ctx);
  if (numbered) ctx.seq = next_seq_++;
  ctx.deadline = Deadline::after(ctx.deadline.seconds);
  try {
    Timeline::Phase whole(timeline_, ctx.seq, ctx.name);  // Note [Timeline]
    body();
    // Read by TCP waits (Note [Exits are not failures]) and before a descriptor slot is
    // reused (Note [Mismatch detection] in shm.h).
    if (numbered) shm_->mark_finished(ctx.seq);
  } catch (const std::exception& e) {
    mark_broken(e);
    throw;
  }
}

void Communicator::exchange(const std::vector<TransportOp>& sends,
                            const std::vector<TransportOp>& recvs, const OpCtx& ctx) {
  Exchange x;
  x.sends = sends;
  x.recvs = recvs;
  exchange(x, ctx);
}

void Communicator::exchange(Exchange& x, const OpCtx& ctx) {
  Timeline::Phase phase(timeline_, ctx.seq, "network");
  x.health = [&] { shm_->check_local_peers(ctx); };
  // Every message of a collective is received by a receive posted here up front (sends
  // may be added as the exchange runs), so counting receives counts the messages.
  for (const TransportOp& op : x.recvs) {
    if (host_index_[op.peer] == layout_.host) ++local_net_messages_;
  }
  net_->exchange(x, ctx);
}

uint64_t Communicator::tag(const OpCtx& ctx, int stage) const {
  return collective_tag(ctx.seq, stage);
}

uint64_t Communicator::check_of(const OpCtx& ctx) {
  return (static_cast<uint64_t>(ctx.desc.kind) << 32) ^ ctx.desc.dtype_op ^
         (ctx.desc.count * 0x9e3779b97f4a7c15ull) ^ ctx.desc.extra;
}

char* Communicator::scratch(size_t bytes) {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

void Communicator::allreduce(void* data, size_t count, const Reduction& red, OpCtx ctx) {
  guarded(ctx, true, [&] {
    if (layout_.hosts == 1) {
      shm::allreduce(*shm_, data, count, red, ctx, oneshot_bytes_);
      return;
    }
    hier_allreduce(data, count, red, ctx);
  });
}

void Communicator::reduce_scatter(const void* in, void* out, size_t count, const Reduction& red,
                                  OpCtx ctx) {
  guarded(ctx, true, [&] {
    std::vector<Span> parts(cfg_.size);
    for (int p = 0; p < cfg_.size; ++p) parts[p] = {p * count, count};
    if (layout_.hosts == 1) {
      const bool premul = red.op == RedOp::PREMUL_SUM && red.premul != 1.0;
      if (zero_copy_ && !premul &&
          count * cfg_.size * dtype_size(red.dtype) >= shm::kZeroCopyMinBytes &&
          shm::reduce_scatter_zero_copy(*shm_, in, out, count, red, ctx)) {
        ++zero_copy_ops_;
        return;
      }
      std::vector<std::vector<int>> owned = handled();
      shm::reduce_scatter(*shm_, in, parts, owned, {out}, red, true, ctx);
      return;
    }
    hier_reduce_scatter(in, parts, out, red, ctx);
  });
}

// Note [Reduce-scatter of unequal parts]
// c10d's list form of reduce_scatter takes input_list[p] as the part rank p receives, shaped
// like rank p's output, so parts may differ in size (gloo and NCCL reduce them; some may be
// empty). Every rank passes all the sizes. The parts are spans of the concatenated input, as
// in the call above but each of its own length, and the same algorithms take them: on one
// host the shared-memory reduce-scatter, across hosts hier_reduce_scatter with the group's
// inter-host algorithm, chosen by the input's size S as for any reduce-scatter. So every
// element is reduced as any reduce-scatter reduces an element of its part's rank: by that
// rank alone, over the local ranks in order, then the hosts in the order the algorithm takes
// for that rank's part (Note [Hierarchical collectives] in comm.h): exact and deterministic,
// its bits set by its values, that rank and the algorithm S selects, not by how the other
// parts are cut or by timing.
//
// Cost: that of a reduce-scatter of the concatenation, without padding (each element is
// moved and reduced once, as in the equal call), and with two differences. The zero-copy path
// (Note [Zero-copy operands] in shm_algos.h) is not tried: it reads equal blocks. And each
// shared-memory step carries a chunk of every part, so the steps number as many as the
// longest part needs: where one part holds nearly all of the input, up to world_size times
// the steps of an equal split of the same input, each carrying that much less. That part is
// reduced by its rank alone, as any part of a reduce-scatter is.
//
// Mismatches: ranks that disagree on a size would cut the input differently, so the sizes'
// digest joins the call's descriptor (CollDesc::extra), which local ranks compare at the
// first step, before reading any peer's data (Note [Mismatch detection] in shm.h), and which
// every message between hosts carries in its check (Note [Mismatches across hosts] in
// tcp.h): a disagreement raises "mismatched collectives" on every rank, as a different count
// does. Each step of the digest is a bijection of its state for a given size, so lists that
// differ in one size always differ in digest; lists that differ in several collide with
// probability 2^-64.
namespace {
uint64_t parts_digest(const std::vector<size_t>& counts) {
  uint64_t h = 0x243f6a8885a308d3ull;
  for (size_t c : counts) {
    h ^= static_cast<uint64_t>(c);  // then splitmix64's finaliser, a bijection
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}
}  // namespace

void Communicator::reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts,
                                  const Reduction& red, OpCtx ctx) {
  ctx.desc.extra ^= parts_digest(counts);
  guarded(ctx, true, [&] {
    SMDDP_CHECK_VALUE(counts.size() == static_cast<size_t>(cfg_.size), "smddp: ", ctx.describe(),
                      " got ", counts.size(), " part sizes for a group of ", cfg_.size, " ranks");
    std::vector<Span> parts(cfg_.size);
    size_t total = 0;
    for (int p = 0; p < cfg_.size; ++p) {
      parts[p] = {total, counts[p]};
      total = checked_add(total, counts[p], "the elements of a reduce_scatter's parts");
    }
    checked_mul(total, dtype_size(red.dtype), "the bytes of a reduce_scatter's input");
    if (layout_.hosts == 1) {
      shm::reduce_scatter(*shm_, in, parts, handled(), {out}, red, true, ctx);
      return;
    }
    hier_reduce_scatter(in, parts, out, red, ctx);
  });
}

void Communicator::allgather(const void* in, void* out, size_t bytes, OpCtx ctx) {
  guarded(ctx, true, [&] {
    std::vector<Span> parts(cfg_.size);
    for (int p = 0; p < cfg_.size; ++p) parts[p] = {p * bytes, bytes};
    if (layout_.hosts == 1) {
      if (zero_copy_ && bytes * cfg_.size >= shm::kZeroCopyMinBytes &&
          shm::allgather_zero_copy(*shm_, in, out, bytes, ctx)) {
        ++zero_copy_ops_;
        return;
      }
      shm::allgather(*shm_, {in}, out, parts, handled(), ctx);
      return;
    }
    hier_allgather(in, out, parts, ctx);
  });
}

void Communicator::broadcast(void* data, size_t bytes, int root, OpCtx ctx) {
  guarded(ctx, true, [&] {
    // The root sends to one rank per other host, local index root_local modulo that host's
    // size (the root's rail when hosts are equal; Note [Unequal hosts] in comm_hier.cpp),
    // which then broadcasts inside its host.
    const int root_host = host_of(root);
    const auto& root_members = layout_.members[root_host];
    const int root_local = static_cast<int>(
        std::find(root_members.begin(), root_members.end(), root) - root_members.begin());
    auto entry = [&](int h) { return static_cast<int>(root_local % layout_.members[h].size()); };
    const int local_root = entry(layout_.host);
    if (layout_.hosts > 1 && layout_.local_rank == local_root) {
      std::vector<TransportOp> sends, recvs;
      const uint64_t chk = check_of(ctx);
      char* p = static_cast<char*>(data);
      // Note [Roots that disagree across hosts]: each receiver also acknowledges the root.
      if (cfg_.rank == root) {
        for (int h = 0; h < layout_.hosts; ++h) {
          if (h != root_host) {
            const int peer = layout_.members[h][entry(h)];
            sends.push_back({peer, tag(ctx, 3), p, bytes, chk});
            recvs.push_back({peer, tag(ctx, kRootAck), nullptr, 0, chk});
          }
        }
      } else {
        recvs.push_back({root, tag(ctx, 3), p, bytes, chk});
        sends.push_back({root, tag(ctx, kRootAck), nullptr, 0, chk});
      }
      exchange(sends, recvs, ctx);
    }
    shm::broadcast(*shm_, data, bytes, local_root, ctx);
  });
}

// Note [Roots that disagree across hosts]: where the hosts disagree on a broadcast's or a
// scatter's root, each host's root only sends and nobody receives, so no message's check is
// ever compared: every rank would return its own host's data without an error (the
// mismatch surfaced only at the group's next collective, if any). So every rank that
// receives from the root over TCP also sends it an empty acknowledgement carrying the
// collective's check, posted with its receive, and the root waits for them. A root that
// disagrees then meets the other root's data where it waits for an acknowledgement, and
// raises naming both calls (Note [Mismatches across hosts] in tcp.h); where the roots'
// rails do not meet, the roots wait for acknowledgements that never come and time out. On
// agreement the acknowledgements cross while the data is sent: the root's call ends at most
// one one-way latency later, the receivers' not at all.
//
// Note [Rooted collectives] in shm_rooted.h. Across hosts, the ranks of other hosts send
// to (gather) or receive from (scatter) the root over TCP directly, one message each; the
// ranks of the root's host run the shared-memory algorithm. reduce is a hierarchical
// reduce-scatter (as in all_reduce) followed by a rooted gather of the reduced parts.
int Communicator::host_of(int group_rank) const {
  SMDDP_CHECK(group_rank >= 0 && group_rank < cfg_.size, "smddp: rank ", group_rank,
              " is in no host of the layout");
  return host_index_[group_rank];
}

void Communicator::rooted_gather(const void* in, const std::vector<size_t>& lens,
                                 const std::vector<char*>& dst, int root, const OpCtx& ctx) {
  const int root_host = host_of(root);
  const uint64_t chk = check_of(ctx);
  if (layout_.host != root_host) {
    exchange({{root, tag(ctx, 6), const_cast<char*>(static_cast<const char*>(in)), lens[cfg_.rank],
               chk}},
             {}, ctx);
    return;
  }
  shm::gather(*shm_, in, local_of(lens), local_of(dst), local_index(root), ctx);
  if (cfg_.rank != root || layout_.hosts == 1) return;
  std::vector<TransportOp> recvs;
  for (int h = 0; h < layout_.hosts; ++h) {
    if (h == root_host) continue;
    for (int r : layout_.members[h]) recvs.push_back({r, tag(ctx, 6), dst[r], lens[r], chk});
  }
  exchange({}, recvs, ctx);
}

void Communicator::rooted_scatter(const std::vector<const char*>& src,
                                  const std::vector<size_t>& lens, void* out, int root,
                                  const OpCtx& ctx) {
  const int root_host = host_of(root);
  const uint64_t chk = check_of(ctx);
  // Note [Roots that disagree across hosts]: each receiver also acknowledges the root.
  if (layout_.host != root_host) {
    exchange({{root, tag(ctx, kRootAck), nullptr, 0, chk}},
             {{root, tag(ctx, 7), static_cast<char*>(out), lens[cfg_.rank], chk}}, ctx);
    return;
  }
  if (cfg_.rank == root && layout_.hosts > 1) {
    std::vector<TransportOp> sends, acks;
    for (int h = 0; h < layout_.hosts; ++h) {
      if (h == root_host) continue;
      for (int r : layout_.members[h]) {
        sends.push_back({r, tag(ctx, 7), const_cast<char*>(src[r]), lens[r], chk});
        acks.push_back({r, tag(ctx, kRootAck), nullptr, 0, chk});
      }
    }
    exchange(sends, acks, ctx);
  }
  shm::scatter(*shm_, local_of(src), local_of(lens), out, local_index(root), ctx);
}

void Communicator::reduce(void* data, size_t count, const Reduction& red, int root, OpCtx ctx) {
  guarded(ctx, true, [&] {
    if (layout_.hosts == 1) {
      shm::reduce(*shm_, data, count, red, local_index(root), ctx, oneshot_bytes_);
      return;
    }
    const size_t esz = dtype_size(red.dtype);
    std::vector<Span> parts(cfg_.size);
    std::vector<size_t> lens(cfg_.size);
    std::vector<char*> dst;
    char* base = static_cast<char*>(data);
    for (int p = 0; p < cfg_.size; ++p) {
      parts[p] = partition(count, cfg_.size, p, 64 / esz);
      lens[p] = parts[p].len * esz;
      if (cfg_.rank == root) dst.push_back(base + parts[p].off * esz);
    }
    // The root reduces its part in place (in place is safe: Note [Pipelined exchanges] in
    // comm_hier.cpp); the others into a private buffer, since their `data` is read-only.
    std::vector<char> own(cfg_.rank == root ? 0 : lens[cfg_.rank]);
    char* mine = cfg_.rank == root ? dst[cfg_.rank] : own.data();
    hier_reduce_scatter(data, parts, mine, red, ctx);
    rooted_gather(mine, lens, dst, root, ctx);
  });
}

void Communicator::gather(const void* in, size_t bytes, const std::vector<char*>& outs, int root,
                          OpCtx ctx) {
  guarded(ctx, true,
          [&] { rooted_gather(in, std::vector<size_t>(cfg_.size, bytes), outs, root, ctx); });
}

void Communicator::scatter(const std::vector<const char*>& ins, size_t bytes, void* out, int root,
                           OpCtx ctx) {
  guarded(ctx, true,
          [&] { rooted_scatter(ins, std::vector<size_t>(cfg_.size, bytes), out, root, ctx); });
}

void Communicator::barrier(OpCtx ctx) {
  guarded(ctx, true, [&] {
    shm::barrier(*shm_, ctx);
    if (layout_.hosts == 1) return;
    // Ranks of equal local index pair up where both hosts have one: local rank 0 joins
    // every pair of hosts (the rails when hosts are equal; Note [Unequal hosts]).
    std::vector<TransportOp> sends, recvs;
    for (int h = 0; h < layout_.hosts; ++h) {
      const auto& members = layout_.members[h];
      if (h == layout_.host || layout_.local_rank >= static_cast<int>(members.size())) continue;
      const int peer = members[layout_.local_rank];
      sends.push_back({peer, tag(ctx, 4), nullptr, 0, check_of(ctx)});
      recvs.push_back({peer, tag(ctx, 4), nullptr, 0, check_of(ctx)});
    }
    exchange(sends, recvs, ctx);
    shm::barrier(*shm_, ctx);
  });
}

void Communicator::alltoall(const void* in, const std::vector<Span>& send, void* out,
                            const std::vector<Span>& recv, OpCtx ctx) {
  guarded(ctx, true, [&] {
    if (layout_.hosts == 1) {
      shm::alltoall(*shm_, in, send, out, recv, ctx);
      return;
    }
    // A flat mesh across hosts, ranks of this host included: each rank's data goes to one
    // rank, so a hierarchy would have nothing to combine on the way (Note [Unequal hosts]).
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    std::vector<TransportOp> sends, recvs;
    // The check is the collective's kind and dtype (the descriptor of an all_to_all carries
    // no count): sizes are checked per message instead (len must match).
    const uint64_t chk = check_of(ctx);
    for (int j = 0; j < cfg_.size; ++j) {
      if (j == cfg_.rank) continue;
      sends.push_back({j, tag(ctx, 5), const_cast<char*>(src + send[j].off), send[j].len, chk});
      recvs.push_back({j, tag(ctx, 5), dst + recv[j].off, recv[j].len, chk});
    }
    if (recv[cfg_.rank].len != send[cfg_.rank].len) {
      throw CommError("smddp: " + ctx.describe() + ": this rank sends " +
                      std::to_string(send[cfg_.rank].len) + " bytes to itself but expects " +
                      std::to_string(recv[cfg_.rank].len));
    }
    std::memmove(dst + recv[cfg_.rank].off, src + send[cfg_.rank].off, recv[cfg_.rank].len);
    exchange(sends, recvs, ctx);
  });
}

int Communicator::local_index(int group_rank) const {
  const auto& local = layout_.members[layout_.host];
  auto it = std::find(local.begin(), local.end(), group_rank);
  return it == local.end() ? -1 : static_cast<int>(it - local.begin());
}

bool Communicator::usable() {
  std::lock_guard<std::mutex> g(broken_mu_);
  return broken_.empty();
}

void Communicator::send(const void* data, size_t bytes, int peer, uint32_t tag, OpCtx ctx) {
  guarded(ctx, false, [&] {
    int local = p2p_ ? local_index(peer) : -1;
    if (local >= 0) {
      p2p_->send(local, tag, data, bytes, ctx);
    } else {
      net_->exchange({{peer, tag, const_cast<char*>(static_cast<const char*>(data)), bytes, 0}}, {},
                     ctx);
    }
  });
}

void Communicator::recv(void* data, size_t bytes, int peer, uint32_t tag, OpCtx ctx) {
  guarded(ctx, false, [&] {
    int local = p2p_ ? local_index(peer) : -1;
    if (local >= 0) {
      p2p_->recv(local, tag, data, bytes, ctx);
    } else {
      net_->exchange({}, {{peer, tag, static_cast<char*>(data), bytes, 0}}, ctx);
    }
  });
}

int Communicator::recv_any(void* data, size_t bytes, uint32_t tag, OpCtx ctx) {
  int from = -1;
  RecvPoll poll;
  auto pause = std::chrono::microseconds(0);
  for (size_t round = 0; !poll_recv(data, bytes, kAnyPeer, tag, ctx, poll, &from); ++round) {
    if (pause.count()) std::this_thread::sleep_for(pause);
    if (round > 64)
      pause = std::min(std::max(pause * 2, std::chrono::microseconds(20)),
                       std::chrono::microseconds(1000));
  }
  return from;
}

namespace {
const std::shared_ptr<void> kNoOwner;  // a receive from any rank stashes (tcp_exchange.cpp)
}  // namespace

bool Communicator::poll_recv(void* data, size_t bytes, int peer, uint32_t tag, OpCtx& ctx,
                             RecvPoll& poll, int* from) {
  const auto now = Clock::now();
  const bool check = now >= poll.next_check;  // every 20 ms, and at the first attempt
  if (check) {
    refuse_if_broken(ctx);  // a collective may have failed since the last check
    poll.next_check = now + std::chrono::milliseconds(20);
  }
  if (!poll.started) {
    poll.started = true;
    ctx.deadline = Deadline::after(ctx.deadline.seconds);
  }
  try {
    if (peer == kAnyPeer && cfg_.size < 2)
      throw CommError("smddp: " + ctx.describe() + ": no other rank in the group");
    // A receive from any rank polls the others from a rotating start, so none is always
    // served first. No allocation here: a waiting receive is attempted thousands of times.
    const int n = peer == kAnyPeer ? cfg_.size : 1;
    const uint32_t start = poll_round_.fetch_add(1, std::memory_order_relaxed);
    for (int k = 0; k < n; ++k) {
      const int r = peer == kAnyPeer ? static_cast<int>((start + k) % cfg_.size) : peer;
      if (r == cfg_.rank) continue;
      const int local = p2p_ ? local_index(r) : -1;
      if (local >= 0 ? p2p_->probe(local, tag, ctx)
                     : net_->take(r, tag, static_cast<char*>(data), bytes, ctx,
                                  peer == kAnyPeer ? kNoOwner : poll.data_owner)) {
        if (local >= 0) p2p_->recv(local, tag, data, bytes, ctx);
        // Note [Claims of a receive from any rank] in tcp_take.cpp.
        if (peer == kAnyPeer && net_) net_->release_claims(static_cast<const char*>(data));
        *from = r;
        return true;
      }
    }
    if (!check) return false;
    const std::string where = "smddp: " + ctx.describe() + " on group '" + cfg_.group_name + "'";
    if (shm_->aborted()) throw CommError(where + " was aborted: the process group was shut down");
    const int local = peer != kAnyPeer && p2p_ ? local_index(peer) : -1;
    if (local >= 0) shm_->check_peer(local, ctx, "to send (is a matching send posted on it?)");
    if (ctx.deadline.expired()) {
      char secs[32];
      snprintf(secs, sizeof(secs), "%.1f", ctx.deadline.seconds);
      throw CommError(where + " timed out after " + secs + " s (the timeout of this group): " +
                      (peer == kAnyPeer ? std::string("no rank")
                                        : "rank " + std::to_string(peer) + " has not") +
                      " sent it a message with tag " + std::to_string(tag));
    }
    if (peer == kAnyPeer) {
      bool any_alive = false;
      for (int r = 0; r < cfg_.size; ++r) {
        if (r == cfg_.rank) continue;
        const int l = local_index(r);
        any_alive = any_alive || l < 0 || !shm_->peer_lost(l);
      }
      if (!any_alive) throw CommError(where + " failed: every other rank failed or exited");
    }
    return false;
  } catch (const std::exception& e) {
    mark_broken(e);
    throw;
  }
}

bool Communicator::p2p_in_shared_memory(int peer) const {
  if (!p2p_) return false;
  if (peer != kAnyPeer) return local_index(peer) >= 0;
  for (int r = 0; r < cfg_.size; ++r) {
    if (r != cfg_.rank && local_index(r) < 0) return false;
  }
  return true;
}

bool Communicator::try_send_now(const void* data, size_t bytes, int peer, uint32_t tag) {
  int local = p2p_ ? local_index(peer) : -1;
  return local >= 0 && usable() && p2p_->try_send(local, tag, data, bytes);
}

bool Communicator::try_recv_now(void* data, size_t bytes, int peer, uint32_t tag) {
  int local = p2p_ ? local_index(peer) : -1;
  return local >= 0 && usable() && p2p_->try_recv(local, tag, data, bytes);
}

}  // namespace smddp
