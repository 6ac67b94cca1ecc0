// Names of shared-memory segments, and the removal of segments whose creator died
// (Note [Segment lifetime] in shm.h).
#pragma once

#include <string>

namespace smddp {

// This process's PID namespace ("4026531836"), or "" when /proc does not say. Two
// processes can judge each other's liveness by pid only when these are equal.
const std::string& pid_namespace_id();

// Whether process `pid` of this PID namespace still runs. A process that exited but was not
// reaped yet is a zombie and still answers kill(pid, 0), so its state is read from /proc.
bool process_alive(int pid);

// A fresh name for a segment of this process: "/smddp_<pid namespace>_<pid>_<nonce>_<tag>".
// The creator's identity in the name lets a later process tell whether it is still alive
// without mapping the segment (a creator killed before sizing it left an empty file).
std::string segment_name(const std::string& nonce, const std::string& tag);

// Unlinks every segment in /dev/shm named by segment_name() whose creator is in this PID
// namespace, belongs to this user and is dead; returns how many it removed. Segments of
// other PID namespaces are left alone: their creators' liveness cannot be judged here.
int sweep_dead_segments();

// While a guard lives, a SIGTERM that would terminate the process (its disposition is the
// default one) first unlinks `name`. Guards nest and may live on several threads.
class UnlinkOnTerm {
 public:
  explicit UnlinkOnTerm(const std::string& name);
  ~UnlinkOnTerm();
  UnlinkOnTerm(const UnlinkOnTerm&) = delete;
  UnlinkOnTerm& operator=(const UnlinkOnTerm&) = delete;

 private:
  int slot_ = -1;  // -1: no room in the table; the name is then left to sweep_dead_segments
};

}  // namespace smddp
