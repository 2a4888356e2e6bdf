// A request (one read or write of a caller's buffer at a file offset) and the blocks it is cut
// into. Shared by the engine and its two block backends (thread pool, kernel AIO), which finish
// blocks in any order from any thread.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "aio/activity.h"

namespace zk_aio {

constexpr int64_t kAlign = 4096;
// Error codes beside positive errno values.
constexpr int kErrShort = -1;     // the file ended before the requested range (short file)
constexpr int kErrChecksum = -2;  // a block's CRC-32C did not match the expected one

inline bool aligned(int64_t v) { return (v & (kAlign - 1)) == 0; }
inline int64_t align_down(int64_t v) { return v & ~(kAlign - 1); }
inline int64_t align_up(int64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

struct Result {
  int err = 0;              // 0, errno, kErrShort or kErrChecksum (first failing block)
  int64_t err_offset = -1;  // file offset of the first failing block
  int64_t err_got = 0;      // for kErrShort: bytes the block found; kErrChecksum: the crc found
  int64_t bytes = 0;        // bytes transferred into/out of the caller's memory
  std::vector<uint32_t> checksums;  // one per block when requested
};

struct Request {
  bool write = false;
  int fd = -1;
  bool direct = false;
  bool fsync = false;
  bool want_checksums = false;
  // The file's identity (st_dev, st_ino), taken at submit for direct writes: the key of the
  // sector locks their partial edge sectors take (block_io.cpp). Zero where fstat failed, which
  // only makes unrelated files share locks.
  uint64_t dev = 0, ino = 0;
  std::vector<uint32_t> expected;
  // The engine's idle clock, told when the last block finishes (null for an empty request,
  // never counted as in flight).
  std::shared_ptr<Activity> activity;
  std::mutex mu;
  std::condition_variable cv;
  int64_t remaining = 0;
  bool finished = false;
  Result result;

  // Whether a block before file offset `off` already failed: a block after it then skips its
  // I/O (the report names the first failing block, so blocks before it must still run).
  bool failed_before(int64_t off);
  // Accounts one block (err 0 = success); the last one runs fsync and wakes the waiters.
  void finish_block(int err, int64_t off, int64_t got, int64_t bytes);
};

struct Block {
  std::shared_ptr<Request> req;
  int64_t index = 0;  // position in the request: the slot of its checksum
  char* ptr = nullptr;
  int64_t len = 0;
  int64_t off = 0;

  // O_DIRECT can move this block straight between the caller's memory and the disk.
  bool direct_ready() const {
    return aligned(reinterpret_cast<int64_t>(ptr)) && aligned(off) && aligned(len);
  }
};

}  // namespace zk_aio
