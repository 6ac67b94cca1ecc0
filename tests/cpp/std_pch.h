// The standard library headers of csrc/smddp and tests/cpp, compiled once per build variant
// into a precompiled header that the Makefile's C++ test builds force-include in every file
// (Note [Precompiled standard headers] in the Makefile). Adding a header here is an
// optimisation only: each file still includes what it uses, which the extension build (no
// precompiled header) checks.

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
