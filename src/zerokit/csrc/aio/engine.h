// The async tensor I/O engine: torch-free, raw pointers and sizes in.
//
// A request (one read or write of a large buffer at a file offset) is cut into blocks at
// multiples of block_size in *file* space, and the blocks run on a pool of I/O threads, so a
// request returns at once with an id that wait()/done() take. Blocks that meet O_DIRECT's rules
// (memory, offset and length multiples of the alignment) go straight between the caller's memory
// and the disk; the others are staged through a per-thread aligned bounce buffer, so an ordinary
// (64-byte aligned) tensor works and only its unaligned head and tail are copied when the file
// offset has the same residue modulo 4096 as the memory (the swapper arranges that).
//
// Backend: positional pread/pwrite on thread_count * queue_depth threads, so queue_depth blocks
// per submitting thread are in flight, as with DeepSpeed's libaio contexts; single_submit and
// overlap_events are accepted for config compatibility and are inherent here (each thread submits
// one block and picks up the next as soon as its own completes).
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zk_aio {

constexpr int64_t kAlign = 4096;
// Error codes beside positive errno values.
constexpr int kErrShort = -1;     // the file ended before the requested range (short file)
constexpr int kErrChecksum = -2;  // a block's CRC-32C did not match the expected one

struct Config {
  int64_t block_size = 1 << 20;
  int queue_depth = 8;
  int thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
};

struct Result {
  int err = 0;              // 0, errno, kErrShort or kErrChecksum (first failing block)
  int64_t err_offset = -1;  // file offset of the first failing block
  int64_t err_got = 0;      // for kErrShort: bytes the block found; kErrChecksum: the crc found
  int64_t bytes = 0;        // bytes transferred into/out of the caller's memory
  std::vector<uint32_t> checksums;  // one per block when requested
};

class Engine {
 public:
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
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Request;
  struct Block {
    std::shared_ptr<Request> req;
    int64_t index;
    char* ptr;
    int64_t len;
    int64_t off;
  };
  void worker_main();
  void run_block(const Block& b, char* bounce);
  void finish_block(Request& r, int err, int64_t off, int64_t got, int64_t bytes);

  Config cfg_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;
  bool stop_ = false;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  std::vector<std::thread> workers_;
};

}  // namespace zk_aio
