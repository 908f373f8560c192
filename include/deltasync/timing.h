// Elapsed wall time, as every report of the library (publish, pull, sync)
// and its tools measures it.
#pragma once

#include <chrono>

namespace deltasync {

// Seconds from `start` to now, on the steady clock (so a change of the
// system time does not move it).
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace deltasync
