#include "aio/kernel_aio.h"

#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "aio/block_io.h"

namespace zk_aio {
namespace {

long sys_io_setup(unsigned n, aio_context_t* ctx) { return ::syscall(SYS_io_setup, n, ctx); }
long sys_io_destroy(aio_context_t ctx) { return ::syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** cbs) {
  return ::syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* ev,
                      struct timespec* timeout) {
  return ::syscall(SYS_io_getevents, ctx, min_nr, nr, ev, timeout);
}

}  // namespace

KernelAio::KernelAio(int depth) : depth_(depth), slots_(depth) {
  if (sys_io_setup(static_cast<unsigned>(depth), &ctx_) != 0)
    throw std::system_error(errno, std::generic_category(), "io_setup");
  event_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (event_fd_ < 0) {
    int e = errno;
    sys_io_destroy(ctx_);
    throw std::system_error(e, std::generic_category(), "eventfd");
  }
  thread_ = std::thread([this] { loop(); });
}

KernelAio::~KernelAio() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake();
  thread_.join();
  sys_io_destroy(ctx_);
  ::close(event_fd_);
}

void KernelAio::wake() {
  uint64_t one = 1;
  while (::write(event_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void KernelAio::enqueue(std::vector<Block>&& blocks) {
  if (blocks.empty()) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& b : blocks) queue_.push_back(std::move(b));
  }
  wake();
}

// Moves queued blocks into free slots and prepares their iocbs; returns how many. Blocks of a
// request that already failed are finished without I/O (`skipped`): they take no slot.
int KernelAio::fill_slots(std::vector<int>& free_slots, std::vector<struct iocb*>& batch,
                          bool& stopping, bool& skipped) {
  batch.clear();
  skipped = false;
  std::vector<Block> taken;
  {
    std::lock_guard<std::mutex> g(mu_);
    while (taken.size() < free_slots.size() && !queue_.empty()) {
      taken.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    stopping = stop_ && queue_.empty();
  }
  for (auto& b : taken) {
    Request& r = *b.req;
    if (r.failed_before(b.off)) {  // spend no disk time on a request that already failed
      r.finish_block(0, b.off, 0, 0);
      skipped = true;
      continue;
    }
    if (r.write) checksum_before_write(b);
    int s = free_slots.back();
    free_slots.pop_back();
    Slot& slot = slots_[s];
    slot.block = std::move(b);
    std::memset(&slot.cb, 0, sizeof slot.cb);
    slot.cb.aio_data = static_cast<uint64_t>(s);
    slot.cb.aio_lio_opcode = r.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    slot.cb.aio_fildes = static_cast<uint32_t>(r.fd);
    slot.cb.aio_buf = reinterpret_cast<uint64_t>(slot.block.ptr);
    slot.cb.aio_nbytes = static_cast<uint64_t>(slot.block.len);
    slot.cb.aio_offset = slot.block.off;
    slot.cb.aio_flags = IOCB_FLAG_RESFD;
    slot.cb.aio_resfd = static_cast<uint32_t>(event_fd_);
    batch.push_back(&slot.cb);
  }
  return static_cast<int>(batch.size());
}

// Submits the batch; returns how many are now in flight. A block the kernel refuses at
// submission fails with that errno; one it cannot take yet (EAGAIN) goes back to the queue.
int KernelAio::submit_batch(std::vector<struct iocb*>& batch, std::vector<int>& free_slots) {
  size_t done = 0;
  int inflight = 0;
  while (done < batch.size()) {
    long n = sys_io_submit(ctx_, static_cast<long>(batch.size() - done), batch.data() + done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      inflight += static_cast<int>(n);
      continue;
    }
    int err = n < 0 ? errno : EAGAIN;
    if (err == EINTR) continue;
    int s = static_cast<int>(batch[done]->aio_data);
    if (err == EAGAIN) {
      // Kernel resources are short: run the rest later, in their order, ahead of newer work.
      std::lock_guard<std::mutex> g(mu_);
      for (size_t i = batch.size(); i-- > done;) {
        int si = static_cast<int>(batch[i]->aio_data);
        queue_.push_front(std::move(slots_[si].block));
        free_slots.push_back(si);
      }
      if (inflight == 0) wake();  // nothing will complete to call us back: retry
      return inflight;
    }
    Block b = std::move(slots_[s].block);
    free_slots.push_back(s);
    b.req->finish_block(err, b.off, 0, 0);
    ++done;
  }
  return inflight;
}

// One finished iocb: a partial transfer is completed with positional I/O (at the end of a file,
// or after a signal), so results and errors are exactly those of the thread pool.
void KernelAio::complete(Slot& s, int64_t res) {
  Block b = std::move(s.block);
  Request& r = *b.req;
  if (res < 0) return r.finish_block(static_cast<int>(-res), b.off, 0, 0);
  if (res < b.len) {
    if (r.write) {
      int64_t rc = pwrite_full(r.fd, b.ptr + res, b.len - res, b.off + res);
      if (rc < 0) return r.finish_block(static_cast<int>(-rc), b.off, 0, 0);
    } else {
      int64_t got = res;
      if (aligned(got)) {  // an unaligned count is the end of the file already
        int64_t more = pread_full(r.fd, b.ptr + got, b.len - got, b.off + got, true);
        if (more < 0) return r.finish_block(static_cast<int>(-more), b.off, 0, 0);
        got += more;
      }
      if (got < b.len) return r.finish_block(kErrShort, b.off, got, 0);
    }
  }
  if (r.write) return r.finish_block(0, b.off, 0, b.len);
  finish_read(b);
}

void KernelAio::loop() {
  std::vector<int> free_slots;
  for (int i = depth_ - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<struct iocb*> batch;
  std::vector<struct io_event> events(static_cast<size_t>(depth_));
  int inflight = 0;
  for (;;) {
    bool stopping = false, skipped = false;
    if (fill_slots(free_slots, batch, stopping, skipped) > 0)
      inflight += submit_batch(batch, free_slots);
    if (inflight == 0 && stopping) break;
    // Skipped blocks freed no slot and nothing is in flight to wake us: the queue may still
    // hold blocks (the rest of a failed request, or other requests), so look again.
    if (inflight == 0 && skipped) continue;
    // Sleep until a completion or an enqueue bumps the counter; several coalesce into one wake.
    uint64_t count;
    while (::read(event_fd_, &count, sizeof count) < 0 && errno == EINTR) {
    }
    if (inflight == 0) continue;
    struct timespec zero = {0, 0};
    long n;
    do {
      n = sys_io_getevents(ctx_, 0, depth_, events.data(), &zero);
    } while (n < 0 && errno == EINTR);
    for (long i = 0; i < n; ++i) {
      int s = static_cast<int>(events[i].data);
      complete(slots_[s], static_cast<int64_t>(events[i].res));
      free_slots.push_back(s);
      --inflight;
    }
  }
}

}  // namespace zk_aio
