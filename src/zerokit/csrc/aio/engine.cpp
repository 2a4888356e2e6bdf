#include "aio/engine.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include "aio/block_io.h"

namespace zk_aio {

Engine::Engine(const Config& cfg) : cfg_(cfg) {
  if (cfg_.block_size <= 0 || cfg_.block_size % kAlign != 0)
    throw std::invalid_argument("aio block_size must be a positive multiple of 4096, got " +
                                std::to_string(cfg_.block_size));
  if (cfg_.queue_depth < 1 || cfg_.thread_count < 1)
    throw std::invalid_argument("aio queue_depth and thread_count must be >= 1");
  const std::string& b = cfg_.backend;
  if (b != "auto" && b != "linux-aio" && b != "psync-threads")
    throw std::invalid_argument("aio backend must be 'auto', 'linux-aio' or 'psync-threads', got '" +
                                b + "'");
  if (b != "psync-threads") {
    try {
      kernel_aio_ = std::make_unique<KernelAio>(cfg_.queue_depth * cfg_.thread_count);
    } catch (const std::system_error& e) {
      std::string why = std::string("kernel AIO unavailable (") + e.what() + ")";
      if (b == "linux-aio") throw std::runtime_error(why);
      fallback_reason_ = why;
    }
  }
}

Engine::~Engine() {
  kernel_aio_.reset();  // completes its queued blocks first
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int Engine::threads() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int>(workers_.size()) + (kernel_aio_ ? 1 : 0);
}

void Engine::start_pool_locked() {
  if (!workers_.empty()) return;
  int n = cfg_.queue_depth * cfg_.thread_count;
  workers_.reserve(n);
  for (int i = 0; i < n; ++i) workers_.emplace_back([this] { worker_main(); });
}

int64_t Engine::num_blocks(int64_t nbytes, int64_t offset) const {
  if (nbytes <= 0) return 0;
  int64_t bs = cfg_.block_size;
  return (offset + nbytes - 1) / bs - offset / bs + 1;
}

int64_t Engine::submit(bool write, int fd, bool direct, char* ptr, int64_t nbytes,
                       int64_t offset, bool fsync, bool want_checksums,
                       const std::vector<uint32_t>* expected) {
  if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset");
  auto req = std::make_shared<Request>();
  req->write = write;
  req->fd = fd;
  req->direct = direct;
  req->fsync = fsync;
  req->want_checksums = want_checksums || (expected != nullptr);
  struct stat st;
  if (write && direct && ::fstat(fd, &st) == 0) {
    req->dev = static_cast<uint64_t>(st.st_dev);
    req->ino = static_cast<uint64_t>(st.st_ino);
  }
  int64_t nblocks = num_blocks(nbytes, offset);
  if (expected) {
    if (static_cast<int64_t>(expected->size()) != nblocks)
      throw std::invalid_argument("aio: " + std::to_string(expected->size()) +
                                  " expected checksums for " + std::to_string(nblocks) +
                                  " blocks");
    req->expected = *expected;
  }
  if (req->want_checksums) req->result.checksums.assign(nblocks, 0);
  req->remaining = nblocks;
  if (nblocks == 0) {
    if (fsync && write && ::fdatasync(fd) != 0) req->result.err = errno;
    req->finished = true;
  } else {  // in flight from here until its last block finishes (Request::finish_block)
    req->activity = activity_;
    activity_->begin(write);
  }
  std::vector<Block> to_kernel;
  int64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    id = next_id_++;
    requests_[id] = req;
    int64_t pos = offset, end = offset + nbytes, i = 0;
    bool pooled = false;
    while (pos < end) {
      int64_t stop = std::min(end, (pos / cfg_.block_size + 1) * cfg_.block_size);
      Block b{req, i++, ptr + (pos - offset), stop - pos, pos};
      if (kernel_aio_ && direct && b.direct_ready()) {
        to_kernel.push_back(std::move(b));
      } else {
        queue_.push_back(std::move(b));
        pooled = true;
      }
      pos = stop;
    }
    if (pooled) start_pool_locked();
  }
  kernel_blocks_ += static_cast<int64_t>(to_kernel.size());
  pool_blocks_ += nblocks - static_cast<int64_t>(to_kernel.size());
  cv_.notify_all();
  if (kernel_aio_) kernel_aio_->enqueue(std::move(to_kernel));
  return id;
}

bool Engine::done(int64_t id) {
  std::shared_ptr<Request> req;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) throw std::out_of_range("aio: unknown request id");
    req = it->second;
  }
  std::lock_guard<std::mutex> g(req->mu);
  return req->finished;
}

Result Engine::wait(int64_t id) {
  std::shared_ptr<Request> req;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) throw std::out_of_range("aio: unknown request id");
    req = it->second;
  }
  std::unique_lock<std::mutex> lk(req->mu);
  req->cv.wait(lk, [&] { return req->finished; });
  Result out = std::move(req->result);
  lk.unlock();
  std::lock_guard<std::mutex> g(mu_);
  requests_.erase(id);
  return out;
}

void Engine::worker_main() {
  // Each thread owns one bounce buffer of a block plus a sector on each side, aligned for
  // O_DIRECT; it is only touched for blocks whose memory or edges are not aligned.
  char* bounce = nullptr;
  if (::posix_memalign(reinterpret_cast<void**>(&bounce), kAlign,
                       static_cast<size_t>(cfg_.block_size + 2 * kAlign)) != 0)
    bounce = nullptr;
  for (;;) {
    Block b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stop_ and drained
      b = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!bounce) {
      b.req->finish_block(ENOMEM, b.off, 0, 0);
      continue;
    }
    run_block_sync(b, bounce);
  }
  std::free(bounce);
}

}  // namespace zk_aio
