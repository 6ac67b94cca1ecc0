#include "smddp/transport/shm/shm_names.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>

namespace smddp {
namespace {

constexpr char kPrefix[] = "smddp_";

// Splits "smddp_<ns>_<pid>_..." into its namespace and pid; false for other names.
bool parse_name(const char* name, std::string& ns, int& pid) {
  if (std::strncmp(name, kPrefix, sizeof(kPrefix) - 1) != 0) return false;
  const char* p = name + sizeof(kPrefix) - 1;
  const char* us = std::strchr(p, '_');
  if (!us || us == p) return false;
  ns.assign(p, us);
  char* end = nullptr;
  long v = std::strtol(us + 1, &end, 10);
  if (end == us + 1 || *end != '_' || v <= 0 || v > (1L << 30)) return false;
  pid = static_cast<int>(v);
  return true;
}

// Note [Unlink on SIGTERM]: the names to unlink live in a fixed table of plain char arrays
// so that the handler only reads memory and calls unlink(), both async-signal-safe.
constexpr int kSlots = 32;
constexpr size_t kPathBytes = 160;
char g_paths[kSlots][kPathBytes];
std::atomic<bool> g_used[kSlots];
std::mutex g_mu;  // guards the installation below and slot allocation
int g_guards = 0;
struct sigaction g_previous;

void on_term(int sig) {
  for (int i = 0; i < kSlots; ++i) {
    if (g_used[i].load(std::memory_order_acquire)) unlink(g_paths[i]);
  }
  // The previous disposition was the default one (nothing else is replaced): restore it
  // and terminate as the signal meant to. The signal is blocked while its handler runs,
  // so it is delivered again as soon as this returns.
  sigaction(sig, &g_previous, nullptr);
  raise(sig);
}

}  // namespace

const std::string& pid_namespace_id() {
  static const std::string id = [] {
    char buf[128] = {0};
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
    std::string link(buf, n > 0 ? static_cast<size_t>(n) : 0);  // "pid:[4026531836]"
    auto open = link.find('['), close = link.find(']');
    if (open == std::string::npos || close == std::string::npos || close <= open + 1)
      return std::string();
    return link.substr(open + 1, close - open - 1);
  }();
  return id;
}

bool process_alive(int pid) {
  if (pid <= 0) return true;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  auto p = line.rfind(')');
  if (p == std::string::npos || p + 2 >= line.size()) return true;
  char state = line[p + 2];
  return state != 'Z' && state != 'X';
}

std::string segment_name(const std::string& nonce, const std::string& tag) {
  const std::string& ns = pid_namespace_id();
  return std::string("/") + kPrefix + (ns.empty() ? "0" : ns) + "_" + std::to_string(getpid()) +
         "_" + nonce + "_" + tag;
}

int sweep_dead_segments() {
  const std::string& mine = pid_namespace_id();
  if (mine.empty()) return 0;  // liveness cannot be judged
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  const uid_t me = geteuid();
  while (dirent* e = readdir(dir)) {
    std::string ns;
    int pid = 0;
    if (!parse_name(e->d_name, ns, pid) || ns != mine) continue;
    struct stat st;
    if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != me ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    if (process_alive(pid)) continue;
    if (shm_unlink((std::string("/") + e->d_name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

UnlinkOnTerm::UnlinkOnTerm(const std::string& name) {
  const std::string path = "/dev/shm" + name;
  if (path.size() >= kPathBytes) return;
  std::lock_guard<std::mutex> g(g_mu);
  if (g_guards == 0) {
    // Only a SIGTERM that would kill the process is intercepted: a program that handles
    // or ignores it keeps its behaviour (and its segments, until the next sweep).
    struct sigaction current;
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != SIG_DFL ||
        (current.sa_flags & SA_SIGINFO)) {
      return;
    }
    struct sigaction ours{};
    ours.sa_handler = on_term;
    sigemptyset(&ours.sa_mask);
    if (sigaction(SIGTERM, &ours, &g_previous) != 0) return;
  } else {
    struct sigaction current;
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != on_term) return;
  }
  for (int i = 0; i < kSlots; ++i) {
    if (g_used[i].load()) continue;
    std::memcpy(g_paths[i], path.c_str(), path.size() + 1);
    g_used[i].store(true, std::memory_order_release);
    slot_ = i;
    break;
  }
  if (slot_ >= 0) {
    ++g_guards;
  } else if (g_guards == 0) {
    sigaction(SIGTERM, &g_previous, nullptr);
  }
}

UnlinkOnTerm::~UnlinkOnTerm() {
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> g(g_mu);
  g_used[slot_].store(false, std::memory_order_release);
  if (--g_guards == 0) {
    // Restore the default only if nobody installed another handler meanwhile.
    struct sigaction current;
    if (sigaction(SIGTERM, nullptr, &current) == 0 && current.sa_handler == on_term) {
      sigaction(SIGTERM, &g_previous, nullptr);
    }
  }
}

}  // namespace smddp
