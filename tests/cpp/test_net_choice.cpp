// choose_net_algorithms on layouts too large to run as threads (Note [The group's algorithm
// under auto] in net_algorithm.cpp), the per-call choice of the tree (Note [Auto by size and host
// count]), and SMDDP_NET_ALGO's values: a group that only answers for its layout and settings,
// which is all the choice reads.
#include <stdexcept>

#include "harness.h"
#include "smddp/algorithms/net_algorithm.h"
#include "smddp/common/settings.h"

namespace smddp_test {
namespace {

class LayoutOnly final : public smddp::NetGroup {
 public:
  LayoutOnly(int hosts, bool uniform, smddp::NetAlgo algo) {
    layout_.hosts = hosts;
    layout_.uniform = uniform;
    layout_.members.resize(hosts);
    settings_.net_algo = algo;
  }
  const smddp::Layout& layout() const override { return layout_; }
  int group_rank() const override { return 0; }
  int group_size() const override { return layout_.hosts; }
  int handler(int, int) const override { return unused<int>(); }
  std::vector<std::vector<int>> handled() const override {
    return unused<std::vector<std::vector<int>>>();
  }
  int host_of(int) const override { return unused<int>(); }
  const std::vector<int>& rail() const override { return rail_; }
  std::vector<smddp::Span> net_chunks(size_t, size_t) const override {
    return unused<std::vector<smddp::Span>>();
  }
  uint64_t tag(const smddp::OpCtx&, int) const override { return unused<uint64_t>(); }
  uint64_t check(const smddp::OpCtx&) const override { return unused<uint64_t>(); }
  void exchange(smddp::Exchange&, const smddp::OpCtx&) override { unused<int>(); }
  char* incoming(size_t) override { return unused<char*>(); }
  char* staging(size_t) override { return unused<char*>(); }
  smddp::Timeline& timeline() override { return *unused<smddp::Timeline*>(); }
  const smddp::Settings& settings() const override { return settings_; }

 private:
  template <typename T>
  static T unused() {
    throw std::logic_error("choose_net_algorithms read more than the layout and settings");
  }
  smddp::Layout layout_;
  smddp::Settings settings_;
  std::vector<int> rail_;
};

std::string chosen(int hosts, bool uniform, smddp::NetAlgo algo) {
  LayoutOnly g(hosts, uniform, algo);
  smddp::NetAlgorithms a = smddp::choose_net_algorithms(g);
  return a.main ? a.main->name() : "none";
}

}  // namespace

TEST_CASE(net_choice_by_layout_and_setting) {
  using smddp::NetAlgo;
  struct Case {
    int hosts;
    bool uniform;
    NetAlgo algo;
    const char* want;
  };
  const Case cases[] = {
      {1, true, NetAlgo::AUTO, "none"},
      {2, true, NetAlgo::AUTO, "mesh"},
      {3, true, NetAlgo::AUTO, "ring"},
      {32, true, NetAlgo::AUTO, "ring"},
      // The model's choice beyond the 32 hosts measured (it was the mesh before 2026-11-30).
      {33, true, NetAlgo::AUTO, "ring"},
      {48, true, NetAlgo::AUTO, "ring"},
      {64, true, NetAlgo::AUTO, "ring"},
      {1024, true, NetAlgo::AUTO, "ring"},
      {5000, true, NetAlgo::AUTO, "ring"},
      {64, false, NetAlgo::AUTO, "mesh"},
      {2, true, NetAlgo::RING, "mesh"},
      {5, true, NetAlgo::RING, "ring"},
      {64, true, NetAlgo::MESH, "mesh"},
      {2, true, NetAlgo::HALVING_DOUBLING, "halving_doubling"},
      {6, true, NetAlgo::HALVING_DOUBLING, "halving_doubling"},
      {6, false, NetAlgo::HALVING_DOUBLING, "mesh"},
      // The tree takes all-reduces only; the rest go as auto sends them.
      {2, true, NetAlgo::TREE, "mesh"},
      {5, true, NetAlgo::TREE, "ring"},
      {64, true, NetAlgo::TREE, "ring"},
      {5, false, NetAlgo::TREE, "mesh"},
  };
  for (const Case& c : cases) {
    const std::string got = chosen(c.hosts, c.uniform, c.algo);
    EXPECT(got == c.want, c.hosts, " hosts (uniform ", c.uniform, ", net_algo ", int(c.algo),
           "): ", got, ", expected ", c.want);
  }
}

// Note [Auto by size and host count]: under auto an all_reduce of at most
// auto_tree_max_bytes(H) takes the tree, one byte more halving-doubling where the rule has it
// there, else the group's algorithm; any collective the tree does not take goes by
// halving-doubling up to its kind's size and by the group's algorithm above it.
// net_algo=tree sends every all_reduce by the tree and the rest as auto does; the forced
// others never take the tree or leave their algorithm; hosts of unequal rank counts neither.
// Where the rule says 0 (none), auto keeps no tree (no halving-doubling).
TEST_CASE(net_choice_per_call) {
  using smddp::NetAlgo;
  using smddp::NetOp;
  const NetOp kinds[] = {NetOp::ALL_REDUCE, NetOp::REDUCE_SCATTER, NetOp::ALL_GATHER};
  int with_tree = 0, with_doubling = 0;
  for (int hosts : {2, 3, 4, 5, 8, 16, 21, 31, 32, 33, 64, 100, 257, 1024}) {
    const smddp::AutoBySize rule = smddp::auto_by_size(hosts);
    const size_t max = rule.tree_max_bytes;
    EXPECT(smddp::auto_tree_max_bytes(hosts) == max, hosts, " hosts: two answers for the tree");
    LayoutOnly g(hosts, true, NetAlgo::AUTO);
    const smddp::NetAlgorithms a = smddp::choose_net_algorithms(g);
    const std::string main = a.main->name();
    // Note [The group's algorithm under auto]: the rule's, a ring only from 3 hosts.
    const bool ring = rule.main == NetAlgo::RING;
    EXPECT(main == (ring ? "ring" : "mesh"), hosts, " hosts: the group's algorithm is ", main);
    EXPECT(ring == (hosts >= 3), hosts, " hosts: the rule's group algorithm is ", int(rule.main));
    bool doubling = false;
    for (NetOp op : kinds) {
      const size_t dmax = rule.doubling_max_bytes[static_cast<size_t>(op)];
      const size_t above = op == NetOp::ALL_REDUCE ? max : 0;
      if (dmax <= above) continue;
      doubling = true;
      EXPECT(std::string(a.pick(op, dmax).name()) == "halving_doubling", hosts, " hosts, kind ",
             int(op), ": ", dmax, " bytes took ", a.pick(op, dmax).name());
      EXPECT(a.pick(op, dmax + 1).name() == main, hosts, " hosts, kind ", int(op), ": ", dmax + 1,
             " bytes took ", a.pick(op, dmax + 1).name());
      if (op != NetOp::ALL_REDUCE) {
        EXPECT(std::string(a.pick(op, 0).name()) == "halving_doubling", hosts, " hosts, kind ",
               int(op), ": an empty call took ", a.pick(op, 0).name());
      }
    }
    with_doubling += doubling;
    EXPECT(static_cast<bool>(a.doubling) == doubling, hosts, " hosts: halving-doubling kept ",
           static_cast<bool>(a.doubling), " where the rule says ", doubling);
    if (!doubling) {
      for (NetOp op : {NetOp::REDUCE_SCATTER, NetOp::ALL_GATHER}) {
        EXPECT(a.pick(op, 0).name() == main, hosts, " hosts: a small other collective took ",
               a.pick(op, 0).name());
      }
    }
    for (NetAlgo other : {NetAlgo::MESH, NetAlgo::RING, NetAlgo::HALVING_DOUBLING}) {
      LayoutOnly g2(hosts, true, other);
      const smddp::NetAlgorithms o = smddp::choose_net_algorithms(g2);
      for (NetOp op : kinds) {
        EXPECT(o.pick(op, 0).name() == std::string(o.main->name()), hosts, " hosts, net_algo ",
               int(other), ": kind ", int(op), " left the forced algorithm");
      }
    }
    if (max == 0) {
      EXPECT(!a.tree && a.pick(NetOp::ALL_REDUCE, 0).name() != std::string("tree"), hosts,
             " hosts: a tree the rule has not");
      continue;
    }
    ++with_tree;
    EXPECT(a.tree_max_bytes == max, hosts, " hosts: the tree up to ", a.tree_max_bytes,
           " bytes, the rule says ", max);
    EXPECT(std::string(a.pick(NetOp::ALL_REDUCE, 0).name()) == "tree", hosts,
           " hosts: an empty all_reduce");
    EXPECT(std::string(a.pick(NetOp::ALL_REDUCE, max).name()) == "tree", hosts, " hosts: ", max,
           " bytes");
    EXPECT(std::string(a.pick(NetOp::ALL_REDUCE, max + 1).name()) != "tree", hosts,
           " hosts: ", max + 1, " bytes took the tree");
    LayoutOnly forced(hosts, true, NetAlgo::TREE);
    const smddp::NetAlgorithms t = smddp::choose_net_algorithms(forced);
    EXPECT(std::string(t.pick(NetOp::ALL_REDUCE, size_t(1) << 40).name()) == "tree", hosts,
           " hosts: net_algo=tree, a 1 TiB all_reduce");
    EXPECT(t.doubling_max_bytes[static_cast<size_t>(NetOp::ALL_REDUCE)] == 0, hosts,
           " hosts: net_algo=tree keeps a halving-doubling range for all_reduces");
    for (NetOp op : {NetOp::REDUCE_SCATTER, NetOp::ALL_GATHER}) {
      EXPECT(std::string(t.pick(op, size_t(1) << 41).name()) == a.pick(op, size_t(1) << 41).name(),
             hosts, " hosts: net_algo=tree sends a large other collective as auto does not");
      EXPECT(std::string(t.pick(op, 0).name()) == a.pick(op, 0).name(), hosts,
             " hosts: net_algo=tree sends a small other collective as auto does not");
    }
    LayoutOnly uneven(hosts, false, NetAlgo::TREE);
    EXPECT(!smddp::choose_net_algorithms(uneven).tree, hosts, " unequal hosts took the tree");
    LayoutOnly uneven_auto(hosts, false, NetAlgo::AUTO);
    EXPECT(!smddp::choose_net_algorithms(uneven_auto).doubling, hosts,
           " unequal hosts took halving-doubling");
  }
  // A kind without a range keeps the group's algorithm even for an empty call, where another
  // kind has one (here with the tree taken away, which would take an empty all_reduce).
  for (int hosts = 3; hosts <= 64; ++hosts) {
    const smddp::AutoBySize rule = smddp::auto_by_size(hosts);
    const size_t ar = rule.doubling_max_bytes[static_cast<size_t>(NetOp::ALL_REDUCE)];
    const size_t rs = rule.doubling_max_bytes[static_cast<size_t>(NetOp::REDUCE_SCATTER)];
    if (ar != 0 || rs == 0) continue;
    LayoutOnly g(hosts, true, NetAlgo::AUTO);
    smddp::NetAlgorithms a = smddp::choose_net_algorithms(g);
    a.tree.reset();
    EXPECT(a.pick(NetOp::ALL_REDUCE, 0).name() == std::string(a.main->name()), hosts,
           " hosts: an empty all_reduce took ", a.pick(NetOp::ALL_REDUCE, 0).name(),
           " where the rule gives all_reduces no halving-doubling");
    EXPECT(std::string(a.pick(NetOp::REDUCE_SCATTER, 0).name()) == "halving_doubling", hosts,
           " hosts: an empty reduce_scatter");
    break;
  }
  // The model's rule (tests/unit/test_cost_model.py holds the table to it) takes the tree on
  // some of these host counts and halving-doubling on others.
  EXPECT(with_tree >= 4, "auto takes the tree on only ", with_tree, " of 14 host counts");
  EXPECT(with_doubling >= 2, "auto takes halving-doubling on only ", with_doubling,
         " of 14 host counts");
  EXPECT(smddp::auto_tree_max_bytes(1) == 0, "one host has a tree");
  LayoutOnly one(1, true, NetAlgo::AUTO);
  EXPECT(!smddp::choose_net_algorithms(one).main, "one host crosses nothing");
}

TEST_CASE(net_algo_setting_values) {
  auto env = [](const char*) -> const char* { return nullptr; };
  const smddp::Settings s = smddp::resolve_settings({{"net_algo", "Halving_Doubling"}}, env);
  EXPECT(s.net_algo == smddp::NetAlgo::HALVING_DOUBLING, "net_algo=halving_doubling not parsed");
  EXPECT(smddp::describe(s).at("net_algo") == "halving_doubling",
         "net_algo=halving_doubling not reported");
  const smddp::Settings t = smddp::resolve_settings({{"net_algo", "TREE"}}, env);
  EXPECT(t.net_algo == smddp::NetAlgo::TREE, "net_algo=tree not parsed");
  EXPECT(smddp::describe(t).at("net_algo") == "tree", "net_algo=tree not reported");
  EXPECT_THROW_WITH(smddp::resolve_settings({{"net_algo", "binomial"}}, env), "binomial",
                    "expected auto, mesh, ring, halving_doubling or tree");
}

}  // namespace smddp_test
