// The tree between hosts: recursive doubling of the rail's whole data, for small all-reduces
// (Note [Inter-host algorithms] in net_algorithm.h; when it is taken: Note [Auto by size
// and host count] in net_algorithm.cpp).
//
// Note [A tree for small all-reduces]
// The mesh, the ring and halving-doubling all cut the rail's data (the H parts one rank per
// host handles) into parts that are reduced by different hosts and then gathered: the
// fewest bytes, but a reduce-scatter and an all-gather, each of one or more sequential
// messages (the ring's 2 (H-1) of them, halving-doubling's 2 log2 H, the mesh's two hops
// with H-1 flows into every NIC). A small all-reduce is all latency: the tree moves the
// rail's whole data (T elements) in each round instead, and every host ends with every
// result after log2 H rounds of one message (per network chunk) to one peer each. It is
// recursive doubling, that is H binomial trees at once, one rooted at each host; a single
// binomial tree (reduce to one host, then broadcast) moves as many bytes per NIC but takes
// 2 log2 H rounds. The price is bytes: each host's NIC sends T in every round, log2 H times
// the data where the mesh sends 2 (H-1)/H of it, so it pays only below a size that grows
// with H (Note [Auto by size and host count]).
//
// Hosts in rail order (equal hosts only, as for the ring) are cut as in Note [Halving and
// doubling between hosts]: P = the largest power of two <= H cores, and extra host P + c
// pairs with core c. An extra sends its partials (all T elements) to its core first (the
// fold, stage 1), and gets every result back at the end (stage 3). Rounds, at d = 1, 2, ...,
// P/2: core c and core c ^ d swap their running sums (stage 2), and each adds the two.
//
// Order and precision (Note [Half precision on the wire]). Both partners of a round compute
// the same sum, so both must add the same values in the same order: each adds the value it
// sent, rounded to the wire type, never its own unrounded sum, and the lower core's value
// comes first. By induction every core of a block of 2^i cores holds the same bits after
// round i, and after the last round every core holds the same results; an extra gets its
// core's bits. So results are bit-identical on every rank, in an order fixed by the layout
// (unlike the mesh's hosts 0..H-1, so the two may differ in the last bit; every rank of a
// call makes the same choice between them, Note [Auto by size and host count]). Sums are made in
// fp32 (the accumulation type) and rounded once where they are stored: a core's first sum (its
// partial plus its extra's, rounded as it left the extra) and every round's sum are stored
// in the wire type, the last round's result in the tensor's dtype. So each host partial is
// rounded once where it leaves its host (or where it first enters a sum) and then inside
// one rounded sum per round after: at most ceil(log2 H) rounded values in all (an extra's:
// the fold, its core's first sum, then log2 P - 1 rounds; a core's: log2 P). With unit
// roundoff u the error of a result r is at most u ceil(log2 H) times the sum over hosts of
// |P_h|, plus the fp32 sums and the final rounding (|r| u): the bound of halving-doubling.
// With fp32 on the wire (SMDDP_NET_REDUCE_DTYPE=fp32) nothing is rounded before the result.
//
// Buffers (the group's incoming buffer, per rank): what it sends this round (its packed,
// rounded partials in the first), what arrives, the next round's sum (all three T elements
// of the wire type) and the results (T of the dtype), contiguous, so that a round is as few
// messages as the rail's data allows (net_chunks), whatever H is. The partials are packed chunk by
// chunk as the shared-memory steps make them final, and a chunk is sent once packed; a chunk that
// arrived is added once my own is packed (Note [Pipelined exchanges] in comm_hier.cpp). A round
// starts when the one before ended. The results go from the contiguous buffer into the
// output's parts, and into this host's all-gather, as each chunk is made; a core sends its
// extra each chunk of results as it is made, inside the last round. Nothing is written into
// the output before this rank's partial of it was read (packed, or added in the fold), and the
// sums never overwrite what is being sent (the next round's sum has its own buffer), so an
// all-reduce in place is safe.
//
// All-reduce only: the reduce-scatter and the all-gather of the tree would move H times the
// bytes of the others for nothing, so a group sends those by its other algorithm.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/net_algorithm.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// Tag stages of one all-reduce's exchanges (each round has another peer: one tag serves all).
constexpr int kFoldIn = 1, kRound = 2, kFoldOut = 3;

size_t checked_bytes(size_t elems, size_t unit) {
  size_t r = 0;
  SMDDP_CHECK(!__builtin_mul_overflow(elems, unit, &r), "smddp: tree buffer of ", elems, " x ",
              unit, " bytes overflows size_t");
  return (r + 63) & ~size_t{63};
}

class Tree final : public NetAlgorithm {
 public:
  explicit Tree(NetGroup& group) : NetAlgorithm(group) {
    H_ = group.layout().hosts;
    P_ = 1;
    while (P_ * 2 <= H_) P_ *= 2;
  }
  const char* name() const override { return "tree"; }
  NetAlgo kind() const override { return NetAlgo::TREE; }
  // One phase: the first round sends every part.
  size_t parts_per_step() const override { return static_cast<size_t>(g_.group_size()); }
  void run(const NetJob& job, const OpCtx& ctx) override;

  int hosts() const { return H_; }
  int cores() const { return P_; }

 private:
  int H_ = 1, P_ = 1;
};

// One all-reduce's exchanges.
class Call {
 public:
  Call(const Tree& algo, NetGroup& g, const NetJob& job, const OpCtx& ctx);
  void run();

 private:
  const std::vector<int>& rail() const { return g_.rail(); }
  size_t len_of(int q) const { return (*job_.parts)[rail()[q]].len; }
  // Calls f(q, at, from, n) for each piece of the span c of the rail's data: n elements of
  // host q's part, from element `at` of the part, at element `from` of the rail's data.
  template <typename F>
  void pieces(const Span& c, F&& f) const;
  // Whether this host's partials of span c are final (the shared-memory steps made them).
  bool partials_ready(const Span& c) const;
  // Span c of my partials, rounded to the wire type, into `send_`.
  void pack(const Span& c);
  // A core's first sum: span c of its partials and of its extra's (arrived in recv_).
  void add_extra(const Span& c);
  // The results of span c (in `result_`) into the output's parts and this host's all-gather.
  void place(const Span& c);

  void fold_in_send(int core);
  void fold_in_recv(int extra);
  // One round with core `peer`: swaps the running sums and adds them (the results, `last`).
  void round(int peer, bool first, bool last);
  void fold_out_recv(int core);
  // Runs x; in this rank's first exchange, the shared-memory steps too.
  void exchange(Exchange& x, const std::function<void()>& advance);

  NetGroup& g_;
  const NetJob& job_;
  const OpCtx& ctx_;
  const int H_, P_, me_;
  const uint64_t chk_;
  HostPartials& hp_;
  const Reduction& red_;
  const DType wire_;
  const size_t wsz_, esz_, psz_;
  std::vector<size_t> roff_;  // host -> its part's first element in the rail's data
  size_t total_ = 0;          // T: the rail's elements
  std::vector<Span> chunks_;  // the rail's data in network messages (in elements)
  char *send_ = nullptr, *recv_ = nullptr, *next_ = nullptr, *result_ = nullptr;
  int extra_ = -1;  // a core's extra host, or -1
  std::vector<DType> types_;
};

Call::Call(const Tree& algo, NetGroup& g, const NetJob& job, const OpCtx& ctx)
    : g_(g),
      job_(job),
      ctx_(ctx),
      H_(algo.hosts()),
      P_(algo.cores()),
      me_(g.layout().host),
      chk_(g.check(ctx)),
      hp_(*job.partials),
      red_(*job.red),
      wire_(wire_type(job.red->dtype, g.settings())),
      wsz_(dtype_size(wire_)),
      esz_(dtype_size(job.red->dtype)),
      psz_(dtype_size(job.partials->type)) {
  roff_.assign(H_, 0);
  for (int q = 0; q < H_; ++q) {
    roff_[q] = total_;
    total_ += len_of(q);
  }
  SMDDP_CHECK(job.ag_out || total_ == 0, "smddp: the tree runs all-reduces only (a bug)");
  chunks_ = g.net_chunks(total_, wsz_);
  if (me_ < P_ && me_ + P_ < H_) extra_ = me_ + P_;
  // An extra needs room to pack its partials and to receive its results; a core also what
  // arrives and the next sum.
  const size_t w = checked_bytes(total_, wsz_), e = checked_bytes(total_, esz_);
  const bool core = me_ < P_;
  char* at = g.incoming(core ? 3 * w + e : w + e);
  send_ = at;
  result_ = at + w;
  if (core) {
    recv_ = result_ + e;
    next_ = recv_ + w;
  }
}

template <typename F>
void Call::pieces(const Span& c, F&& f) const {
  const size_t end = c.off + c.len;
  // The parts are consecutive in the rail's data: the first piece's host by binary search.
  int q = static_cast<int>(std::upper_bound(roff_.begin(), roff_.end(), c.off) - roff_.begin());
  for (q = std::max(q - 1, 0); q < H_ && roff_[q] < end; ++q) {
    const size_t b = std::max(c.off, roff_[q]), e = std::min(end, roff_[q] + len_of(q));
    if (b < e) f(q, b - roff_[q], b, e - b);
  }
}

bool Call::partials_ready(const Span& c) const {
  bool ready = true;
  pieces(c, [&](int q, size_t at, size_t, size_t n) {
    ready = ready && hp_.ready(rail()[q]) >= at + n;
  });
  return ready;
}

void Call::pack(const Span& c) {
  pieces(c, [&](int q, size_t at, size_t from, size_t n) {
    const void* src = static_cast<const char*>(hp_.ptr[q]) + at * psz_;
    char* dst = send_ + from * wsz_;
    if (hp_.type == wire_) {
      std::memcpy(dst, src, n * wsz_);
    } else {
      reduce(hp_.type, wire_, dst, &src, 1, n, red_, false);
    }
  });
}

void Call::add_extra(const Span& c) {
  Timeline::Phase phase(g_.timeline(), ctx_.seq, "reduce", c.len * wsz_);
  types_ = {hp_.type, wire_};
  pieces(c, [&](int q, size_t at, size_t from, size_t n) {
    const void* srcs[2] = {static_cast<const char*>(hp_.ptr[q]) + at * psz_, recv_ + from * wsz_};
    reduce_mixed(types_, wire_, send_ + from * wsz_, srcs, n, red_, false);
  });
}

void Call::place(const Span& c) {
  pieces(c, [&](int q, size_t at, size_t from, size_t n) {
    char* out = job_.ag_out + ((*job_.parts)[rail()[q]].off + at) * esz_;
    std::memcpy(out, result_ + from * esz_, n * esz_);
    if (job_.gather) job_.gather->arrived(out, n * esz_);
  });
}

void Call::exchange(Exchange& x, const std::function<void()>& advance) {
  HostPartials* hp = &hp_;
  if (hp->steps && !hp->steps->done()) {
    // Note [Pipelined exchanges]: the shared-memory steps run between the exchange's rounds.
    x.work = [&] {
      {
        Timeline::Phase phase(g_.timeline(), ctx_.seq, "local reduce_scatter");
        hp->steps->step();
      }
      advance();
      return !hp->steps->done();
    };
  }
  if (job_.gather) x.background = [&] { return job_.gather->poll(hp->steps.get()); };
  advance();
  g_.exchange(x, ctx_);
}

void Call::fold_in_send(int core) {
  const int to = rail()[core];
  const uint64_t tag = g_.tag(ctx_, kFoldIn);
  Exchange x;
  size_t posted = 0;
  auto advance = [&] {
    for (; posted < chunks_.size() && partials_ready(chunks_[posted]); ++posted) {
      const Span& c = chunks_[posted];
      pack(c);
      x.sends.push_back({to, tag, send_ + c.off * wsz_, c.len * wsz_, chk_});
    }
  };
  exchange(x, advance);
  SMDDP_CHECK(posted == chunks_.size(), "smddp: a tree's fold ended with partials unsent (a bug)");
}

void Call::fold_in_recv(int extra) {
  const int from = rail()[extra];
  const uint64_t tag = g_.tag(ctx_, kFoldIn);
  Exchange x;
  for (const Span& c : chunks_) {
    x.recvs.push_back({from, tag, recv_ + c.off * wsz_, c.len * wsz_, chk_});
  }
  std::vector<uint8_t> got(chunks_.size(), 0);
  size_t arrived = 0, added = 0;
  auto advance = [&] {
    for (; added < arrived && partials_ready(chunks_[added]); ++added) add_extra(chunks_[added]);
  };
  x.on_received = [&](size_t k) {
    got[k] = 1;
    while (arrived < got.size() && got[arrived]) ++arrived;
    advance();
  };
  exchange(x, advance);
  SMDDP_CHECK(added == chunks_.size(), "smddp: a tree's fold ended with sums not made (a bug)");
}

void Call::round(int peer, bool first, bool last) {
  const int to = rail()[peer];
  const uint64_t tag = g_.tag(ctx_, kRound);
  const uint64_t out_tag = g_.tag(ctx_, kFoldOut);
  // The lower core's value first, on both sides (Note [A tree for small all-reduces]).
  const bool mine_first = me_ < peer;
  types_ = {wire_, wire_};
  Exchange x;
  for (const Span& c : chunks_) {
    x.recvs.push_back({to, tag, recv_ + c.off * wsz_, c.len * wsz_, chk_});
  }
  std::vector<uint8_t> got(chunks_.size(), 0);
  size_t posted = 0, arrived = 0, added = 0;
  auto add = [&](const Span& c) {
    Timeline::Phase phase(g_.timeline(), ctx_.seq, "reduce", c.len * wsz_);
    const char* mine = send_ + c.off * wsz_;
    const char* theirs = recv_ + c.off * wsz_;
    const void* srcs[2] = {mine_first ? mine : theirs, mine_first ? theirs : mine};
    if (!last) {
      reduce_mixed(types_, wire_, next_ + c.off * wsz_, srcs, c.len, red_, false);
      return;
    }
    char* out = result_ + c.off * esz_;
    reduce_mixed(types_, red_.dtype, out, srcs, c.len, red_, true);
    place(c);
    if (extra_ >= 0) x.sends.push_back({rail()[extra_], out_tag, out, c.len * esz_, chk_});
  };
  // My sums go out in order, each once it is there (packed from the partials in a round
  // without a fold before it); what arrived is added in order once mine of it went out.
  auto advance = [&] {
    for (; posted < chunks_.size(); ++posted) {
      const Span& c = chunks_[posted];
      if (first) {
        if (!partials_ready(c)) break;
        pack(c);
      }
      x.sends.push_back({to, tag, send_ + c.off * wsz_, c.len * wsz_, chk_});
    }
    for (; added < arrived && added < posted; ++added) add(chunks_[added]);
  };
  x.on_received = [&](size_t k) {
    got[k] = 1;
    while (arrived < got.size() && got[arrived]) ++arrived;
    advance();
  };
  exchange(x, advance);
  SMDDP_CHECK(posted == chunks_.size() && added == chunks_.size(),
              "smddp: a tree round ended with sums not all sent or added (a bug)");
  // The sum made is what goes out next round; the one sent is no longer read.
  if (!last) std::swap(send_, next_);
}

void Call::fold_out_recv(int core) {
  const int from = rail()[core];
  const uint64_t tag = g_.tag(ctx_, kFoldOut);
  Exchange x;
  for (const Span& c : chunks_) {
    x.recvs.push_back({from, tag, result_ + c.off * esz_, c.len * esz_, chk_});
  }
  std::vector<uint8_t> got(chunks_.size(), 0);
  size_t placed = 0;
  x.on_received = [&](size_t k) {
    got[k] = 1;
    for (; placed < got.size() && got[placed]; ++placed) place(chunks_[placed]);
  };
  exchange(x, [] {});
  SMDDP_CHECK(placed == chunks_.size(), "smddp: a tree's results arrived incomplete (a bug)");
}

void Call::run() {
  if (me_ >= P_) {
    const int core = me_ - P_;
    fold_in_send(core);
    fold_out_recv(core);
    return;
  }
  if (extra_ >= 0) fold_in_recv(extra_);
  for (int d = 1; d < P_; d *= 2) round(me_ ^ d, d == 1 && extra_ < 0, 2 * d == P_);
}

void Tree::run(const NetJob& job, const OpCtx& ctx) {
  SMDDP_CHECK(g_.layout().uniform && static_cast<int>(g_.rail().size()) == H_,
              "smddp: the tree needs hosts of equal rank counts (a bug)");
  // An all-reduce: partials, and an output (null only when it is empty).
  SMDDP_CHECK(job.partials && job.red && !job.ag_own,
              "smddp: the tree runs all-reduces only (a bug)");
  Call call(*this, g_, job, ctx);
  call.run();
}

}  // namespace

std::unique_ptr<NetAlgorithm> make_tree(NetGroup& group) { return std::make_unique<Tree>(group); }

}  // namespace smddp
