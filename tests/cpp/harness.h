// A minimal test harness for the C++ tests of the smddp core: named cases, checks that
// record file:line and go on, and ranks run as threads over an in-memory store.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "smddp/algorithms/comm.h"

namespace smddp_test {

// Failures of the running case (any thread may add one).
class Failures {
 public:
  void add(const char* file, int line, const std::string& what) {
    std::lock_guard<std::mutex> g(mu_);
    std::ostringstream os;
    os << file << ":" << line << ": " << what;
    list_.push_back(os.str());
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::string> out;
    out.swap(list_);
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> list_;
};

Failures& failures();

// EXPECT(cond, message parts...): records a failure (with file:line) and carries on, so one
// wrong element does not leave the other ranks waiting in the next collective.
#define EXPECT(cond, ...)                                                            \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      ::smddp_test::failures().add(                                                  \
          __FILE__, __LINE__,                                                        \
          std::string("expected ") + #cond + ": " + ::smddp_test::cat(__VA_ARGS__)); \
    }                                                                                \
  } while (0)

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
inline std::string cat() { return std::string(); }

// Expects `body` to throw an exception whose message contains every one of `parts`;
// returns the message ("" when nothing was thrown).
std::string expect_throw(const char* file, int line, const std::function<void()>& body,
                         const std::vector<std::string>& parts);
#define EXPECT_THROW_WITH(body, ...) \
  ::smddp_test::expect_throw(__FILE__, __LINE__, [&] { body; }, {__VA_ARGS__})

// The group's store: a map behind a mutex. get() waits for the key (the Communicator only
// asks for keys it saw with check(), but a real store's get blocks, so this one does too).
class MemKV : public smddp::KeyValue {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  bool check(const std::string& key) override;
  void remove(const std::string& key) override;
  size_t size();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

// Runs fn(rank) on `n` threads and joins them; an exception escaping fn is a failure of
// that rank.
void run_threads(int n, const std::function<void(int)>& fn);

// One group of `n` ranks as threads: each thread builds its Communicator from `cfg` (rank
// and size filled in) over one shared MemKV, runs fn(comm, rank) and destroys the
// Communicator. Exceptions escaping fn are failures.
void run_group(int n, const smddp::CommConfig& cfg,
               const std::function<void(smddp::Communicator&, int)>& fn);

// A registered test case.
struct Case {
  const char* name;
  void (*fn)();
};
std::vector<Case>& registry();
struct Register {
  Register(const char* name, void (*fn)()) { registry().push_back({name, fn}); }
};
#define TEST_CASE(name)                                        \
  static void name();                                          \
  static ::smddp_test::Register register_##name(#name, &name); \
  static void name()

double seconds_since(std::chrono::steady_clock::time_point t0);

}  // namespace smddp_test
