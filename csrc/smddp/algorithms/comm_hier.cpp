// The collectives of a Communicator across hosts (Note [Hierarchical collectives] in
// comm.h): shared memory inside a host, and between hosts the exchange of the group's
// inter-host algorithm (Note [Inter-host algorithms] in net_algorithm.h), which this file
// hands its job: what every algorithm shares lives here.
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
// after the last rank's exchange (docs/log/multi_node.md, build 5ce19af).
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
  net_algos_ = choose_net_algorithms(*this);
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

// Note [Partials made in the wire type]
// A bf16 or fp16 host partial that leaves the host as it is (the mesh's, but for this rank's
// own part: Note [Unequal hosts]) used to be made in fp32 by the shared-memory steps and then
// rounded to the wire type chunk by chunk as it left (WirePartials): a pass that read the
// fp32 partial and wrote its rounded copy, after the steps had written the fp32 partial in
// full. Now the steps write such a partial in the wire type directly: each element the fp32
// sum of the local ranks' inputs, rounded once, the value the separate rounding gave, so
// results do not change by a bit. Per rank on 2 hosts of 2 ranks that saves, in a bf16
// reduce-scatter of S bytes, 0.5 S read and 0.5 S written of 4.75 S moved in user space
// (docs/log/multi_node.md, "Every pass over memory on 2x2"). The ring and halving-doubling add
// this host's unrounded partial to what arrives before anything leaves, and keep fp32.

// Note [A message per local step]
// With several ranks on a host, a network message leaves only once the shared-memory
// reduce-scatter steps made it final (Note [Pipelined exchanges]), and a step makes one
// chunk of each of its parts final: buffer_bytes / (the parts it carries) elements' bytes.
// The mesh's steps carry every part, so on 2 hosts of 2 ranks a 512 KiB message waited for
// two 256 KiB steps before the network carried anything; a ring's steps carry one part per
// local rank (Note [Parts in the order the ring needs them] in net_ring.cpp). So where hosts
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
    // (Note [Parts in the order the ring needs them] in net_ring.cpp), the mesh's steps all.
    const size_t ways = (net_now_ ? net_now_ : net_algos_.main.get())->parts_per_step();
    // What a step carries of a part is a multiple of 64 bytes (chunk_elems in
    // shm_algos.cpp): a message cut the same way ends where a step does.
    const size_t step = (cfg_.settings.buffer_bytes / ways) & ~size_t{63};
    bytes = std::min(bytes, std::max(kMinNetChunk, step));
  }
  return bytes;
}

NetAlgorithm& Communicator::start_net_op(NetOp op, size_t bytes) {
  NetAlgorithm& a = net_algos_.pick(op, bytes);
  net_now_ = &a;
  ++net_ops_;
  ++net_ops_by_[static_cast<size_t>(a.kind())];
  return a;
}

std::vector<Span> Communicator::net_chunks(size_t len, size_t esz) const {
  const size_t per = std::max<size_t>(1, net_chunk_bytes() / esz);
  std::vector<Span> chunks;
  for (size_t o = 0; o < len; o += per) chunks.push_back({o, std::min(per, len - o)});
  if (chunks.empty()) chunks.push_back({0, 0});  // an empty part still sends its message
  return chunks;
}

char* Communicator::incoming(size_t bytes) {
  if (incoming_.size() < bytes) incoming_.resize(bytes);
  return incoming_.data();
}

char* Communicator::staging(size_t bytes) {
  if (staging_.size() < bytes) staging_.resize(bytes);
  return staging_.data();
}

void Communicator::start_host_partials(HostPartials& hp, const void* in,
                                       const std::vector<Span>& parts, const Reduction& red,
                                       const OpCtx& ctx, const NetAlgorithm& algo) {
  const DType acc = acc_type(red.dtype);
  hp.owned = handled();
  const auto& mine = hp.owned[layout_.local_rank];
  const size_t n = mine.size();
  hp.ptr.assign(n, nullptr);
  const bool scaled = red.op == RedOp::PREMUL_SUM && red.premul != 1.0;
  if (layout_.local_size == 1 && wire_type(red.dtype, cfg_.settings) == red.dtype && !scaled) {
    // Note [Pipelined exchanges]: the partials are the input, in the type they cross in.
    hp.type = red.dtype;
    char* src = const_cast<char*>(static_cast<const char*>(in));
    for (size_t k = 0; k < n; ++k) hp.ptr[k] = src + parts[mine[k]].off * dtype_size(red.dtype);
    return;
  }
  hp.type = acc;  // Note [Half precision on the wire]: rounded only where they leave
  // Note [Partials made in the wire type]: those that leave as they are, made rounded.
  const DType wire = wire_type(red.dtype, cfg_.settings);
  if (wire != acc && algo.sends_partials_as_made()) {
    hp.in_wire.assign(n, 0);
    for (size_t k = 0; k < n; ++k) hp.in_wire[k] = mine[k] != cfg_.rank;
  }
  auto type_of = [&](size_t k) { return !hp.in_wire.empty() && hp.in_wire[k] ? wire : acc; };
  // Each partial starts on 64 bytes: with two element types side by side, a 2-byte partial
  // of odd length would otherwise leave the next fp32 one misaligned.
  auto room = [&](size_t k) {
    return (parts[mine[k]].len * dtype_size(type_of(k)) + 63) & ~size_t{63};
  };
  size_t total = 0;
  for (size_t k = 0; k < n; ++k) total += room(k);
  char* buf = scratch(total);
  for (size_t k = 0; k < n; ++k) {
    hp.ptr[k] = buf;
    buf += room(k);
  }
  hp.steps = std::make_unique<shm::ReduceScatterSteps>(*shm_, in, parts, hp.owned, hp.ptr, red,
                                                       false, ctx, algo.partial_phases());
  for (size_t k = 0; k < n; ++k) {
    if (type_of(k) != acc) hp.steps->set_out_type(k, wire);
  }
}

void Communicator::hier_reduce_scatter(const void* in, const std::vector<Span>& parts, void* dst,
                                       const Reduction& red, const OpCtx& ctx) {
  // Note [Auto by size and host count]: S is the input, whose parts every rank of the call
  // shares.
  size_t elems = 0;
  for (const Span& p : parts) elems = std::max(elems, p.off + p.len);
  NetAlgorithm& algo = start_net_op(NetOp::REDUCE_SCATTER, elems * dtype_size(red.dtype));
  HostPartials hp;
  start_host_partials(hp, in, parts, red, ctx, algo);
  NetJob job;
  job.parts = &parts;
  job.partials = &hp;
  job.red = &red;
  job.dst = dst;
  algo.run(job, ctx);
  if (hp.steps) hp.steps->finish_reads();  // Note [Read from the pool] in shm_algos.h
}

Communicator::LocalGather::LocalGather(Communicator& comm, char* out,
                                       const std::vector<Span>& parts, const char* own,
                                       const OpCtx& ctx, std::vector<int> phase_of)
    : comm_(comm), out_(out), parts_(parts), ctx_(ctx) {
  if (comm.layout_.local_size == 1) return;
  owned_ = comm.handled();
  const std::vector<int>& mine = owned_[comm.layout_.local_rank];
  std::vector<const void*> src;
  for (int p : mine) src.push_back(p == comm.cfg_.rank && own ? own : out + parts[p].off);
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
  if (!steps_) return;
  if (steps_->done()) {
    steps_->finish();  // Note [Read from the pool]: until the peers have read my parts
    return;
  }
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
  // Note [Auto by size and host count]: S is the output, `total`.
  NetAlgorithm& algo = start_net_op(NetOp::ALL_GATHER, total);
  LocalGather gather(*this, base, parts, from, ctx, algo.gather_phases());
  NetJob job;
  job.parts = &parts;
  job.ag_out = base;
  if (copy && from != base + own.off) job.ag_own = from;  // not already copied first
  job.gather = &gather;
  algo.run(job, ctx);
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
  // My part is reduced in place, in order, chunk by chunk, and each reduced chunk goes on to
  // its handlers on the other hosts at once (Note [Pipelined exchanges]); the local all-gather
  // reads it from there as it is made, and the other hosts' reduced chunks land in place.
  // Note [Auto by size and host count]: count and dtype are the call's, the same on every
  // rank.
  NetAlgorithm& algo = start_net_op(NetOp::ALL_REDUCE, count * esz);
  LocalGather gather(*this, base, bytes, nullptr, ctx, algo.gather_phases());
  HostPartials hp;
  start_host_partials(hp, data, parts, red, ctx, algo);
  NetJob job;
  job.parts = &parts;
  job.partials = &hp;
  job.red = &red;
  job.dst = base + bytes[cfg_.rank].off;
  job.ag_out = base;
  job.ag_unit = esz;
  job.gather = &gather;
  algo.run(job, ctx);
  gather.finish();
  if (hp.steps) hp.steps->finish_reads();  // Note [Read from the pool] in shm_algos.h
}

}  // namespace smddp
