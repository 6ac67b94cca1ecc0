#include "harness.h"

#include <signal.h>
#include <unistd.h>

#include <exception>
#include <string>

namespace smddp_test {

Failures& failures() {
  static Failures f;
  return f;
}

std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string expect_throw(const char* file, int line, const std::function<void()>& body,
                         const std::vector<std::string>& parts) {
  try {
    body();
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        failures().add(file, line, "the error does not contain '" + p + "': " + msg);
      }
    }
    return msg;
  }
  failures().add(file, line, "expected an error, none was raised");
  return "";
}

void MemKV::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> g(mu_);
    map_[key] = value;
  }
  cv_.notify_all();
}

std::string MemKV::get(const std::string& key) {
  std::unique_lock<std::mutex> g(mu_);
  // A real store's get waits up to its timeout; 60 s is far beyond any case here.
  if (!cv_.wait_for(g, std::chrono::seconds(60), [&] { return map_.count(key) > 0; })) {
    throw std::runtime_error("MemKV: key '" + key + "' never set");
  }
  return map_[key];
}

bool MemKV::check(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  return map_.count(key) > 0;
}

void MemKV::remove(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  map_.erase(key);
}

size_t MemKV::size() {
  std::lock_guard<std::mutex> g(mu_);
  return map_.size();
}

void run_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&fn, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        failures().add(__FILE__, __LINE__, "rank " + std::to_string(r) + " raised: " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
}

void run_group(int n, const smddp::CommConfig& cfg,
               const std::function<void(smddp::Communicator&, int)>& fn) {
  MemKV kv;
  run_threads(n, [&](int r) {
    smddp::CommConfig c = cfg;
    c.rank = r;
    c.size = n;
    smddp::Communicator comm(kv, c);
    fn(comm, r);
  });
}

}  // namespace smddp_test

namespace {

// A case that hangs must not hang the run: each case gets kCaseLimitS, after which the run
// names the case and exits with status 3 (the suite then fails at once, with the name, instead
// of waiting out its own timeout with the output lost). The longest case takes a few seconds
// on a loaded 2-core machine.
constexpr unsigned kCaseLimitS = 120;
std::string g_hung_message;  // written before each case: the handler only writes it out

void on_case_limit(int) {
  // Only async-signal-safe calls here.
  (void)!write(STDOUT_FILENO, g_hung_message.data(), g_hung_message.size());
  _exit(3);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace smddp_test;
  signal(SIGALRM, on_case_limit);
  int failed = 0, ran = 0;
  auto t_all = std::chrono::steady_clock::now();
  for (const Case& c : registry()) {
    bool selected = argc < 2;
    for (int i = 1; i < argc; ++i)
      selected = selected || std::string(c.name).find(argv[i]) != std::string::npos;
    if (!selected) continue;
    ++ran;
    auto t0 = std::chrono::steady_clock::now();
    g_hung_message = std::string("\nFAIL the case ") + c.name + " ran past the per-case limit of " +
                     std::to_string(kCaseLimitS) + " s: stopped as hung\n";
    alarm(kCaseLimitS);
    try {
      c.fn();
    } catch (const std::exception& e) {
      failures().add(__FILE__, __LINE__, std::string("the case raised: ") + e.what());
    }
    alarm(0);
    auto list = failures().take();
    std::printf("%-4s %-40s %6.2f s\n", list.empty() ? "ok" : "FAIL", c.name, seconds_since(t0));
    for (size_t i = 0; i < list.size() && i < 20; ++i) std::printf("     %s\n", list[i].c_str());
    if (list.size() > 20) std::printf("     ... and %zu more\n", list.size() - 20);
    std::fflush(stdout);
    failed += list.empty() ? 0 : 1;
  }
  std::printf("%d of %d cases passed in %.1f s\n", ran - failed, ran, seconds_since(t_all));
  return failed || ran == 0 ? 1 : 0;
}
