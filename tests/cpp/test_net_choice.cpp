// choose_net_algorithm on layouts too large to run as threads (Note [Auto beyond 32 hosts] in
// net_algorithm.cpp), and SMDDP_NET_ALGO's values: a group that only answers for its layout
// and settings, which is all the choice reads.
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
    throw std::logic_error("choose_net_algorithm read more than the layout and settings");
  }
  smddp::Layout layout_;
  smddp::Settings settings_;
  std::vector<int> rail_;
};

std::string chosen(int hosts, bool uniform, smddp::NetAlgo algo) {
  LayoutOnly g(hosts, uniform, algo);
  auto a = smddp::choose_net_algorithm(g);
  return a ? a->name() : "none";
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
      {33, true, NetAlgo::AUTO, "mesh"},
      {48, true, NetAlgo::AUTO, "mesh"},
      {64, true, NetAlgo::AUTO, "mesh"},
      {1024, true, NetAlgo::AUTO, "mesh"},
      {64, false, NetAlgo::AUTO, "mesh"},
      {2, true, NetAlgo::RING, "mesh"},
      {5, true, NetAlgo::RING, "ring"},
      {64, true, NetAlgo::MESH, "mesh"},
      {2, true, NetAlgo::HALVING_DOUBLING, "halving_doubling"},
      {6, true, NetAlgo::HALVING_DOUBLING, "halving_doubling"},
      {6, false, NetAlgo::HALVING_DOUBLING, "mesh"},
  };
  for (const Case& c : cases) {
    const std::string got = chosen(c.hosts, c.uniform, c.algo);
    EXPECT(got == c.want, c.hosts, " hosts (uniform ", c.uniform, ", net_algo ", int(c.algo),
           "): ", got, ", expected ", c.want);
  }
}

TEST_CASE(net_algo_setting_values) {
  auto env = [](const char*) -> const char* { return nullptr; };
  const smddp::Settings s = smddp::resolve_settings({{"net_algo", "Halving_Doubling"}}, env);
  EXPECT(s.net_algo == smddp::NetAlgo::HALVING_DOUBLING, "net_algo=halving_doubling not parsed");
  EXPECT(smddp::describe(s).at("net_algo") == "halving_doubling",
         "net_algo=halving_doubling not reported");
  EXPECT_THROW_WITH(smddp::resolve_settings({{"net_algo", "tree"}}, env), "tree",
                    "expected auto, mesh, ring or halving_doubling");
}

}  // namespace smddp_test
