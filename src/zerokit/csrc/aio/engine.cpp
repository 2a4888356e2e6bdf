#include "aio/engine.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "aio/crc32c.h"

namespace zk_aio {

struct Engine::Request {
  bool write = false;
  int fd = -1;
  bool direct = false;
  bool fsync = false;
  bool want_checksums = false;
  std::vector<uint32_t> expected;
  std::mutex mu;
  std::condition_variable cv;
  int64_t remaining = 0;
  bool finished = false;
  Result result;
};

namespace {

bool aligned(int64_t v) { return (v & (kAlign - 1)) == 0; }
int64_t align_down(int64_t v) { return v & ~(kAlign - 1); }
int64_t align_up(int64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

// Reads up to n bytes; stops early only at end of file. Returns bytes read or -errno. Under
// O_DIRECT a short read that ends off-alignment is the end of the file: asking again from there
// would be refused with EINVAL rather than return 0.
int64_t pread_full(int fd, char* p, int64_t n, int64_t off, bool direct) {
  int64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, p + got, static_cast<size_t>(n - got), off + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += r;
    if (direct && !aligned(got)) break;
  }
  return got;
}

// Writes all n bytes or returns -errno. A zero-byte write means no space was granted.
int64_t pwrite_full(int fd, const char* p, int64_t n, int64_t off) {
  int64_t put = 0;
  while (put < n) {
    ssize_t r = ::pwrite(fd, p + put, static_cast<size_t>(n - put), off + put);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) return -ENOSPC;
    put += r;
  }
  return put;
}

}  // namespace

Engine::Engine(const Config& cfg) : cfg_(cfg) {
  if (cfg_.block_size <= 0 || cfg_.block_size % kAlign != 0)
    throw std::invalid_argument("aio block_size must be a positive multiple of 4096, got " +
                                std::to_string(cfg_.block_size));
  if (cfg_.queue_depth < 1 || cfg_.thread_count < 1)
    throw std::invalid_argument("aio queue_depth and thread_count must be >= 1");
  int n = cfg_.queue_depth * cfg_.thread_count;
  workers_.reserve(n);
  for (int i = 0; i < n; ++i) workers_.emplace_back([this] { worker_main(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
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
  int64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    id = next_id_++;
    requests_[id] = req;
    // Blocks are cut at block_size boundaries of the file, so no two blocks share a sector and
    // blocks can be written concurrently without read-modify-write races between them.
    int64_t pos = offset, end = offset + nbytes, i = 0;
    while (pos < end) {
      int64_t stop = std::min(end, (pos / cfg_.block_size + 1) * cfg_.block_size);
      queue_.push_back(Block{req, i++, ptr + (pos - offset), stop - pos, pos});
      pos = stop;
    }
  }
  if (nblocks == 0) {
    std::lock_guard<std::mutex> g(req->mu);
    if (fsync && write && ::fdatasync(fd) != 0) req->result.err = errno;
    req->finished = true;
  }
  cv_.notify_all();
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
      finish_block(*b.req, ENOMEM, b.off, 0, 0);
      continue;
    }
    run_block(b, bounce);
  }
  std::free(bounce);
}

void Engine::run_block(const Block& b, char* bounce) {
  Request& r = *b.req;
  bool skip;
  {
    // A failed request stops spending disk time on its remaining blocks.
    std::lock_guard<std::mutex> g(r.mu);
    skip = r.result.err != 0;
  }
  if (skip) return finish_block(r, 0, b.off, 0, 0);

  bool direct = r.direct;
  bool plain = !direct || (aligned(reinterpret_cast<int64_t>(b.ptr)) && aligned(b.off) &&
                           aligned(b.len));
  uint32_t crc = 0;
  if (r.write) {
    if (r.want_checksums) crc = crc32c(0, b.ptr, static_cast<size_t>(b.len));
    int64_t rc;
    if (plain) {
      rc = pwrite_full(r.fd, b.ptr, b.len, b.off);
    } else {
      int64_t a0 = align_down(b.off), a1 = align_up(b.off + b.len), span = a1 - a0;
      // Partial sectors at the edges keep the bytes already on disk (read-modify-write); past
      // the end of the file they are zeros.
      if (a0 != b.off) {
        int64_t got = pread_full(r.fd, bounce, kAlign, a0, true);
        if (got < 0) return finish_block(r, static_cast<int>(-got), b.off, 0, 0);
        std::memset(bounce + got, 0, static_cast<size_t>(kAlign - got));
      }
      if (a1 != b.off + b.len && (span > kAlign || a0 == b.off)) {
        int64_t got = pread_full(r.fd, bounce + span - kAlign, kAlign, a1 - kAlign, true);
        if (got < 0) return finish_block(r, static_cast<int>(-got), b.off, 0, 0);
        std::memset(bounce + span - kAlign + got, 0, static_cast<size_t>(kAlign - got));
      }
      std::memcpy(bounce + (b.off - a0), b.ptr, static_cast<size_t>(b.len));
      rc = pwrite_full(r.fd, bounce, span, a0);
    }
    if (rc < 0) return finish_block(r, static_cast<int>(-rc), b.off, 0, 0);
  } else {
    if (plain) {
      int64_t got = pread_full(r.fd, b.ptr, b.len, b.off, direct);
      if (got < 0) return finish_block(r, static_cast<int>(-got), b.off, 0, 0);
      if (got < b.len) return finish_block(r, kErrShort, b.off, got, 0);
    } else {
      int64_t a0 = align_down(b.off), a1 = align_up(b.off + b.len);
      int64_t got = pread_full(r.fd, bounce, a1 - a0, a0, true);
      if (got < 0) return finish_block(r, static_cast<int>(-got), b.off, 0, 0);
      if (got < b.off + b.len - a0)
        return finish_block(r, kErrShort, b.off, std::max<int64_t>(0, got - (b.off - a0)), 0);
      std::memcpy(b.ptr, bounce + (b.off - a0), static_cast<size_t>(b.len));
    }
    if (r.want_checksums) crc = crc32c(0, b.ptr, static_cast<size_t>(b.len));
    if (!r.expected.empty() && crc != r.expected[b.index])
      return finish_block(r, kErrChecksum, b.off, crc, 0);
  }
  if (r.want_checksums) r.result.checksums[b.index] = crc;  // distinct slot per block
  finish_block(r, 0, b.off, 0, b.len);
}

void Engine::finish_block(Request& r, int err, int64_t off, int64_t got, int64_t bytes) {
  std::lock_guard<std::mutex> g(r.mu);
  r.result.bytes += bytes;
  // Keep the failure with the lowest offset, so the report names the first bad block whatever
  // order the threads ran in.
  if (err != 0 && (r.result.err == 0 || off < r.result.err_offset)) {
    r.result.err = err;
    r.result.err_offset = off;
    r.result.err_got = got;
  }
  if (--r.remaining == 0) {
    if (r.fsync && r.write && r.result.err == 0 && ::fdatasync(r.fd) != 0) {
      r.result.err = errno;
      r.result.err_offset = 0;
    }
    r.finished = true;
    r.cv.notify_all();
  }
}

}  // namespace zk_aio
