// Recursive halving and doubling between hosts, along the rail: the third inter-host
// algorithm (Note [Inter-host algorithms] in net_algorithm.h), for many hosts and large
// messages.
//
// Note [Halving and doubling between hosts]
// The ring (Note [Rail rings] in net_ring.cpp) moves the fewest bytes per NIC but puts H-1
// steps on the critical path of each half of a collective; the mesh has one step but H-1
// flows into every NIC. Recursive halving (reduce-scatter) and doubling (all-gather) move
// the ring's bytes in log2 H steps, each with one peer.
//
// Hosts, in rail order (one rank per host with my local index; equal hosts only, as for the
// ring), are cut into P = the largest power of two <= H "cores" 0..P-1 and R = H - P
// "extras" P..H-1; extra e is paired with core e - P. This is the standard fold for host
// counts that are not powers of two: before the halving, each extra hands its partials of
// every part to its core (stage 1), and after it gets its results back (stage 4): its own
// part (reduce-scatter), every part (all-reduce) or every other part (all-gather). The fold
// costs the pair one extra transfer of the rail's data each way, so off powers of two the
// algorithm moves more than the ring; SMDDP_NET_ALGO=auto takes it only where the cost model
// says it pays (choose_net_algorithms). The other common choice, splitting the extras' data
// among several cores, balances better but needs P-way bookkeeping in every round; the fold
// keeps every round a single pair.
//
// Core c holds the parts of hosts c and c + P (if that is an extra). Halving, log2 P rounds:
// at distance d = P/2, P/4, ..., 1, core c and core c ^ d split the cores of their common
// block of 2d in two halves; each keeps the half its own index is in and sends the other
// half's running sums to its partner, then adds what the partner sent for its own half. So
// parts move whole (a part is never split between cores), and after the last round core c
// holds the final sums of its own parts: host c's result is where it belongs, and the
// extra's goes back in the fold. Off powers of two, the cores that hold an extra's part carry
// two parts where the others carry one: the rounds' halves differ by up to a part each.
// Doubling, log2 P rounds at d = 1, 2, ..., P/2: core c and core c ^ d swap the blocks of d
// cores they hold, so each ends with every part.
//
// Order and precision (Note [Half precision on the wire]): a core keeps its running sums in
// fp32 (the accumulation type, acc_type) and rounds a sum to the wire type once, where it
// leaves; each host partial is rounded once where it leaves its host, as before. Each part's
// result is computed by one rank only, its core, in an order fixed by the layout (the fold
// first, then one partner's sum per round, mine before the partner's), and every other rank
// gets those bits by the all-gather: bit-identical on every rank. The order differs from the
// mesh's (hosts 0..H-1) and the ring's, so the three may differ in the last bit; every rank
// makes the same choice between them. A part's result combines H-1 rounded values, as on the
// mesh, but each is a sum: the value a core sends at halving round i sums the partials of up
// to 2^i cores and their extras. Each host partial lies inside at most ceil(log2 H) rounded
// values (its fold, then one per round until it reaches the part's core), so with unit
// roundoff u the rounding error of a result r is at most u ceil(log2 H) times the sum over
// hosts of |P_h|, plus the fp32 sums and the final rounding of r (|r| u): log2 H times the
// mesh's bound of u sum |P_h|, where the ring's H-2 rounded running sums give up to H-1 times.
//
// Each round is one exchange with its peer, in chunks of net_chunks (Note [Pipelined
// exchanges] in comm_hier.cpp): a chunk that arrived is reduced at once while the rest still
// arrives, but a round starts only when the one before ended, so unlike the ring no chunk
// goes on before its round is over; the shared-memory steps that make the host partials run
// inside each rank's first exchange (Exchange::work), and the sends of the host partials go
// out as the steps make them final, in the order the peer posted its receives. Buffers: a
// core's share of the group's incoming buffer holds, for each part of the rail's data (T
// elements), its running sum (in the accumulation type), what arrives in a round (in the wire
// type; reused by every round: each exchange reduces all it received before it ends) and,
// where the two types differ, the rounded copies of the sums sent: 8 bytes per element of T
// for fp32 (twice the mesh's incoming buffer) and for bf16/fp16 (four times the mesh's 2).
// Extras hold nothing beyond the host partials' rounded copies.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/net_algorithm.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// Tag stages of one collective's exchanges.
constexpr int kFoldIn = 1, kHalve = 2, kDouble = 3, kFoldOut = 4;

size_t mul_checked(size_t a, size_t b) {
  size_t r = 0;
  SMDDP_CHECK(!__builtin_mul_overflow(a, b, &r), "smddp: halving-doubling buffer of ", a, " x ", b,
              " bytes overflows size_t");
  return r;
}

size_t add_checked(size_t a, size_t b) {
  size_t r = 0;
  SMDDP_CHECK(!__builtin_add_overflow(a, b, &r), "smddp: halving-doubling buffer of ", a, " + ", b,
              " bytes overflows size_t");
  return r;
}

size_t round64(size_t n) { return add_checked(n, 63) & ~size_t{63}; }

class HalvingDoubling final : public NetAlgorithm {
 public:
  explicit HalvingDoubling(NetGroup& group) : NetAlgorithm(group) {
    H_ = group.layout().hosts;
    P_ = 1;
    while (P_ * 2 <= H_) P_ *= 2;
  }
  const char* name() const override { return "halving_doubling"; }
  NetAlgo kind() const override { return NetAlgo::HALVING_DOUBLING; }
  // One phase: the first round needs half of the parts (all of them in a fold).
  size_t parts_per_step() const override { return static_cast<size_t>(g_.group_size()); }
  void run(const NetJob& job, const OpCtx& ctx) override;

  int hosts() const { return H_; }
  int cores() const { return P_; }
  // The parts (by host) that cores [a, a + n) hold, ascending: each core's and its extra's.
  std::vector<int> parts_of(int a, int n) const {
    std::vector<int> out;
    for (int c = a; c < a + n; ++c) {
      out.push_back(c);
      if (c + P_ < H_) out.push_back(c + P_);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  int H_ = 1, P_ = 1;
};

// One collective's exchanges.
class Call {
 public:
  Call(HalvingDoubling& algo, NetGroup& g, const NetJob& job, const OpCtx& ctx);
  void run();

 private:
  const std::vector<int>& rail() const { return g_.rail(); }
  size_t len_of(int q) const { return (*job_.parts)[rail()[q]].len; }
  char* acc_at(int q) const { return acc_ + roff_[q] * asz_; }
  char* recv_at(int q) const { return recv_ + roff_[q] * wsz_; }
  char* send_at(int q) const { return send_ + roff_[q] * wsz_; }
  // Where part q's final result goes: mine at dst, others in the all-gather's output, and
  // (a reduce-scatter's) my extra's in its send area until it goes back (esz <= wsz).
  char* result_at(int q) const;
  // Part q of the all-gather's data, as it is sent.
  const char* gather_src(int q) const;

  void reduce_scatter();
  void all_gather();
  // One round of the reduce-scatter with host `peer`: sends the running sums of `send`, and
  // adds what arrives for `recv` to mine; `last`: the sums are final.
  void rs_round(int peer, int stage, const std::vector<int>& send, const std::vector<int>& recv,
                bool last);
  void reduce_in(int q, const Span& c, bool last);
  // One round of the all-gather with `peer`: sends parts `send`, receives parts `recv`, in
  // units of chunk_unit (the reduce-scatter's unit in an all-reduce, so chunks line up).
  void ag_round(int peer, int stage, const std::vector<int>& send, const std::vector<int>& recv);
  // A reduce-scatter's last step for an extra: its part's result from its core.
  void rs_result_round(int peer, bool sender);
  // Runs x; in this rank's first exchange, the shared-memory steps or the own-part copy too.
  void exchange(Exchange& x, const std::function<void()>& advance);

  HalvingDoubling& algo_;
  NetGroup& g_;
  const NetJob& job_;
  const OpCtx& ctx_;
  int H_, P_, me_;
  uint64_t chk_;
  HostPartials* hp_;
  DType wire_ = DType::U8, acc_type_ = DType::U8;
  size_t wsz_ = 0, asz_ = 0, esz_ = 0, unit_ = 1;
  std::vector<size_t> roff_;     // host -> its part's offset in my buffers (elements)
  std::vector<uint8_t> in_acc_;  // host -> its part's running sum is in acc_
  std::vector<DType> types_ = std::vector<DType>(2);  // a reduction's two sources' types
  char *acc_ = nullptr, *recv_ = nullptr, *send_ = nullptr;
  std::unique_ptr<WirePartials> wire_partials_;
  SliceCopy own_copy_;
};

Call::Call(HalvingDoubling& algo, NetGroup& g, const NetJob& job, const OpCtx& ctx)
    : algo_(algo),
      g_(g),
      job_(job),
      ctx_(ctx),
      H_(algo.hosts()),
      P_(algo.cores()),
      me_(g.layout().host),
      chk_(g.check(ctx)),
      hp_(job.partials) {
  if (job.red) {
    wire_ = wire_type(job.red->dtype, g.settings());
    acc_type_ = acc_type(job.red->dtype);
    wsz_ = dtype_size(wire_);
    asz_ = dtype_size(acc_type_);
    esz_ = dtype_size(job.red->dtype);
    unit_ = wsz_;
  } else {
    unit_ = job.ag_unit;
  }
  roff_.assign(H_, 0);
  size_t total = 0;
  for (int q = 0; q < H_; ++q) {
    roff_[q] = total;
    total = add_checked(total, len_of(q));
  }
  in_acc_.assign(H_, 0);
  if (hp_ && me_ < P_) {
    // A core's running sums, what arrives in a round, and the rounded sums it sends (where
    // the types differ; a reduce-scatter's extra's result waits there too).
    const size_t acc_bytes = round64(mul_checked(total, asz_));
    const size_t wire_bytes = round64(mul_checked(total, wsz_));
    const bool sends = acc_type_ != wire_ || (!job.ag_out && me_ + P_ < H_);
    char* at = g.incoming(add_checked(acc_bytes, mul_checked(wire_bytes, sends ? 2 : 1)));
    acc_ = at;
    recv_ = at + acc_bytes;
    send_ = sends ? recv_ + wire_bytes : nullptr;
  }
  if (hp_) {
    // The host partials that leave as they are: an extra's, all of them (the fold); a core
    // with an extra adds its extra's first, so none of its own; another core, those of the
    // half it gives away in the first round.
    std::vector<size_t> leaving;
    const int c = me_ % P_;
    if (me_ >= P_) {
      for (int q = 0; q < H_; ++q) leaving.push_back(static_cast<size_t>(q));
    } else if (c + P_ >= H_) {
      const int d = P_ / 2;
      for (int q : algo_.parts_of((c & ~(2 * d - 1)) + ((c & d) ? 0 : d), d)) {
        leaving.push_back(static_cast<size_t>(q));
      }
    }
    wire_partials_ = std::make_unique<WirePartials>(*hp_, wire_, *job.red, *job.parts, leaving, g);
  }
  if (job.ag_own) {
    const Span& own = (*job.parts)[g.group_rank()];
    own_copy_ = {job.ag_out + own.off * job.ag_unit, job.ag_own, own.len * job.ag_unit};
  }
}

char* Call::result_at(int q) const {
  if (q == me_) return static_cast<char*>(job_.dst);
  if (job_.ag_out) return job_.ag_out + (*job_.parts)[rail()[q]].off * job_.ag_unit;
  return send_at(q);
}

const char* Call::gather_src(int q) const {
  if (q == me_ && job_.ag_own) return job_.ag_own;
  return job_.ag_out + (*job_.parts)[rail()[q]].off * job_.ag_unit;
}

void Call::exchange(Exchange& x, const std::function<void()>& advance) {
  HostPartials* hp = hp_;
  if (hp && hp->steps && !hp->steps->done()) {
    // Note [Pipelined exchanges]: the shared-memory steps run between the exchange's rounds.
    x.work = [&] {
      {
        Timeline::Phase phase(g_.timeline(), ctx_.seq, "local reduce_scatter");
        hp->steps->step();
      }
      advance();
      return !hp->steps->done();
    };
  } else if (own_copy_.done < own_copy_.len) {
    x.work = [&] { return own_copy_(); };
  }
  if (job_.gather) {
    x.background = [&] { return job_.gather->poll(hp ? hp->steps.get() : nullptr); };
  }
  advance();
  g_.exchange(x, ctx_);
}

void Call::reduce_in(int q, const Span& c, bool last) {
  const Reduction& red = *job_.red;
  Timeline::Phase phase(g_.timeline(), ctx_.seq, "reduce", c.len * wsz_);
  const void* srcs[2];
  if (in_acc_[q]) {
    srcs[0] = acc_at(q) + c.off * asz_;
    types_[0] = acc_type_;
  } else {
    srcs[0] = static_cast<const char*>(hp_->ptr[q]) + c.off * dtype_size(hp_->type);
    types_[0] = hp_->type;
  }
  types_[1] = wire_;
  const std::vector<DType>& types = types_;
  srcs[1] = recv_at(q) + c.off * wsz_;
  if (!last) {
    reduce_mixed(types, acc_type_, acc_at(q) + c.off * asz_, srcs, c.len, red, false);
    return;
  }
  char* out = result_at(q) + c.off * esz_;
  reduce_mixed(types, red.dtype, out, srcs, c.len, red, true);
  // An all-reduce's results go into this host's all-gather as they are made.
  if (job_.gather && job_.ag_out) job_.gather->arrived(out, c.len * esz_);
}

void Call::rs_round(int peer, int stage, const std::vector<int>& send, const std::vector<int>& recv,
                    bool last) {
  const int to = rail()[peer];
  const uint64_t tag = g_.tag(ctx_, stage);
  struct Piece {
    int q;
    Span c;
  };
  std::vector<Piece> outs, ins;
  for (int q : send) {
    for (const Span& c : g_.net_chunks(len_of(q), wsz_)) outs.push_back({q, c});
  }
  Exchange x;
  for (int q : recv) {
    for (const Span& c : g_.net_chunks(len_of(q), wsz_)) {
      x.recvs.push_back({to, tag, recv_at(q) + c.off * wsz_, c.len * wsz_, chk_});
      ins.push_back({q, c});
    }
  }
  size_t posted = 0, arrived = 0, reduced = 0;
  std::vector<uint8_t> got(ins.size(), 0);
  // Sends go out in order (the peer matches them to its receives in the order it posted
  // them), each once its data is final; what arrived is reduced in order once my running sum
  // of it is final.
  auto advance = [&] {
    for (; posted < outs.size(); ++posted) {
      const Piece& o = outs[posted];
      char* data = nullptr;
      if (!in_acc_[o.q]) {
        if (o.c.off + o.c.len > hp_->ready(rail()[o.q])) break;
        data = wire_partials_->chunk(static_cast<size_t>(o.q), o.c);
      } else if (acc_type_ == wire_) {
        data = acc_at(o.q) + o.c.off * asz_;
      } else {
        data = send_at(o.q) + o.c.off * wsz_;
        const void* src = acc_at(o.q) + o.c.off * asz_;
        reduce(acc_type_, wire_, data, &src, 1, o.c.len, *job_.red, false);
      }
      x.sends.push_back({to, tag, data, o.c.len * wsz_, chk_});
    }
    for (; reduced < arrived; ++reduced) {
      const Piece& in = ins[reduced];
      if (!in_acc_[in.q] && in.c.off + in.c.len > hp_->ready(rail()[in.q])) break;
      reduce_in(in.q, in.c, last);
    }
  };
  x.on_received = [&](size_t k) {
    got[k] = 1;
    while (arrived < got.size() && got[arrived]) ++arrived;
    advance();
  };
  exchange(x, advance);
  SMDDP_CHECK(posted == outs.size() && reduced == ins.size(),
              "smddp: a halving-doubling round ended with its sums not all sent or reduced (a "
              "bug)");
  for (int q : recv) in_acc_[q] = 1;
}

void Call::rs_result_round(int peer, bool sender) {
  const int q = sender ? peer : me_;  // the extra's part
  const uint64_t tag = g_.tag(ctx_, kFoldOut);
  Exchange x;
  char* at = sender ? send_at(q) : static_cast<char*>(job_.dst);
  for (const Span& c : g_.net_chunks(len_of(q), esz_)) {
    TransportOp op{rail()[peer], tag, at + c.off * esz_, c.len * esz_, chk_};
    (sender ? x.sends : x.recvs).push_back(op);
  }
  exchange(x, [] {});
}

void Call::reduce_scatter() {
  const int c = me_ % P_;
  if (me_ >= P_) {
    // An extra: every partial to its core, and (a reduce-scatter) its result back.
    std::vector<int> all(H_);
    for (int q = 0; q < H_; ++q) all[q] = q;
    rs_round(c, kFoldIn, all, {}, false);
    if (!job_.ag_out) rs_result_round(c, false);
    return;
  }
  const bool has_extra = c + P_ < H_;
  if (has_extra) {
    std::vector<int> all(H_);
    for (int q = 0; q < H_; ++q) all[q] = q;
    rs_round(c + P_, kFoldIn, {}, all, false);
  }
  for (int d = P_ / 2; d >= 1; d /= 2) {
    const int lo = c & ~(2 * d - 1);
    const int keep = (c & d) ? lo + d : lo, give = (c & d) ? lo : lo + d;
    rs_round(c ^ d, kHalve, algo_.parts_of(give, d), algo_.parts_of(keep, d), d == 1);
  }
  if (has_extra && !job_.ag_out) rs_result_round(c + P_, true);
}

void Call::ag_round(int peer, int stage, const std::vector<int>& send,
                    const std::vector<int>& recv) {
  const int to = rail()[peer];
  const uint64_t tag = g_.tag(ctx_, stage);
  const size_t u = job_.ag_unit;
  Exchange x;
  for (int q : send) {
    const char* from = gather_src(q);
    for (const Span& c : g_.net_chunks(len_of(q), unit_)) {
      // A send only reads its span.
      x.sends.push_back({to, tag, const_cast<char*>(from) + c.off * u, c.len * u, chk_});
    }
  }
  for (int q : recv) {
    char* into = job_.ag_out + (*job_.parts)[rail()[q]].off * u;
    for (const Span& c : g_.net_chunks(len_of(q), unit_)) {
      x.recvs.push_back({to, tag, into + c.off * u, c.len * u, chk_});
    }
  }
  if (job_.gather) {
    x.on_received = [&](size_t k) { job_.gather->arrived(x.recvs[k].data, x.recvs[k].len); };
  }
  exchange(x, [] {});
}

void Call::all_gather() {
  const int c = me_ % P_;
  const bool reduced = hp_ != nullptr;  // an all-reduce: every part is here but the extra's
  std::vector<int> all(H_);
  for (int q = 0; q < H_; ++q) all[q] = q;
  std::vector<int> but_mine;
  for (int q = 0; q < H_; ++q) {
    if (q != me_) but_mine.push_back(q);
  }
  if (me_ >= P_) {
    // An extra: its part to its core (an all-gather; an all-reduce's is there already), and
    // every part it lacks back.
    if (!reduced) ag_round(c, kFoldIn, {me_}, {});
    ag_round(c, kFoldOut, {}, reduced ? all : but_mine);
    return;
  }
  const bool has_extra = c + P_ < H_;
  if (has_extra && !reduced) ag_round(c + P_, kFoldIn, {}, {c + P_});
  for (int d = 1; d < P_; d *= 2) {
    const int p = c ^ d;
    ag_round(p, kDouble, algo_.parts_of(c & ~(d - 1), d), algo_.parts_of(p & ~(d - 1), d));
  }
  if (has_extra) {
    std::vector<int> out;
    for (int q = 0; q < H_; ++q) {
      if (reduced || q != c + P_) out.push_back(q);
    }
    ag_round(c + P_, kFoldOut, out, {});
  }
}

void Call::run() {
  if (hp_) reduce_scatter();
  if (job_.ag_out) all_gather();
}

void HalvingDoubling::run(const NetJob& job, const OpCtx& ctx) {
  SMDDP_CHECK(g_.layout().uniform && static_cast<int>(g_.rail().size()) == H_,
              "smddp: halving-doubling needs hosts of equal rank counts (a bug)");
  SMDDP_CHECK(!(job.partials && job.ag_own),
              "smddp: a halving-doubling all-reduce was given an all-gather source (a bug)");
  Call call(*this, g_, job, ctx);
  call.run();
}

}  // namespace

std::unique_ptr<NetAlgorithm> make_halving_doubling(NetGroup& group) {
  return std::make_unique<HalvingDoubling>(group);
}

}  // namespace smddp
