// When the engine's requests left the disk idle: per direction, the time no request of that
// direction was in flight (submitted, not all of its blocks finished), and the time none of
// either was. The clock runs from the engine's construction; callers take differences of two
// readings (the per-step report: tiers/nvme.py IOStats).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace zk_aio {

class Activity {
 public:
  Activity();
  void begin(bool write);  // a request was submitted
  void end(bool write);    // its last block finished
  // Seconds idle so far, the interval open now included: {no read, no write, neither}.
  std::array<double, 3> idle_s() const;

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr int kAny = 2;
  bool idle(int k) const { return k == kAny ? in_flight_[0] + in_flight_[1] == 0 : in_flight_[k] == 0; }

  mutable std::mutex mu_;
  int64_t in_flight_[2] = {0, 0};
  Clock::time_point idle_since_[3];  // when each became idle (meaningful while it is)
  double idle_total_[3] = {0, 0, 0};  // closed idle intervals, seconds
};

}  // namespace zk_aio
