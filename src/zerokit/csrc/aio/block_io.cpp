#include "aio/block_io.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "aio/crc32c.h"

namespace zk_aio {

bool Request::failed_before(int64_t off) {
  std::lock_guard<std::mutex> g(mu);
  return result.err != 0 && result.err_offset < off;
}

void Request::finish_block(int err, int64_t off, int64_t got, int64_t bytes) {
  std::lock_guard<std::mutex> g(mu);
  result.bytes += bytes;
  // Keep the failure with the lowest offset, so the report names the first bad block whatever
  // order the blocks completed in.
  if (err != 0 && (result.err == 0 || off < result.err_offset)) {
    result.err = err;
    result.err_offset = off;
    result.err_got = got;
  }
  if (--remaining == 0) {
    if (fsync && write && result.err == 0 && ::fdatasync(fd) != 0) {
      result.err = errno;
      result.err_offset = 0;
    }
    if (activity) activity->end(write);
    finished = true;
    cv.notify_all();
  }
}

namespace {

// Calls io(done) until n bytes have moved, retrying EINTR; stops early where io returns 0, or,
// with stop_unaligned, once the count is off-alignment. Returns the bytes moved or -errno.
template <class Io>
int64_t move_all(int64_t n, bool stop_unaligned, Io io) {
  int64_t done = 0;
  while (done < n) {
    ssize_t r = io(done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    done += r;
    if (stop_unaligned && !aligned(done)) break;
  }
  return done;
}

}  // namespace

// Under O_DIRECT a short read that ends off-alignment is the end of the file: asking again from
// there would be refused with EINVAL rather than return 0.
int64_t pread_full(int fd, char* p, int64_t n, int64_t off, bool direct) {
  return move_all(n, direct, [&](int64_t d) {
    return ::pread(fd, p + d, static_cast<size_t>(n - d), off + d);
  });
}

// A zero-byte write means no space was granted.
int64_t pwrite_full(int fd, const char* p, int64_t n, int64_t off) {
  int64_t put = move_all(n, false, [&](int64_t d) {
    return ::pwrite(fd, p + d, static_cast<size_t>(n - d), off + d);
  });
  return (put >= 0 && put < n) ? -ENOSPC : put;
}

void checksum_before_write(const Block& b) {
  Request& r = *b.req;
  // Each block owns its slot; the vector is only read after the request has finished.
  if (r.want_checksums) r.result.checksums[b.index] = crc32c(0, b.ptr, static_cast<size_t>(b.len));
}

void finish_read(const Block& b) {
  Request& r = *b.req;
  if (r.want_checksums) {
    uint32_t crc = crc32c(0, b.ptr, static_cast<size_t>(b.len));
    if (!r.expected.empty() && crc != r.expected[b.index])
      return r.finish_block(kErrChecksum, b.off, crc, 0);
    r.result.checksums[b.index] = crc;
  }
  r.finish_block(0, b.off, 0, b.len);
}

namespace {

// Sector locks, process-wide: two requests (of any engine) whose unaligned edges fall in one
// sector of one file would otherwise race, each reading the sector, patching its own bytes in
// and writing the whole sector back over the other's. A staged write holds the stripes of its
// partial edge sectors from the read to the write. Aligned blocks never share a sector.
constexpr size_t kSectorStripes = 256;
std::mutex sector_stripes[kSectorStripes];

size_t sector_stripe(const Request& r, int64_t offset) {
  uint64_t h = r.dev * 0x9E3779B97F4A7C15ull;
  h ^= r.ino + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
  h ^= static_cast<uint64_t>(offset / kAlign) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 33;  // splitmix64 finaliser
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  return static_cast<size_t>(h % kSectorStripes);
}

// Holds the stripes of up to two sectors, taken in index order (once where they coincide), so
// two blocks each needing two stripes cannot deadlock.
class SectorLocks {
 public:
  void add(size_t stripe) { ids_[n_++] = stripe; }
  void lock() {
    if (n_ == 2 && ids_[1] < ids_[0]) std::swap(ids_[0], ids_[1]);
    if (n_ == 2 && ids_[0] == ids_[1]) n_ = 1;
    for (int i = 0; i < n_; ++i) sector_stripes[ids_[i]].lock();
  }
  ~SectorLocks() {
    for (int i = n_; i-- > 0;) sector_stripes[ids_[i]].unlock();
  }

 private:
  size_t ids_[2] = {0, 0};
  int n_ = 0;
};

// Writes a block O_DIRECT cannot take as it is: partial sectors at its edges keep the bytes
// already on disk (read-modify-write, under their sector locks); past the end of the file they
// are zeros.
int64_t write_staged(const Block& b, char* bounce) {
  int fd = b.req->fd;
  int64_t a0 = align_down(b.off), a1 = align_up(b.off + b.len), span = a1 - a0;
  SectorLocks locks;
  if (a0 != b.off) locks.add(sector_stripe(*b.req, a0));
  if (a1 != b.off + b.len) locks.add(sector_stripe(*b.req, a1 - kAlign));
  locks.lock();
  if (a0 != b.off) {
    int64_t got = pread_full(fd, bounce, kAlign, a0, true);
    if (got < 0) return got;
    std::memset(bounce + got, 0, static_cast<size_t>(kAlign - got));
  }
  if (a1 != b.off + b.len && (span > kAlign || a0 == b.off)) {
    int64_t got = pread_full(fd, bounce + span - kAlign, kAlign, a1 - kAlign, true);
    if (got < 0) return got;
    std::memset(bounce + span - kAlign + got, 0, static_cast<size_t>(kAlign - got));
  }
  std::memcpy(bounce + (b.off - a0), b.ptr, static_cast<size_t>(b.len));
  return pwrite_full(fd, bounce, span, a0);
}

}  // namespace

void run_block_sync(const Block& b, char* bounce) {
  Request& r = *b.req;
  if (r.failed_before(b.off)) return r.finish_block(0, b.off, 0, 0);  // spend no disk time on a lost cause
  bool staged = r.direct && !b.direct_ready();
  if (r.write) {
    checksum_before_write(b);
    int64_t rc = staged ? write_staged(b, bounce) : pwrite_full(r.fd, b.ptr, b.len, b.off);
    if (rc < 0) return r.finish_block(static_cast<int>(-rc), b.off, 0, 0);
    return r.finish_block(0, b.off, 0, b.len);
  }
  if (!staged) {
    int64_t got = pread_full(r.fd, b.ptr, b.len, b.off, r.direct);
    if (got < 0) return r.finish_block(static_cast<int>(-got), b.off, 0, 0);
    if (got < b.len) return r.finish_block(kErrShort, b.off, got, 0);
  } else {
    int64_t a0 = align_down(b.off), a1 = align_up(b.off + b.len);
    int64_t got = pread_full(r.fd, bounce, a1 - a0, a0, true);
    if (got < 0) return r.finish_block(static_cast<int>(-got), b.off, 0, 0);
    if (got < b.off + b.len - a0)
      return r.finish_block(kErrShort, b.off, std::max<int64_t>(0, got - (b.off - a0)), 0);
    std::memcpy(b.ptr, bounce + (b.off - a0), static_cast<size_t>(b.len));
  }
  finish_read(b);
}

}  // namespace zk_aio
