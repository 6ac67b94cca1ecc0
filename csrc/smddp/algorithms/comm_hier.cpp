// The collectives of a Communicator across hosts (Note [Hierarchical collectives] in
// comm.h): shared memory inside a host, the rail's exchange over the network between hosts.
//
// Note [Pipelined exchanges]
// The network step of a reduce-scatter used to run as three phases one after another:
// every host partial went out, then the partials that came in were reduced, then (in an
// all-reduce) the reduced part went out again. The network idled while this rank reduced,
// and nothing was reduced while it waited (bench multihost --timeline showed it). Now the
// parts cross the network in chunks of SMDDP_NET_CHUNK_BYTES, one message each, and the
// exchange (Exchange::on_received) reduces a chunk as soon as every host's copy of it is
// in; an all-reduce then sends that reduced chunk on to the rail at once, in the same
// exchange, while later chunks still arrive. Every rank cuts a part into the same chunks
// (the setting is one every rank shares), so sender and receiver agree on each message's
// length, and a chunk is reduced in host order as before: results stay bit-identical on
// every rank, and equal to the unchunked algorithm's. With one rank per host and no
// conversion (the accumulation type is the element type, no pre-scaling), the host
// partials are the input itself: nothing is copied before it is sent.
//
// With several ranks per host, the shared-memory reduce-scatter that makes the host
// partials runs step by step inside the exchange (Exchange::work), and each network chunk
// goes out as soon as the steps made it final; a chunk of my part is reduced once it is
// final here too. This cannot deadlock: a step waits only for the same step of this host's
// other ranks, which run it between their own rounds and never wait for the network before
// their steps are done. The shared-memory all-gather that follows cannot run that way (its
// steps wait for what arrives from the network): Note [Local all-gather during the exchange].
//
// Note [Local all-gather during the exchange]
// An all-gather (and an all-reduce's second half) ends with a shared-memory all-gather of
// the parts this host's ranks received. It used to start only after the exchange: on 2
// simulated hosts of 2 ranks, 18-44 ms of a 167 ms 64 MiB all_gather whose NIC bound is
// 134 ms (bench multihost --timeline). Now its steps run beside the exchange
// (Exchange::background, LocalGather): a step starts as soon as its pieces of the parts this
// rank handles are in place (my own part at once, or as its chunks are reduced; the others'
// as their messages arrive) and reads each local peer's pieces as soon as that peer posted.
// Every poll of the steps is a test, never a wait: a local peer's step may wait for the
// network, and a rank that waited for it would stop serving the sends other hosts wait for
// (what kept this phase after the exchange). So while the steps wait on local peers the
// exchange sleeps only briefly between rounds (kBesideWaitMs in tcp_exchange.cpp), a poll
// runs one step at most so the sockets are served between steps, and what
// remains once the exchange is over runs with ordinary waits (LocalGather::finish), when
// nothing this rank owes the network is left. The steps are the same steps, in the same
// order, as before: the bytes are only copied, so results do not change. In an all-reduce
// they start once this rank's shared-memory reduce-scatter steps are done: every local rank
// then runs the steps in one order, and the gather never writes into an in-place input
// that the reduce-scatter steps still read. The same 64 MiB all_gather now ends 0.2 ms
// after the last rank's exchange (docs/multi_node.md, "Where it stands").
//
// In place, an all-reduce's output is its input, and the reduced chunks of other hosts'
// parts land where this rank's partials of those parts are read from. No chunk is
// overwritten while it is still to be sent: a part's rank sends its reduced chunk c back to
// a handler only after it received that handler's partial chunk c whole, which the handler
// had finished sending (the send's bytes were in its socket) before.
//
// Note [Unequal hosts]
// Hosts may have different numbers of ranks (L_h on host h) and keep their hierarchy:
// shared memory inside a host, the network only between hosts. What generalises the rails
// is a handler per part and host: handler_[h][p] is the rank of host h that holds host h's
// partial of part p after the shared-memory reduce-scatter, and that receives part p in an
// all-gather. On the part's own host that is the part's rank, so a reduce-scatter's result
// ends where it belongs. The parts of the other hosts are dealt out in turn to the L_h ranks
// of host h, in host order and, inside a host, local order: the k-th foreign part goes to
// local rank k mod L_h. With L ranks on every host, the foreign parts before part
// members[g][l] number a multiple of L plus l, so its handler is local rank l: the rail. The
// uniform layout is thus the same algorithm, not a second one. A host of one rank handles
// every part; on a larger host the ranks' shares differ by one foreign part at most.
//
// Reduce-scatter: every handler sends its host partial of part p to rank p, and rank p
// receives one partial from each other host (from that host's handler of p) and reduces
// them in host order, its own host's partial in its place. Every element is thus reduced
// over the ranks of a host in local order, then over hosts 0..H-1: an order fixed by the
// layout, and every rank reads the one result (the all-gather copies it), bit-identical on
// every rank. All-gather: rank p sends its part to the handlers of p on the other hosts, then
// each host's shared-memory all-gather spreads the parts its ranks handle. No rank receives
// two streams of one stage from one peer (a part's handlers are on different hosts, and a
// handler hears from each of its parts' ranks once), so the messages of a tag between two
// ranks stay in chunk order as before.
//
// The ring (Note [Rail rings]) passes partials along a rail of one rank per host, which
// unequal hosts do not have: they always take the mesh, whatever SMDDP_NET_ALGO says (every
// rank sees the same layout, so all make that choice alike). The rooted collectives use the
// hosts as they are (reduce is this reduce-scatter, then a rooted gather); broadcast sends to
// one rank per other host (the root's local index modulo L_h); barrier pairs ranks of equal
// local index where both hosts have one (local rank 0 joins every pair of hosts). all_to_all
// stays a flat mesh across hosts: each rank's data goes to one rank, there is nothing to
// combine on the way.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "smddp/algorithms/comm.h"
#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// Note [Own part during the exchange]
// An all-gather whose input is not already in place in its output must copy it there. It
// used to be copied before the exchange, and nothing crossed the network meanwhile: 7-8 ms
// of a 64 MiB all_gather on 2 simulated hosts of one rank (bench multihost --timeline),
// whose NIC bound is 134 ms. Now the mesh, and the ring's first step, send it from the
// input, and it is copied in slices of this size as the exchange's work between rounds
// (Exchange::work, SliceCopy): the copy overlaps the transfer. Nothing else reads or writes
// this part of the output during the exchange (the receives write the other parts; the
// shared-memory all-gather, which runs beside it, reads my part from the input and writes
// only the other local ranks' parts), and the input is only read, so the two cannot collide
// unless the input overlaps the output, which keeps the copy first.
constexpr size_t kOwnCopySlice = 1 << 20;

}  // namespace

bool SliceCopy::operator()() {
  const size_t n = std::min(kOwnCopySlice, len - done);
  if (n) std::memcpy(dst + done, src + done, n);
  done += n;
  return done < len;
}

void Communicator::plan_handlers() {
  const auto& members = layout_.members;
  const int H = layout_.hosts;
  host_index_.assign(cfg_.size, 0);
  for (int h = 0; h < H; ++h) {
    for (int r : members[h]) host_index_[r] = h;
  }
  // Note [Unequal hosts]: the foreign parts dealt out in turn, in host then local order.
  handler_.assign(H, std::vector<int>(cfg_.size, 0));
  for (int h = 0; h < H; ++h) {
    size_t k = 0;
    for (int g = 0; g < H; ++g) {
      for (int p : members[g]) handler_[h][p] = g == h ? p : members[h][k++ % members[h].size()];
    }
  }
  if (layout_.uniform) {
    for (int h = 0; h < H; ++h) rail_.push_back(members[h][layout_.local_rank]);
  }
  // The ranks of other hosts this rank exchanges parts with hear of its failures first
  // (Note [Failure notices] in tcp.h): its part's handlers, and the ranks of its parts.
  const int me = layout_.host;
  for (int h = 0; h < H; ++h) {
    if (h != me) tell_.push_back(handler_[h][cfg_.rank]);
  }
  for (int p = 0; p < cfg_.size; ++p) {
    if (host_index_[p] != me && handler_[me][p] == cfg_.rank) tell_.push_back(p);
  }
  std::sort(tell_.begin(), tell_.end());
  tell_.erase(std::unique(tell_.begin(), tell_.end()), tell_.end());
}

std::vector<std::vector<int>> Communicator::handled() const {
  // In host order, then local order: with equal hosts, one part per host, by host.
  const auto& local = layout_.members[layout_.host];
  std::vector<std::vector<int>> owned(local.size());
  for (const auto& members : layout_.members) {
    for (int p : members) owned[local_index(handler_[layout_.host][p])].push_back(p);
  }
  return owned;
}

// Note [A message per local step]
// With several ranks on a host, a network message leaves only once the shared-memory
// reduce-scatter steps made it final (Note [Pipelined exchanges]), and a step makes one
// chunk of each of its parts final: buffer_bytes / (the parts it carries) elements' bytes.
// The mesh's steps carry every part, so on 2 hosts of 2 ranks a 512 KiB message waited for
// two 256 KiB steps before the network carried anything; a ring's steps carry one part per
// local rank (Note [Parts in the order the ring needs them] in comm_ring.cpp). So where hosts
// have several ranks a message is at most what one step makes final of a part (rounded down
// to 64 bytes as the steps' chunks are), but not cut below kMinNetChunk, below which the cost
// of a message (a header, a poll round, a syscall each way) outweighs the start-up it saves;
// an SMDDP_NET_CHUNK_BYTES below either still wins. 2x2 at 2 Gbit/s (the mesh, three alternating
// rounds, medians of the fraction of the NIC bound), 512 KiB -> 256 KiB messages: reduce_scatter 16
// and 64 MiB 0.90 and 0.90 -> 0.93 and 0.95, all_gather 16 MiB 0.92 -> 0.94, the rest level.
// On 4x2 with the ring's phases the rule gives 512 KiB; capping the ring at the mesh's
// buffer_bytes / size (128 KiB) was level from 16 MiB and slower at 1 MiB (three rounds).
// The rule reads only the layout and settings every rank shares (Note [Settings every rank
// shares]): every rank cuts a part into the same messages, which sender and receiver must
// agree on. One rank per host keeps net_chunk_bytes: no other rank's step gates its sends
// (its own steps, where a conversion or a pre-scaling needs them, run at copy speed).
constexpr size_t kMinNetChunk = 64 << 10;

size_t Communicator::net_chunk_bytes() const {
  size_t bytes = cfg_.settings.net_chunk_bytes;
  if (layout_.hosts < cfg_.size) {
    // The parts one local step carries a chunk of: a ring's phase has one per local rank
    // (Note [Parts in the order the ring needs them] in comm_ring.cpp), the mesh's steps all.
    const size_t ways = rail_ring_chosen() ? static_cast<size_t>(layout_.local_size)
                                           : static_cast<size_t>(cfg_.size);
    // What a step carries of a part is a multiple of 64 bytes (chunk_elems in
    // shm_algos.cpp): a message cut the same way ends where a step does.
    const size_t step = (cfg_.settings.buffer_bytes / ways) & ~size_t{63};
    bytes = std::min(bytes, std::max(kMinNetChunk, step));
  }
  return bytes;
}

std::vector<Span> Communicator::net_chunks(size_t len, size_t esz) const {
  const size_t per = std::max<size_t>(1, net_chunk_bytes() / esz);
  std::vector<Span> chunks;
  for (size_t o = 0; o < len; o += per) chunks.push_back({o, std::min(per, len - o)});
  if (chunks.empty()) chunks.push_back({0, 0});  // an empty part still sends its message
  return chunks;
}

Communicator::HostPartials::~HostPartials() = default;

size_t Communicator::HostPartials::ready(int part) const {
  return steps ? steps->ready(part) : SIZE_MAX;
}

void Communicator::start_host_partials(HostPartials& hp, const void* in,
                                       const std::vector<Span>& parts, const Reduction& red,
                                       const OpCtx& ctx, bool in_ring_order) {
  const DType acc = acc_type(red.dtype);
  const size_t aesz = dtype_size(acc);
  hp.owned = handled();
  const auto& mine = hp.owned[layout_.local_rank];
  const size_t n = mine.size();
  hp.ptr.assign(n, nullptr);
  const bool scaled = red.op == RedOp::PREMUL_SUM && red.premul != 1.0;
  if (layout_.local_size == 1 && acc == red.dtype && !scaled) {
    // Note [Pipelined exchanges]: the partials are the input.
    char* src = const_cast<char*>(static_cast<const char*>(in));
    for (size_t k = 0; k < n; ++k) hp.ptr[k] = src + parts[mine[k]].off * aesz;
    return;
  }
  size_t total = 0;
  for (size_t k = 0; k < n; ++k) total += parts[mine[k]].len * aesz;
  char* buf = scratch(total);
  for (size_t k = 0; k < n; ++k) {
    hp.ptr[k] = buf;
    buf += parts[mine[k]].len * aesz;
  }
  std::vector<int> phase_of;
  if (in_ring_order) {
    // Host me-1's parts first (sent at the ring's step 0), then me-2's, ..., mine last.
    const int H = layout_.hosts;
    for (int p = 0; p < cfg_.size; ++p) {
      phase_of.push_back(((layout_.host - 1 - host_index_[p]) % H + H) % H);
    }
  }
  hp.steps = std::make_unique<shm::ReduceScatterSteps>(*shm_, in, parts, hp.owned, hp.ptr, red,
                                                       false, ctx, std::move(phase_of));
}

void Communicator::rail_reduce_scatter(HostPartials& hp, const std::vector<Span>& parts, void* dst,
                                       const Reduction& red, const OpCtx& ctx,
                                       std::vector<TransportOp> more_recvs,
                                       const std::function<void(Exchange&, Span)>& reduced,
                                       LocalGather* gather) {
  const int H = layout_.hosts, me = layout_.host;
  const DType acc = acc_type(red.dtype);
  const size_t aesz = dtype_size(acc), esz = dtype_size(red.dtype);
  const size_t my_len = parts[cfg_.rank].len;
  const std::vector<Span> mine = net_chunks(my_len, aesz);
  // What the other hosts send: their partials of my part, side by side.
  if (incoming_.size() < static_cast<size_t>(H) * my_len * aesz) {
    incoming_.resize(static_cast<size_t>(H) * my_len * aesz);
  }
  auto from_host = [&](int h) { return incoming_.data() + static_cast<size_t>(h) * my_len * aesz; };

  Exchange x;
  const uint64_t chk = check_of(ctx);
  // Note [Unequal hosts]: the partials of the parts I handle go to the parts' ranks, each
  // chunk as the shared-memory steps make it final; my own part's stays here.
  const std::vector<int>& my_parts = hp.owned[layout_.local_rank];
  const size_t n = my_parts.size();
  std::vector<std::vector<Span>> out(n);
  std::vector<size_t> sent(n, 0);
  const char* own_partial = nullptr;
  for (size_t k = 0; k < n; ++k) {
    if (my_parts[k] == cfg_.rank) {
      own_partial = static_cast<const char*>(hp.ptr[k]);
    } else {
      out[k] = net_chunks(parts[my_parts[k]].len, aesz);
    }
  }
  for (int h = 0; h < H; ++h) {
    if (h == me) continue;
    for (const Span& c : mine) {
      x.recvs.push_back(
          {handler_[h][cfg_.rank], tag(ctx, 1), from_host(h) + c.off * aesz, c.len * aesz, chk});
    }
  }
  auto send_ready = [&] {
    for (size_t k = 0; k < n; ++k) {
      for (; sent[k] < out[k].size(); ++sent[k]) {
        const Span& c = out[k][sent[k]];
        if (c.off + c.len > hp.ready(my_parts[k])) break;
        x.sends.push_back({my_parts[k], tag(ctx, 1), static_cast<char*>(hp.ptr[k]) + c.off * aesz,
                           c.len * aesz, chk});
      }
    }
  };
  const size_t rs_recvs = x.recvs.size();
  for (TransportOp& r : more_recvs) x.recvs.push_back(r);
  // recvs[k] for k < rs_recvs is chunk k % chunks of the k / chunks-th other host. A chunk
  // is reduced once every other host's copy arrived and this host's partial of it is final.
  std::vector<int> missing(mine.size(), H - 1);
  std::vector<uint8_t> done(mine.size(), 0);
  std::vector<const void*> srcs(H);
  auto reduce_chunk = [&](size_t c) {
    if (done[c] || missing[c] || mine[c].off + mine[c].len > hp.ready(cfg_.rank)) return;
    done[c] = 1;
    Timeline::Phase phase(timeline_, ctx.seq, "reduce", mine[c].len * aesz);
    for (int h = 0; h < H; ++h) {
      srcs[h] = h == me ? own_partial + mine[c].off * aesz : from_host(h) + mine[c].off * aesz;
    }
    smddp::reduce(acc, red.dtype, static_cast<char*>(dst) + mine[c].off * esz, srcs.data(), H,
                  mine[c].len, red, true);
    if (reduced) reduced(x, mine[c]);
  };
  x.on_received = [&](size_t k) {
    if (k >= rs_recvs) {
      if (gather) gather->arrived(x.recvs[k].data, x.recvs[k].len);
      return;
    }
    const size_t c = k % mine.size();
    --missing[c];
    reduce_chunk(c);
  };
  if (hp.steps) {
    // Note [Pipelined exchanges]: the shared-memory steps run between the exchange's rounds.
    x.work = [&] {
      {
        Timeline::Phase phase(timeline_, ctx.seq, "local reduce_scatter");
        hp.steps->step();
      }
      send_ready();
      for (size_t c = 0; c < mine.size(); ++c) reduce_chunk(c);
      return !hp.steps->done();
    };
  }
  if (gather) x.background = [&] { return gather->poll(hp.steps.get()); };
  send_ready();
  exchange(x, ctx);
}

void Communicator::hier_reduce_scatter(const void* in, const std::vector<Span>& parts, void* dst,
                                       const Reduction& red, const OpCtx& ctx) {
  HostPartials hp;
  const bool ring = rail_ring_chosen();
  start_host_partials(hp, in, parts, red, ctx, ring);
  if (ring) {
    RingJob job;
    job.parts = &parts;
    job.partials = &hp;
    job.red = &red;
    job.dst = dst;
    rail_ring(job, ctx);
    return;
  }
  rail_reduce_scatter(hp, parts, dst, red, ctx, {}, {}, nullptr);
}

std::vector<TransportOp> Communicator::rail_allgather_recvs(char* out,
                                                            const std::vector<Span>& parts,
                                                            size_t unit, size_t chunk_unit,
                                                            const OpCtx& ctx) {
  std::vector<TransportOp> recvs;
  const uint64_t chk = check_of(ctx);
  // Note [Unequal hosts]: each part I handle comes from its rank.
  const std::vector<std::vector<int>> owned = handled();
  for (int q : owned[layout_.local_rank]) {
    if (q == cfg_.rank) continue;
    const Span& p = parts[q];
    for (const Span& c : net_chunks(p.len, chunk_unit)) {
      recvs.push_back({q, tag(ctx, 2), out + (p.off + c.off) * unit, c.len * unit, chk});
    }
  }
  return recvs;
}

Communicator::LocalGather::LocalGather(Communicator& comm, char* out,
                                       const std::vector<Span>& parts, const char* own,
                                       const OpCtx& ctx, bool in_ring_order)
    : comm_(comm), out_(out), parts_(parts), ctx_(ctx) {
  if (comm.layout_.local_size == 1) return;
  owned_ = comm.handled();
  const std::vector<int>& mine = owned_[comm.layout_.local_rank];
  std::vector<const void*> src;
  for (int p : mine) src.push_back(p == comm.cfg_.rank && own ? own : out + parts[p].off);
  std::vector<int> phase_of;
  if (in_ring_order) {
    // This host's parts first (here at once, or as they are reduced), then host me-1's (the
    // ring's step 0 brings them), me-2's, ...
    const int H = comm.layout_.hosts, me = comm.layout_.host;
    for (int p = 0; p < comm.cfg_.size; ++p) {
      phase_of.push_back(((me - comm.host_index_[p]) % H + H) % H);
    }
  }
  steps_ = std::make_unique<shm::AllGatherSteps>(*comm.shm_, std::move(src), out, parts, owned_,
                                                 ctx, std::move(phase_of));
  for (size_t k = 0; k < mine.size(); ++k) {
    if (mine[k] == comm.cfg_.rank && own) steps_->set_ready(k, parts[mine[k]].len);
  }
}

Communicator::LocalGather::~LocalGather() = default;

void Communicator::LocalGather::arrived(const char* at, size_t len) {
  if (!steps_) return;
  const std::vector<int>& mine = owned_[comm_.layout_.local_rank];
  for (size_t k = 0; k < mine.size(); ++k) {
    const Span& p = parts_[mine[k]];
    if (at < out_ + p.off || at >= out_ + p.off + p.len) continue;
    // The pieces of a part come in order: one peer's messages of one tag, or my part's
    // chunks reduced in order.
    const size_t got = steps_->ready(k);
    SMDDP_CHECK(at == out_ + p.off + got && got + len <= p.len,
                "smddp: a part of a hierarchical all-gather arrived out of order (a bug)");
    steps_->set_ready(k, got + len);
    return;
  }
}

Exchange::Progress Communicator::LocalGather::poll(const shm::ReduceScatterSteps* first) {
  if (!steps_ || steps_->done()) return Exchange::Progress::kDone;
  // Until then `work` runs the reduce-scatter's steps and keeps the exchange's rounds going.
  if (first && !first->done()) return Exchange::Progress::kIdle;
  Timeline& t = comm_.timeline_;
  const int64_t begin = t.enabled() ? Timeline::now_ns() : 0;
  if (!steps_->poll()) {
    return steps_->waiting_on_peers() ? Exchange::Progress::kWaiting : Exchange::Progress::kIdle;
  }
  t.record(ctx_.seq, "local all_gather", begin);
  return steps_->done() ? Exchange::Progress::kDone : Exchange::Progress::kMoved;
}

void Communicator::LocalGather::finish() {
  if (!steps_ || steps_->done()) return;
  Timeline::Phase phase(comm_.timeline_, ctx_.seq, "local all_gather");
  steps_->finish();
}

void Communicator::hier_allgather(const void* src, void* out, const std::vector<Span>& parts,
                                  const OpCtx& ctx) {
  char* base = static_cast<char*>(out);
  const Span& own = parts[cfg_.rank];
  const char* from = static_cast<const char*>(src);
  size_t total = 0;
  for (const Span& p : parts) total = std::max(total, p.off + p.len);
  // Note [Own part during the exchange]: my part is sent from the input and copied into place
  // between the exchange's rounds, unless the input overlaps the output (then first).
  const bool copy = from != base + own.off && own.len;
  if (copy && from < base + total && base < from + own.len) {
    std::memmove(base + own.off, src, own.len);
    from = base + own.off;
  }
  const bool copy_during = copy && from != base + own.off;  // not already copied first
  const bool ring = rail_ring_chosen();
  LocalGather gather(*this, base, parts, from, ctx, ring);
  if (ring) {
    RingJob job;
    job.parts = &parts;
    job.ag_out = base;
    if (copy_during) job.ag_own = from;
    job.gather = &gather;
    rail_ring(job, ctx);
    gather.finish();
    return;
  }
  Exchange x;
  x.recvs = rail_allgather_recvs(base, parts, 1, 1, ctx);
  const uint64_t chk = check_of(ctx);
  for (int h = 0; h < layout_.hosts; ++h) {
    if (h == layout_.host) continue;
    for (const Span& c : net_chunks(own.len, 1)) {
      // A send only reads its span.
      x.sends.push_back(
          {handler_[h][cfg_.rank], tag(ctx, 2), const_cast<char*>(from) + c.off, c.len, chk});
    }
  }
  SliceCopy own_copy{base + own.off, from, own.len};
  if (copy_during) x.work = [&] { return own_copy(); };
  x.on_received = [&](size_t k) { gather.arrived(x.recvs[k].data, x.recvs[k].len); };
  x.background = [&] { return gather.poll(); };
  exchange(x, ctx);
  gather.finish();
}

void Communicator::hier_allreduce(void* data, size_t count, const Reduction& red,
                                  const OpCtx& ctx) {
  const size_t esz = dtype_size(red.dtype);
  std::vector<Span> parts(cfg_.size), bytes(cfg_.size);
  for (int p = 0; p < cfg_.size; ++p) {
    parts[p] = partition(count, cfg_.size, p, 64 / esz);
    bytes[p] = {parts[p].off * esz, parts[p].len * esz};
  }
  char* base = static_cast<char*>(data);
  char* own = base + bytes[cfg_.rank].off;
  const uint64_t chk = check_of(ctx);
  // My part is reduced in place, in order, chunk by chunk: the local all-gather reads it
  // from there as it is made.
  const bool ring = rail_ring_chosen();
  LocalGather gather(*this, base, bytes, nullptr, ctx, ring);
  // Each reduced chunk of my part goes on to its handlers on the other hosts at once (Note
  // [Pipelined exchanges]); the other hosts' reduced chunks of their parts land in place. The
  // all-gather's messages are cut at the reduce-scatter's chunk boundaries, in elements.
  auto send_on = [&](Exchange& x, Span chunk) {
    for (int h = 0; h < layout_.hosts; ++h) {
      if (h == layout_.host) continue;
      x.sends.push_back(
          {handler_[h][cfg_.rank], tag(ctx, 2), own + chunk.off * esz, chunk.len * esz, chk});
    }
    gather.arrived(own + chunk.off * esz, chunk.len * esz);
  };
  HostPartials hp;
  start_host_partials(hp, data, parts, red, ctx, ring);
  if (ring) {
    RingJob job;
    job.parts = &parts;
    job.partials = &hp;
    job.red = &red;
    job.dst = own;
    job.ag_out = base;
    job.ag_unit = esz;
    job.ag_chunk_unit = dtype_size(acc_type(red.dtype));
    job.gather = &gather;
    rail_ring(job, ctx);
    gather.finish();
    return;
  }
  rail_reduce_scatter(hp, parts, own, red, ctx,
                      rail_allgather_recvs(base, parts, esz, dtype_size(acc_type(red.dtype)), ctx),
                      send_on, &gather);
  gather.finish();
}

}  // namespace smddp
