// Linux kernel AIO (io_submit / io_getevents) for blocks that O_DIRECT can take as they are.
//
// Why: the thread pool parks one thread per block in flight and wakes it per completion; here
// one thread submits up to `depth` blocks in one system call and reaps whatever completed in
// one more, so the CPU cost of a stream is a few system calls per batch rather than a thread
// switch per block, and nothing wakes on the compute cores but that one thread.
//
// The syscalls are made directly with the kernel's own ABI header (<linux/aio_abi.h>), so no
// libaio is needed at build or run time. The constructor throws std::system_error where the
// kernel refuses a context (ENOSYS where AIO is compiled out, EPERM under a seccomp filter,
// EAGAIN past fs.aio-max-nr); the engine then keeps its thread pool.
#pragma once
#include <linux/aio_abi.h>

#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "aio/request.h"

namespace zk_aio {

class KernelAio {
 public:
  explicit KernelAio(int depth);
  ~KernelAio();  // completes every queued block, then stops
  KernelAio(const KernelAio&) = delete;
  KernelAio& operator=(const KernelAio&) = delete;

  // Queues direct_ready() blocks of O_DIRECT files; they run in order, `depth` at a time.
  void enqueue(std::vector<Block>&& blocks);

 private:
  struct Slot {
    Block block;
    struct iocb cb;
  };
  void loop();
  void wake();
  int fill_slots(std::vector<int>& free_slots, std::vector<struct iocb*>& batch, bool& stopping,
                 bool& skipped);
  int submit_batch(std::vector<struct iocb*>& batch, std::vector<int>& free_slots);
  void complete(Slot& s, int64_t res);

  int depth_;
  aio_context_t ctx_ = 0;
  int event_fd_ = -1;  // counts completions (IOCB_FLAG_RESFD) and enqueues: the one wait
  std::vector<Slot> slots_;
  std::mutex mu_;
  std::deque<Block> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zk_aio
