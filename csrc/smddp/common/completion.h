// What the scheduler (scheduler.h) reports an operation's outcome to, and the record of which
// schedulers the calling thread is inside (where completions, hence future callbacks, run).
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace smddp {

// The completion sink of one scheduled operation, supplied by the backend (SmddpWork's adapter
// in backend/work.h). The scheduler calls complete() exactly once, from the thread that ran
// the operation (or the one that found it could not run), with no lock of its own held, and
// destroys the sink later in the caller's thread (Note [Tensors are released in the caller's
// thread] in scheduler.h).
class Completion {
 public:
  virtual ~Completion() = default;
  // Marks the operation done, with `error` if it failed (nullptr: it succeeded). May run user
  // callbacks, which may call into the scheduler again.
  virtual void complete(std::exception_ptr error) = 0;
  // The operation's name in lower case ("all_reduce"), for errors.
  virtual std::string name() const = 0;
};
using CompletionPtr = std::unique_ptr<Completion>;

// Marks the calling thread inside the scheduler `owner` for the scope; schedulers may nest
// (a callback may wait for an item of another group, which runs that group's item there too).
class ActiveScope {
 public:
  explicit ActiveScope(const void* owner) { stack().push_back(owner); }
  ~ActiveScope() { stack().pop_back(); }
  ActiveScope(const ActiveScope&) = delete;
  ActiveScope& operator=(const ActiveScope&) = delete;
  static bool inside(const void* owner) {
    for (const void* p : stack()) {
      if (p == owner) return true;
    }
    return false;
  }

 private:
  static std::vector<const void*>& stack() {
    thread_local std::vector<const void*> s;
    return s;
  }
};

}  // namespace smddp
