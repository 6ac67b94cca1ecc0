// The rail's exchange between hosts as a ring: the alternative to the mesh (net_mesh.cpp),
// taken where choose_net_algorithms says so (Note [Inter-host algorithms] in net_algorithm.h).
//
// Note [Rail rings]
// The mesh moves a part in one hop: each host sends every other host its partial of that
// host's part at once, so each NIC carries H-1 streams each way, and each receiver is fed by
// H-1 senders at once. The ring moves the same bytes per NIC ((H-1)/H of the data per pass)
// but each host talks to two neighbours only: host h sends to h+1 and receives from h-1
// (hosts in rail order, modulo H).
//
// Reduce-scatter, H-1 steps: at step s host h sends the running sum of part h-s-1 (its own
// partial at step 0) and receives the running sum of part h-s-2, adds its own partial of
// that part and sends the result on at step s+1. At the last step (s = H-2) the part it
// receives is its own, and adding its partial completes it. Part p is summed in the order
// of hosts p+1, p+2, ..., p: fixed, so every run gives the same bits, and every rank gets
// them since the all-gather copies the owner's result. This is another order than the
// mesh's (hosts 0..H-1), so mesh and ring results may differ in the last bit; every rank
// makes the same choice between them (from SMDDP_NET_ALGO, a setting every rank shares, and
// the host count; choose_net_algorithms), so results stay bit-identical across ranks.
// All-gather, H-1 steps: at step t host h passes part h-t on (its own at step 0), and
// receives part h-t-1 into place.
//
// Every step runs chunk by chunk (Note [Pipelined exchanges] in comm_hier.cpp): a chunk
// goes on once it arrived and was reduced, so the steps overlap and the ring's start-up is
// H-1 chunks, not H-1 parts; all steps of a collective run in one exchange. The next host
// posts its receives from us in step order, and messages of one tag are matched in order,
// so the sends of each tag are released in step order (OrderedSends) even when a later
// step's chunk is ready first (a neighbour ahead of us).
//
// When: from 3 hosts of equal rank counts SMDDP_NET_ALGO=auto takes the ring as the group's
// algorithm (Note [The group's algorithm under auto] in net_algorithm.cpp: the cost model's
// choice, fitted on these measurements; bench multihost, docs/log/multi_node.md). On 4 simulated
// hosts of one rank at 2 Gbit/s, two rounds each, the ring reached 0.83-0.94 of the NIC bound from
// 16 MiB (all three ops) against the mesh's 0.80-0.91, and 0.80-0.86 at 1 MiB against 0.47-0.75; on
// 8 hosts at 1 Gbit/s, 0.88-0.94 against 0.76-0.87, and 0.79-0.83 at 1 MiB against 0.31-0.67; on 16
// hosts at 500 Mbit/s, three rounds, 0.84-0.94 at 4 and 16 MiB against 0.53-0.78; on 32 hosts at
// 200 Mbit/s, 0.80-0.94 against 0.24-0.69. There the mesh's incast overflowed the switch ports
// (tens to hundreds of drops per case on 16 hosts, thousands on 32); the ring dropped nothing. From
// 64 KiB to 1 MiB on 16 hosts the two were within 15% of each other either way (there 16 ranks
// share two cores, and the scheduler sets the time). With 2 ranks per host (4x2) the two were level
// (0.64-0.81 from 16 MiB on hosts running BBR; on cubic the ring 0.81-0.90, the mesh 0.81-0.93).
// What held 4x2 back at 2 Gbit/s was not the machine's two cores, as first read, but the ring's
// start-up and spinning waits (Note [Parts in the order the ring needs them]); the ring now reaches
// 0.88-0.94 there, against 0.92-0.95 for bare TCP streams on its flows (docs/log/multi_node.md).
// The cause of the mesh's lag, as far as measured: in the mesh each NIC carries H-1 streams each
// way, which share the link unevenly, so some parts arrive late and an all-reduce's second half, or
// the call's end, waits for the last (a 4x1 64 MiB mesh all_reduce's ranks finished reducing
// between 243 and 406 ms); the cost model's flow skew (planner/cost_model.py) puts 1.0% of NIC time
// on each stream beyond one (1.9% on hosts running BBR). (An earlier measurement had the ring no
// faster: the sockets' fixed buffers then held both back, Note [Kernel-sized socket buffers] in
// tcp_wire.h.) A ring's 2(H-1) steps put H-1 message latencies on the critical path of every
// collective, which small messages feel first: those go by the tree or halving-doubling (Note [Auto
// by size and host count]). SMDDP_NET_ALGO=ring or mesh forces either.
//
// Buffers: each step's incoming running sums land in the group's incoming buffer, in the wire
// type, and this rank's partial (unrounded, Note [Half precision on the wire]) is added in
// place there; the sum, rounded to the wire type once, is then sent from there. In place (an
// all-reduce with one rank per host, whose partials are its input and whose output is its input
// too), the all-gather's data of part p lands where this rank's partial of part p is read from.
// That is safe: the owner of part p finishes a chunk only after the chunk passed every other host,
// so this rank read (or, at step 0, finished sending) its partial of that chunk before any
// all-gather data for it can exist.
//
// Note [Parts in the order the ring needs them]
// With several ranks per host the host partials come from shared-memory reduce-scatter steps that
// run during the exchange. Each step used to carry a chunk of every part, so the part the ring
// sends first (host me-1's, at step 0) was final only at the pace of all of them: on 4 simulated
// hosts of 2 ranks at 2 Gbit/s, in a 64 MiB reduce_scatter of 203-217 ms, the steps finished 48-66
// ms into the call, and the chunks of the ring's step 0 arrived over 66-78 ms on the 8 ranks
// (median 72), those of steps 1 and 2 over 62-74 (medians 69 and 66; the NIC bound of a step is 67
// ms) (bench multihost --timeline, one call). The steps now run in phases, one per host in the
// order the ring needs its parts (start_host_partials): host me-1's parts first (sent at step 0),
// then me-2's (reduced into what arrives at step 0), ..., this host's own last (completed at the
// last step). Each phase's steps carry a chunk of one part per local rank, from the same buffer, so
// the first message is final after one step. The same parts are reduced in the same order, so
// results do not change. Four simulated hosts of 2 ranks at 2 Gbit/s, three alternating rounds,
// medians of the fraction of the NIC bound at 16 and 64 MiB, before (with Note [Spin only where it
// pays] already) and after (with 128 KiB messages then; the 512 KiB of Note [A message per local
// step] in comm_hier.cpp matched them within the noise in three more rounds): reduce_scatter 0.85
// and 0.90 -> 0.91 and 0.94, all_reduce 0.88 and 0.90 -> 0.92 and 0.95.
//
// The shared-memory all-gather that spreads what arrived (Communicator::LocalGather) runs in
// phases too, in the order the ring delivers the parts: this host's first, then host me-1's
// (the ring's step 0 brings them), me-2's, and so on. Its steps used to carry a chunk of every
// part, so the first waited for the part the ring brings last: in a 4x2 16 MiB all_gather each
// rank's local all-gather began 31-50 ms into a 54-59 ms call and ended 1-10 ms after the
// rank's exchange; now it begins 0.1-3.5 ms in. Three alternating rounds, 4x2 at 2 Gbit/s with
// gloo and bare-tcp in each job, medians at 16 and 64 MiB: all_gather 0.88 and 0.89 -> 0.92
// and 0.93, all_reduce 0.86 and 0.92 -> 0.93 and 0.95, reduce_scatter level (0.91-0.94). The
// mesh keeps one phase for both: it sends every part at once, to every host, and needs no
// order.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/net_algorithm.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// Sends to one peer with one tag that become ready in any order but must be posted in the
// order the peer posted its receives in.
struct OrderedSends {
  std::vector<TransportOp> ops;
  std::vector<uint8_t> ready;
  size_t posted = 0;

  size_t add(const TransportOp& op) {
    ops.push_back(op);
    ready.push_back(0);
    return ops.size() - 1;
  }
  void flush(Exchange& x) {
    for (; posted < ops.size() && ready[posted]; ++posted) x.sends.push_back(ops[posted]);
  }
  bool all_posted() const { return posted == ops.size(); }
};

class Ring final : public NetAlgorithm {
 public:
  using NetAlgorithm::NetAlgorithm;
  const char* name() const override { return "ring"; }
  NetAlgo kind() const override { return NetAlgo::RING; }
  // Note [Parts in the order the ring needs them]: host me-1's parts first (sent at the ring's
  // step 0), then me-2's, ..., mine last.
  std::vector<int> partial_phases() const override { return phases(1); }
  // This host's parts first (here at once, or as they are reduced), then host me-1's (the
  // ring's step 0 brings them), me-2's, ...
  std::vector<int> gather_phases() const override { return phases(0); }
  // A ring's phase carries a chunk of one part per local rank.
  size_t parts_per_step() const override { return static_cast<size_t>(g_.layout().local_size); }
  void run(const NetJob& job, const OpCtx& ctx) override;

 private:
  // Each part's phase: how many hosts `behind` + the part's host is behind mine (modulo H).
  std::vector<int> phases(int behind) const {
    const int H = g_.layout().hosts, me = g_.layout().host;
    std::vector<int> phase_of;
    for (int p = 0; p < g_.group_size(); ++p) {
      phase_of.push_back(((me - behind - g_.host_of(p)) % H + H) % H);
    }
    return phase_of;
  }
};

void Ring::run(const NetJob& job, const OpCtx& ctx) {
  const Layout& l = g_.layout();
  const int H = l.hosts, me = l.host;
  const std::vector<int>& rail = g_.rail();
  // Equal hosts only (choose_net_algorithms): the rail is set, and a rank handles one part per
  // host, so its partials (hp->ptr) are indexed by host.
  const int next = rail[(me + 1) % H], prev = rail[(me + H - 1) % H];
  // The part host `me` handles at step s, `back` hosts behind it (modulo H).
  auto part_at = [&](int s, int back) { return ((me - s - back) % H + H) % H; };
  const std::vector<Span>& parts = *job.parts;
  auto len_of = [&](int host) { return parts[rail[host]].len; };
  const uint64_t chk = g_.check(ctx);
  const int steps = H - 1;
  const size_t unit = chunk_unit(job);

  Exchange x;
  OrderedSends rs_out, ag_out;
  // What each receive is: (all-gather?, step, chunk).
  struct Recv {
    bool ag;
    int step;
    size_t chunk;
  };
  std::vector<Recv> what;

  // --- reduce-scatter ---------------------------------------------------------------
  HostPartials* hp = job.partials;
  const Reduction* red = job.red;
  // Note [Half precision on the wire]: running sums cross, and are kept, in the wire type.
  const DType wire = red ? wire_type(red->dtype, g_.settings()) : DType::U8;
  const size_t wsz = hp ? dtype_size(wire) : 0, psz = hp ? dtype_size(hp->type) : 0;
  std::vector<std::vector<Span>> rs_chunks(steps);  // chunks of the part received at step s
  std::vector<char*> inbuf(steps, nullptr);         // where step s's running sums land
  std::vector<size_t> rs_first(steps, 0);           // rs_out index of step s's first send
  std::vector<std::vector<uint8_t>> got(steps);
  std::vector<size_t> received(steps, 0), reduced(steps, 0);
  size_t step0_ready = 0;
  std::unique_ptr<WirePartials> wire_partials;
  if (hp) {
    // Only the partial sent at step 0 leaves as it is; the others are added to running sums.
    const std::vector<size_t> leaving = {static_cast<size_t>(part_at(0, 1))};
    wire_partials = std::make_unique<WirePartials>(*hp, wire, *red, parts, leaving, g_);
    size_t total = 0;
    for (int s = 0; s < steps; ++s) total += len_of(part_at(s, 2)) * wsz;
    char* at = g_.incoming(total);
    for (int s = 0; s < steps; ++s) {
      inbuf[s] = at;
      at += len_of(part_at(s, 2)) * wsz;
      rs_chunks[s] = g_.net_chunks(len_of(part_at(s, 2)), wsz);
      got[s].assign(rs_chunks[s].size(), 0);
    }
    for (int s = 0; s < steps; ++s) {
      const int q = part_at(s, 1);  // sent at step s: received at step s-1 (or ours at 0)
      rs_first[s] = rs_out.ops.size();
      for (const Span& c : g_.net_chunks(len_of(q), wsz)) {
        // Step 0's are my partials, rounded to the wire type as they become final (advance).
        char* src = s == 0 ? nullptr : inbuf[s - 1] + c.off * wsz;
        rs_out.add({next, g_.tag(ctx, 1), src, c.len * wsz, chk});
      }
      for (size_t c = 0; c < rs_chunks[s].size(); ++c) {
        const Span& ch = rs_chunks[s][c];
        x.recvs.push_back({prev, g_.tag(ctx, 1), inbuf[s] + ch.off * wsz, ch.len * wsz, chk});
        what.push_back({false, s, c});
      }
    }
  }

  // --- all-gather ---------------------------------------------------------------------
  std::vector<size_t> ag_first(steps, 0);
  if (job.ag_out) {
    for (int t = 0; t < steps; ++t) {
      const Span& p = parts[rail[part_at(t, 0)]];
      ag_first[t] = ag_out.ops.size();
      for (const Span& c : g_.net_chunks(p.len, unit)) {
        // My own part (step 0) leaves from job.ag_own while it is copied into place.
        char* from = t == 0 && job.ag_own ? const_cast<char*>(job.ag_own) + c.off * job.ag_unit
                                          : job.ag_out + (p.off + c.off) * job.ag_unit;
        const size_t i = ag_out.add({next, g_.tag(ctx, 2), from, c.len * job.ag_unit, chk});
        // An all-gather sends its own part at once; an all-reduce once it is reduced.
        if (t == 0 && !hp) ag_out.ready[i] = 1;
      }
    }
    for (int t = 0; t < steps; ++t) {
      const Span& p = parts[rail[part_at(t, 1)]];
      const std::vector<Span> chunks = g_.net_chunks(p.len, unit);
      for (size_t c = 0; c < chunks.size(); ++c) {
        x.recvs.push_back({prev, g_.tag(ctx, 2), job.ag_out + (p.off + chunks[c].off) * job.ag_unit,
                           chunks[c].len * job.ag_unit, chk});
        what.push_back({true, t, c});
      }
    }
  }

  // Everything that became possible: sends of final partials, reductions of what arrived
  // (in arrival order, once this host's partial of it is final), then the sends released.
  std::vector<const void*> srcs(2);
  const std::vector<DType> types = {wire, hp ? hp->type : wire};
  const std::vector<Span> first =
      hp ? g_.net_chunks(len_of(part_at(0, 1)), wsz) : std::vector<Span>{};
  auto advance = [&] {
    if (hp) {
      for (; step0_ready < first.size(); ++step0_ready) {
        const Span& c = first[step0_ready];
        if (c.off + c.len > hp->ready(rail[part_at(0, 1)])) break;
        TransportOp& op = rs_out.ops[rs_first[0] + step0_ready];
        op.data = wire_partials->chunk(static_cast<size_t>(part_at(0, 1)), c);
        rs_out.ready[rs_first[0] + step0_ready] = 1;
      }
      for (int s = 0; s < steps; ++s) {
        const int r = part_at(s, 2);
        for (; reduced[s] < received[s]; ++reduced[s]) {
          const Span& c = rs_chunks[s][reduced[s]];
          if (c.off + c.len > hp->ready(rail[r])) break;
          Timeline::Phase phase(g_.timeline(), ctx.seq, "reduce", c.len * wsz);
          char* sum = inbuf[s] + c.off * wsz;
          srcs[0] = sum;
          srcs[1] = static_cast<const char*>(hp->ptr[r]) + c.off * psz;
          if (s + 1 < steps) {
            reduce_mixed(types, wire, sum, srcs.data(), c.len, *red, false);
            rs_out.ready[rs_first[s + 1] + reduced[s]] = 1;
          } else {
            const size_t esz = dtype_size(red->dtype);
            char* out = static_cast<char*>(job.dst) + c.off * esz;
            reduce_mixed(types, red->dtype, out, srcs.data(), c.len, *red, true);
            if (job.ag_out) ag_out.ready[ag_first[0] + reduced[s]] = 1;
            if (job.gather) job.gather->arrived(out, c.len * esz);
          }
        }
      }
    }
    rs_out.flush(x);
    ag_out.flush(x);
  };
  x.on_received = [&](size_t k) {
    const Recv& w = what[k];
    if (w.ag) {
      if (w.step + 1 < steps) ag_out.ready[ag_first[w.step + 1] + w.chunk] = 1;
      if (job.gather) job.gather->arrived(x.recvs[k].data, x.recvs[k].len);
    } else {
      got[w.step][w.chunk] = 1;
      while (received[w.step] < got[w.step].size() && got[w.step][received[w.step]]) {
        ++received[w.step];
      }
    }
    advance();
  };
  SMDDP_CHECK(!(hp && job.ag_own),
              "smddp: a ring all-reduce was given an all-gather source for its part (a bug)");
  SliceCopy own_copy;
  if (job.ag_own) {
    const Span& own = parts[g_.group_rank()];
    own_copy = {job.ag_out + own.off * job.ag_unit, job.ag_own, own.len * job.ag_unit};
    x.work = [&] { return own_copy(); };
  }
  if (hp && hp->steps) {
    x.work = [&] {
      {
        Timeline::Phase phase(g_.timeline(), ctx.seq, "local reduce_scatter");
        hp->steps->step();
      }
      advance();
      return !hp->steps->done();
    };
  }
  if (job.gather) {
    // The local all-gather's steps follow this host's reduce-scatter steps.
    x.background = [&] { return job.gather->poll(hp ? hp->steps.get() : nullptr); };
  }
  advance();
  g_.exchange(x, ctx);
  // The exchange ends once every receive is in and the shared-memory steps are done, and
  // advance() ran after each of those: everything was reduced and sent.
  SMDDP_CHECK(rs_out.all_posted() && ag_out.all_posted(),
              "smddp: the ring exchange ended with sends never posted (a bug)");
}

}  // namespace

std::unique_ptr<NetAlgorithm> make_ring(NetGroup& group) { return std::make_unique<Ring>(group); }

}  // namespace smddp
