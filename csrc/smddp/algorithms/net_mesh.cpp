// The mesh between hosts: every part crosses in one hop, each host sending to every other at
// once (Note [Hierarchical collectives] in comm.h, Note [Unequal hosts] in comm_hier.cpp).
//
// Reduce-scatter: each handler sends its host partial of part p to rank p, chunk by chunk as
// the shared-memory steps make it final; rank p reduces a chunk once every other host's copy
// arrived and its own host's partial of it is final, over the hosts in order 0..H-1 (its own
// in its place). All-gather: rank p sends its part to its handlers on the other hosts. An
// all-reduce sends each reduced chunk of its part on at once, in the same exchange (Note
// [Pipelined exchanges] in comm_hier.cpp).
#include <algorithm>
#include <vector>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/net_algorithm.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

class Mesh final : public NetAlgorithm {
 public:
  using NetAlgorithm::NetAlgorithm;
  const char* name() const override { return "mesh"; }
  NetAlgo kind() const override { return NetAlgo::MESH; }
  // One phase: the mesh sends every part at once, to every host, and needs no order.
  size_t parts_per_step() const override { return static_cast<size_t>(g_.group_size()); }
  // Every partial but my own part's goes to its part's rank as it is (Note [Unequal hosts]).
  bool sends_partials_as_made() const override { return true; }
  void run(const NetJob& job, const OpCtx& ctx) override;

 private:
  // The receives of the other hosts' parts this rank handles, into the all-gather's output.
  void allgather_recvs(Exchange& x, const NetJob& job, const OpCtx& ctx) const;
  // Sends `len` units of my part from `from` to its handlers on the other hosts.
  void send_own(Exchange& x, const NetJob& job, const char* from, size_t len,
                const OpCtx& ctx) const;
  void reduce_scatter(Exchange& x, const NetJob& job, const OpCtx& ctx);
  void allgather(Exchange& x, const NetJob& job, const OpCtx& ctx);
};

void Mesh::allgather_recvs(Exchange& x, const NetJob& job, const OpCtx& ctx) const {
  const int rank = g_.group_rank();
  const size_t unit = chunk_unit(job);
  // Note [Unequal hosts]: each part I handle comes from its rank.
  const std::vector<std::vector<int>> owned = g_.handled();
  for (int q : owned[g_.layout().local_rank]) {
    if (q == rank) continue;
    const Span& p = (*job.parts)[q];
    for (const Span& c : g_.net_chunks(p.len, unit)) {
      x.recvs.push_back({q, g_.tag(ctx, 2), job.ag_out + (p.off + c.off) * job.ag_unit,
                         c.len * job.ag_unit, g_.check(ctx)});
    }
  }
}

void Mesh::send_own(Exchange& x, const NetJob& job, const char* from, size_t len,
                    const OpCtx& ctx) const {
  const Layout& l = g_.layout();
  for (int h = 0; h < l.hosts; ++h) {
    if (h == l.host) continue;
    // A send only reads its span.
    x.sends.push_back({g_.handler(h, g_.group_rank()), g_.tag(ctx, 2), const_cast<char*>(from),
                       len * job.ag_unit, g_.check(ctx)});
  }
}

void Mesh::run(const NetJob& job, const OpCtx& ctx) {
  Exchange x;
  if (job.partials) {
    reduce_scatter(x, job, ctx);
  } else {
    allgather(x, job, ctx);
  }
}

void Mesh::reduce_scatter(Exchange& x, const NetJob& job, const OpCtx& ctx) {
  const Layout& l = g_.layout();
  const int H = l.hosts, me = l.host, rank = g_.group_rank();
  const std::vector<Span>& parts = *job.parts;
  HostPartials& hp = *job.partials;
  const Reduction& red = *job.red;
  // Note [Half precision on the wire]: partials cross in the wire type; mine stays as it is.
  const DType wire = wire_type(red.dtype, g_.settings());
  const size_t wsz = dtype_size(wire), esz = dtype_size(red.dtype), psz = dtype_size(hp.type);
  const size_t my_len = parts[rank].len;
  const std::vector<Span> mine = g_.net_chunks(my_len, wsz);
  // What the other hosts send: their partials of my part, side by side.
  char* incoming = g_.incoming(static_cast<size_t>(H) * my_len * wsz);
  auto from_host = [&](int h) { return incoming + static_cast<size_t>(h) * my_len * wsz; };
  const uint64_t chk = g_.check(ctx);
  // Note [Unequal hosts]: the partials of the parts I handle go to the parts' ranks, each
  // chunk as the shared-memory steps make it final; my own part's stays here.
  const std::vector<int>& my_parts = hp.owned[l.local_rank];
  const size_t n = my_parts.size();
  std::vector<std::vector<Span>> out(n);
  std::vector<size_t> sent(n, 0), leaving;
  const char* own_partial = nullptr;
  for (size_t k = 0; k < n; ++k) {
    if (my_parts[k] == rank) {
      own_partial = static_cast<const char*>(hp.ptr[k]);
    } else {
      out[k] = g_.net_chunks(parts[my_parts[k]].len, wsz);
      leaving.push_back(k);
    }
  }
  WirePartials wire_partials(hp, wire, red, parts, leaving, g_);
  for (int h = 0; h < H; ++h) {
    if (h == me) continue;
    for (const Span& c : mine) {
      x.recvs.push_back(
          {g_.handler(h, rank), g_.tag(ctx, 1), from_host(h) + c.off * wsz, c.len * wsz, chk});
    }
  }
  auto send_ready = [&] {
    for (size_t k = 0; k < n; ++k) {
      for (; sent[k] < out[k].size(); ++sent[k]) {
        const Span& c = out[k][sent[k]];
        if (c.off + c.len > hp.ready(my_parts[k])) break;
        x.sends.push_back(
            {my_parts[k], g_.tag(ctx, 1), wire_partials.chunk(k, c), c.len * wsz, chk});
      }
    }
  };
  const size_t rs_recvs = x.recvs.size();
  if (job.ag_out) allgather_recvs(x, job, ctx);  // an all-reduce's second half
  // recvs[k] for k < rs_recvs is chunk k % chunks of the k / chunks-th other host. A chunk
  // is reduced once every other host's copy arrived and this host's partial of it is final.
  std::vector<int> missing(mine.size(), H - 1);
  std::vector<uint8_t> done(mine.size(), 0);
  std::vector<const void*> srcs(H);
  std::vector<DType> types(H, wire);
  types[me] = hp.type;
  char* dst = static_cast<char*>(job.dst);
  auto reduce_chunk = [&](size_t c) {
    if (done[c] || missing[c] || mine[c].off + mine[c].len > hp.ready(rank)) return;
    done[c] = 1;
    const Span& ch = mine[c];
    {
      Timeline::Phase phase(g_.timeline(), ctx.seq, "reduce", ch.len * wsz);
      for (int h = 0; h < H; ++h) {
        srcs[h] = h == me ? own_partial + ch.off * psz : from_host(h) + ch.off * wsz;
      }
      reduce_mixed(types, red.dtype, dst + ch.off * esz, srcs.data(), ch.len, red, true);
    }
    // An all-reduce: the reduced chunk goes on to my part's handlers, and into this host's
    // all-gather.
    if (job.ag_out) send_own(x, job, dst + ch.off * esz, ch.len, ctx);
    if (job.gather) job.gather->arrived(dst + ch.off * esz, ch.len * esz);
  };
  x.on_received = [&](size_t k) {
    if (k >= rs_recvs) {
      if (job.gather) job.gather->arrived(x.recvs[k].data, x.recvs[k].len);
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
        Timeline::Phase phase(g_.timeline(), ctx.seq, "local reduce_scatter");
        hp.steps->step();
      }
      send_ready();
      for (size_t c = 0; c < mine.size(); ++c) reduce_chunk(c);
      return !hp.steps->done();
    };
  }
  if (job.gather) x.background = [&] { return job.gather->poll(hp.steps.get()); };
  send_ready();
  g_.exchange(x, ctx);
}

void Mesh::allgather(Exchange& x, const NetJob& job, const OpCtx& ctx) {
  const Span& own = (*job.parts)[g_.group_rank()];
  allgather_recvs(x, job, ctx);
  // Note [Own part during the exchange] in comm_hier.cpp: sent from the input while it is
  // copied into place between rounds.
  const char* from = job.ag_own ? job.ag_own : job.ag_out + own.off * job.ag_unit;
  const Layout& l = g_.layout();
  for (int h = 0; h < l.hosts; ++h) {
    if (h == l.host) continue;
    for (const Span& c : g_.net_chunks(own.len, chunk_unit(job))) {
      x.sends.push_back({g_.handler(h, g_.group_rank()), g_.tag(ctx, 2),
                         const_cast<char*>(from) + c.off * job.ag_unit, c.len * job.ag_unit,
                         g_.check(ctx)});
    }
  }
  SliceCopy own_copy{job.ag_out + own.off * job.ag_unit, job.ag_own, own.len * job.ag_unit};
  if (job.ag_own) x.work = [&] { return own_copy(); };
  if (job.gather) {
    x.on_received = [&](size_t k) { job.gather->arrived(x.recvs[k].data, x.recvs[k].len); };
    x.background = [&] { return job.gather->poll(nullptr); };
  }
  g_.exchange(x, ctx);
}

}  // namespace

std::unique_ptr<NetAlgorithm> make_mesh(NetGroup& group) { return std::make_unique<Mesh>(group); }

}  // namespace smddp
