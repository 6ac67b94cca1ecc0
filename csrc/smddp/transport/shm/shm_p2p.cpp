#include "smddp/transport/shm/shm_p2p.h"

#include <algorithm>
#include <cstring>

namespace smddp {
namespace {

constexpr size_t kHeader = 64;       // one cache line: {bytes, tag}
constexpr size_t kPiece = 64 << 10;  // both sides publish at least every 64 KiB (pipelining)

struct Header {
  uint64_t bytes;
  uint32_t tag;
};

uint64_t align64(uint64_t pos) { return (pos + 63) & ~uint64_t(63); }

// Ring copies that may cross the end of the ring.
void ring_write(char* ring, size_t cap, uint64_t pos, const char* src, size_t n) {
  size_t at = pos % cap, first = std::min(n, cap - at);
  std::memcpy(ring + at, src, first);
  std::memcpy(ring, src + first, n - first);
}

void ring_read(char* dst, const char* ring, size_t cap, uint64_t pos, size_t n) {
  size_t at = pos % cap, first = std::min(n, cap - at);
  std::memcpy(dst, ring + at, first);
  std::memcpy(dst + first, ring, n - first);
}

}  // namespace

// Note [Stash budget in shared memory]
// A receive for one tag reads past the messages with other tags at the head of its ring
// and keeps them aside (Note [Shared-memory point-to-point] in shm.h). Each such message
// counts against a budget per channel, kStashBytes (1 GiB), with its length and
// kStashEntryBytes for its keeping: the rule, limit and wording of the TCP mesh (Note [TCP
// trust model] in tcp/tcp.h), so a program behaves the same whichever path its messages
// take. The local ranks are trusted (one user's processes), so the budget is not a defence
// but a diagnosis: a send whose tag the receiver never posts (a tag mismatch) used to be set
// aside whole, allocated at once from its header's length, and a large one got the receiver
// killed by the OOM killer or a bare std::bad_alloc, far from the cause. Now the receive
// raises, naming both tags, the sizes and the limit, before it consumes the header: the
// ring is left as it was. A message within the budget is kept in a buffer that grows as
// its bytes arrive, as over TCP, so a sender that stops midway costs only what it wrote.
// Only messages nobody waits for are counted, as over TCP: a message with the receive's
// own tag goes straight into its buffer, never aside.

ShmP2P::ShmP2P(ShmComm& shm)
    : shm_(shm), cap_(shm.p2p_bytes()), in_(shm.size()), out_(shm.size()) {}

void ShmP2P::reserve(int to, uint64_t end) {
  // Positions only grow, and every position below the highest one written was written: the
  // ring is committed from its start up to that, and whole once a write reached its end.
  size_t& committed = out_[to].committed;
  if (end <= committed || committed == cap_) return;
  // Whole pages, no more: a group whose pairs exchange small messages (a barrier, a few
  // objects) commits a page per pair, not a ring (Note [One transport per process]). One
  // commit covers a whole message, so a large one costs one call.
  constexpr size_t kPage = 4096;
  const size_t target = std::min<uint64_t>(cap_, (end + kPage - 1) / kPage * kPage);
  shm_.commit_ring(to, committed, target - committed);
  committed = target;
}

void ShmP2P::send(int to, uint32_t tag, const void* data, size_t bytes, const OpCtx& ctx) {
  std::lock_guard<std::mutex> g(out_[to].mu);
  ChannelCtl* ch = shm_.channel(shm_.rank(), to);
  char* ring = shm_.ring(shm_.rank(), to);
  const char* src = static_cast<const char*>(data);
  // Waits until the ring can hold everything up to byte position `end`.
  auto wait_space = [&](uint64_t end) {
    if (end <= cap_) return;
    shm_.wait_word(to, ch->tail, ch->tail_sleepers, end - cap_, [&] {
      shm_.check_peer(to, ctx, "to receive (is a matching recv posted on it?)");
    });
  };
  uint64_t pos = align64(ch->head.load(std::memory_order_relaxed));  // only this rank writes head
  wait_space(pos + kHeader);
  reserve(to, pos + kHeader + bytes);  // whole, so a full /dev/shm fails before any byte
  Header h{bytes, tag};
  std::memcpy(ring + pos % cap_, &h, sizeof(h));  // never wraps: pos and cap_ are multiples of 64
  pos += kHeader;
  if (bytes == 0) ShmComm::publish(ch->head, ch->head_sleepers, pos);
  for (size_t done = 0; done < bytes;) {
    uint64_t used = pos - ch->tail.load(std::memory_order_acquire);
    if (used == cap_) {
      ShmComm::publish(ch->head, ch->head_sleepers, pos);  // what is written so far
      // Wait for a quarter of the ring, not one byte: fewer sleeps and wake-ups when the
      // threads share cores (16 MiB exchange between 2 ranks: 12.8 -> 2.8 ms).
      wait_space(pos + std::min<uint64_t>(cap_ / 4, bytes - done));
      continue;
    }
    size_t piece = std::min({cap_ - used, bytes - done, kPiece, cap_ - pos % cap_});
    std::memcpy(ring + pos % cap_, src + done, piece);
    pos += piece;
    done += piece;
    ShmComm::publish(ch->head, ch->head_sleepers, pos);
  }
}

bool ShmP2P::try_send(int to, uint32_t tag, const void* data, size_t bytes) {
  std::unique_lock<std::mutex> g(out_[to].mu, std::try_to_lock);
  if (!g.owns_lock()) return false;
  ChannelCtl* ch = shm_.channel(shm_.rank(), to);
  uint64_t pos = align64(ch->head.load(std::memory_order_relaxed));
  if (pos + kHeader + bytes - ch->tail.load(std::memory_order_acquire) > cap_) return false;
  reserve(to, pos + kHeader + bytes);
  char* ring = shm_.ring(shm_.rank(), to);
  Header h{bytes, tag};
  std::memcpy(ring + pos % cap_, &h, sizeof(h));
  ring_write(ring, cap_, pos + kHeader, static_cast<const char*>(data), bytes);
  ShmComm::publish(ch->head, ch->head_sleepers, pos + kHeader + bytes);
  return true;
}

void ShmP2P::recv(int from, uint32_t tag, void* data, size_t bytes, const OpCtx& ctx) {
  Inbox& in = in_[from];
  std::lock_guard<std::mutex> g(in.mu);
  if (take_stashed(in, tag, data, bytes, &ctx)) return;
  while (!read_next(from, tag, data, bytes, ctx)) {
  }
}

bool ShmP2P::read_next(int from, uint32_t tag, void* data, size_t bytes, const OpCtx& ctx) {
  Inbox& in = in_[from];
  ChannelCtl* ch = shm_.channel(from, shm_.rank());
  const char* ring = shm_.ring(from, shm_.rank());
  auto wait_data = [&](uint64_t end) {
    shm_.wait_word(from, ch->head, ch->head_sleepers, end, [&] {
      shm_.check_peer(from, ctx, "to send (is a matching send posted on it?)");
    });
  };
  uint64_t pos = align64(ch->tail.load(std::memory_order_relaxed));  // only this rank writes tail
  wait_data(pos + kHeader);
  Header h;
  std::memcpy(&h, ring + pos % cap_, sizeof(h));
  const bool mine = h.tag == tag;
  if (mine && h.bytes != bytes) size_mismatch(tag, h.bytes, bytes, ctx);
  if (!mine) {
    // Note [Stash budget in shared memory]: checked before the header is consumed.
    const size_t room = stash_budget_ - std::min(stash_budget_, in.stash_bytes);
    if (h.bytes > room || room - h.bytes < kStashEntryBytes) {
      over_budget(from, tag, h.bytes, h.tag, in.stash_bytes, ctx);
    }
  }
  pos += kHeader;
  ShmComm::publish(ch->tail, ch->tail_sleepers, pos);
  std::vector<char>* aside = nullptr;  // grows as the bytes arrive
  if (!mine) {
    in.stash.push_back({h.tag, {}});
    in.stash_bytes += h.bytes + kStashEntryBytes;
    aside = &in.stash.back().data;
  }
  try {
    for (size_t done = 0; done < h.bytes;) {
      uint64_t head = ch->head.load(std::memory_order_acquire);
      if (head <= pos) {
        wait_data(pos + 1);
        continue;
      }
      // Freed space is published every piece, so a waiting sender sees progress while it
      // still spins (one 1 MiB copy before publishing put it to sleep: 16 MiB ping-pong
      // 2.5 -> 16 ms).
      size_t piece = std::min<uint64_t>({head - pos, h.bytes - done, cap_ - pos % cap_, kPiece});
      char* dst = static_cast<char*>(data);
      if (aside) {
        if (aside->size() < done + piece) {
          aside->resize(std::min<uint64_t>(
              h.bytes, std::max<uint64_t>({2 * aside->size(), done + piece, kPiece})));
        }
        dst = aside->data();
      }
      std::memcpy(dst + done, ring + pos % cap_, piece);
      pos += piece;
      done += piece;
      ShmComm::publish(ch->tail, ch->tail_sleepers, pos);
    }
  } catch (...) {
    // The stash keeps whole messages only (take_stashed copies them out as they are).
    if (aside) {
      in.stash_bytes -= h.bytes + kStashEntryBytes;
      in.stash.pop_back();
    }
    throw;
  }
  return mine;
}

bool ShmP2P::probe(int from, uint32_t tag, const OpCtx& ctx) {
  Inbox& in = in_[from];
  std::unique_lock<std::mutex> g(in.mu, std::try_to_lock);
  if (!g.owns_lock()) return false;
  for (const Stashed& m : in.stash) {
    if (m.tag == tag) return true;
  }
  ChannelCtl* ch = shm_.channel(from, shm_.rank());
  const char* ring = shm_.ring(from, shm_.rank());
  while (true) {
    uint64_t pos = align64(ch->tail.load(std::memory_order_relaxed));
    if (ch->head.load(std::memory_order_acquire) < pos + kHeader) return false;
    Header h;
    std::memcpy(&h, ring + pos % cap_, sizeof(h));
    if (h.tag == tag) return true;
    // Another tag is in the way: set it aside (as recv would) to see what follows.
    read_next(from, tag, nullptr, 0, ctx);
  }
}

bool ShmP2P::try_recv(int from, uint32_t tag, void* data, size_t bytes) {
  Inbox& in = in_[from];
  std::unique_lock<std::mutex> g(in.mu, std::try_to_lock);
  if (!g.owns_lock()) return false;
  if (take_stashed(in, tag, data, bytes, nullptr)) return true;
  if (!in.stash.empty()) return false;  // let recv() sort out what is stashed
  ChannelCtl* ch = shm_.channel(from, shm_.rank());
  const char* ring = shm_.ring(from, shm_.rank());
  uint64_t pos = align64(ch->tail.load(std::memory_order_relaxed));
  uint64_t head = ch->head.load(std::memory_order_acquire);
  if (head < pos + kHeader) return false;
  Header h;
  std::memcpy(&h, ring + pos % cap_, sizeof(h));
  // Anything but the complete message we want is left to recv() (it stashes and raises).
  if (h.tag != tag || h.bytes != bytes || head < pos + kHeader + bytes) return false;
  ring_read(static_cast<char*>(data), ring, cap_, pos + kHeader, bytes);
  ShmComm::publish(ch->tail, ch->tail_sleepers, pos + kHeader + bytes);
  return true;
}

bool ShmP2P::take_stashed(Inbox& in, uint32_t tag, void* data, size_t bytes, const OpCtx* ctx) {
  for (auto it = in.stash.begin(); it != in.stash.end(); ++it) {
    if (it->tag != tag) continue;
    if (it->data.size() != bytes) {
      if (!ctx) return false;
      size_mismatch(tag, it->data.size(), bytes, *ctx);
    }
    if (bytes) std::memcpy(data, it->data.data(), bytes);
    in.stash_bytes -= it->data.size() + kStashEntryBytes;
    in.stash.erase(it);
    return true;
  }
  return false;
}

void ShmP2P::size_mismatch(uint32_t tag, size_t got, size_t want, const OpCtx& ctx) {
  throw CommError("smddp: " + ctx.describe() + ": the message with tag " + std::to_string(tag) +
                  " has " + std::to_string(got) + " bytes but this recv expects " +
                  std::to_string(want) +
                  " (send and recv must use tensors of the same size "
                  "and dtype)");
}

void ShmP2P::over_budget(int from, uint32_t tag, uint64_t got_bytes, uint32_t got_tag, size_t held,
                         const OpCtx& ctx) const {
  const std::string sent = "rank " + std::to_string(shm_.group_rank(from)) + " sent a message of " +
                           std::to_string(got_bytes) + " bytes (tag " + std::to_string(got_tag) +
                           ") that no receive here expects yet (this one waits for tag " +
                           std::to_string(tag) + ")";
  const std::string waiting =
      "earlier such messages waiting here count " + std::to_string(held) + " bytes";
  const std::string limit = "a pair of ranks on one host holds at most " +
                            std::to_string(stash_budget_) +
                            " bytes for receives not yet posted, counting each message's "
                            "length and " +
                            std::to_string(kStashEntryBytes) + " bytes for its keeping";
  throw CommError("smddp: " + ctx.describe() + ": " + sent + ", while " + waiting + "; " + limit +
                  " (post the receives in the order of the sends, and check that send and "
                  "recv use the same tag)");
}

}  // namespace smddp
