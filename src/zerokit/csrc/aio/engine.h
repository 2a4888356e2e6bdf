// The async tensor I/O engine: torch-free, raw pointers and sizes in.
//
// A request (one read or write of a large buffer at a file offset) is cut into blocks at
// multiples of block_size in *file* space, so no two blocks share a sector, and returns at once
// with an id that wait()/done() take. Two block backends, chosen at construction:
//
//  - "linux-aio" (kernel AIO, aio/kernel_aio.h): blocks of O_DIRECT files whose memory, offset
//    and length are 4096-aligned go to the kernel from one thread, queue_depth * thread_count
//    in flight. The default wherever the kernel grants an AIO context.
//  - "psync-threads": positional pread/pwrite on queue_depth * thread_count threads. It also
//    runs, under linux-aio, what the kernel cannot do asynchronously: blocks of buffered files
//    (tmpfs, filesystems refusing O_DIRECT) and the unaligned head/tail blocks of an ordinary
//    tensor, which are staged through a per-thread bounce buffer. Its threads start on first use,
//    so under linux-aio a stream of aligned blocks runs with one I/O thread in the process.
//
// single_submit and overlap_events are accepted for DeepSpeed config compatibility: submission
// is batched and completions overlap submission in both backends.
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "aio/kernel_aio.h"
#include "aio/request.h"

namespace zk_aio {

struct Config {
  int64_t block_size = 1 << 20;
  int queue_depth = 8;
  int thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
  std::string backend = "auto";  // "auto" | "linux-aio" | "psync-threads"
};

class Engine {
 public:
  // Throws std::invalid_argument for a bad config or backend name, std::runtime_error when
  // "linux-aio" was asked for and the kernel refuses it.
  explicit Engine(const Config& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a read (write=false) or write of nbytes at ptr to/from fd at offset. `direct` says
  // the fd was opened with O_DIRECT. With want_checksums, one CRC-32C per block is returned by
  // wait(); with `expected` (one per block), a read fails with kErrChecksum on a mismatch.
  // fsync makes the data durable (fdatasync) before the request counts as done.
  int64_t submit(bool write, int fd, bool direct, char* ptr, int64_t nbytes, int64_t offset,
                 bool fsync, bool want_checksums, const std::vector<uint32_t>* expected);
  bool done(int64_t id);
  Result wait(int64_t id);  // blocks; the id is forgotten afterwards
  int64_t num_blocks(int64_t nbytes, int64_t offset) const;
  const Config& config() const { return cfg_; }
  // "linux-aio" or "psync-threads": the backend direct, aligned blocks take.
  const char* backend() const { return kernel_aio_ ? "linux-aio" : "psync-threads"; }
  // Why "auto" did not get linux-aio (the kernel's refusal), else empty.
  const std::string& fallback_reason() const { return fallback_reason_; }
  int threads() const;  // threads running now (I/O pool plus the kernel-AIO thread)
  // Blocks submitted so far to each backend: which path the bytes really took.
  int64_t kernel_blocks() const { return kernel_blocks_; }
  int64_t pool_blocks() const { return pool_blocks_; }
  // Seconds no read / no write / nothing was in flight since construction (aio/activity.h).
  std::array<double, 3> idle_s() const { return activity_->idle_s(); }

 private:
  void start_pool_locked();
  void worker_main();

  Config cfg_;
  std::string fallback_reason_;
  std::unique_ptr<KernelAio> kernel_aio_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;  // blocks for the thread pool
  bool stop_ = false;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  std::vector<std::thread> workers_;
  std::atomic<int64_t> kernel_blocks_{0}, pool_blocks_{0};
  std::shared_ptr<Activity> activity_ = std::make_shared<Activity>();
};

}  // namespace zk_aio
