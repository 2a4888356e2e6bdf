#include "aio/activity.h"

namespace zk_aio {

Activity::Activity() {
  auto now = Clock::now();
  for (auto& t : idle_since_) t = now;
}

void Activity::begin(bool write) {
  std::lock_guard<std::mutex> g(mu_);
  auto now = Clock::now();
  int k = write ? 1 : 0;
  for (int i : {k, kAny}) {  // idle intervals this submission closes
    if (idle(i)) idle_total_[i] += std::chrono::duration<double>(now - idle_since_[i]).count();
  }
  ++in_flight_[k];
}

void Activity::end(bool write) {
  std::lock_guard<std::mutex> g(mu_);
  auto now = Clock::now();
  int k = write ? 1 : 0;
  --in_flight_[k];
  for (int i : {k, kAny}) {  // idle intervals this completion opens
    if (idle(i)) idle_since_[i] = now;
  }
}

std::array<double, 3> Activity::idle_s() const {
  std::lock_guard<std::mutex> g(mu_);
  auto now = Clock::now();
  std::array<double, 3> out{};
  for (int i = 0; i < 3; ++i) {
    out[i] = idle_total_[i];
    if (idle(i)) out[i] += std::chrono::duration<double>(now - idle_since_[i]).count();
  }
  return out;
}

}  // namespace zk_aio
