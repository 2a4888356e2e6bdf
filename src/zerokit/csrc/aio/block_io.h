// Synchronous I/O of one block with positional pread/pwrite, and the per-block steps both
// backends share (checksums before a write, verification after a read).
#pragma once
#include <cstdint>

#include "aio/request.h"

namespace zk_aio {

// Reads up to n bytes; stops early only at end of file. Returns bytes read or -errno.
int64_t pread_full(int fd, char* p, int64_t n, int64_t off, bool direct);
// Writes all n bytes or returns -errno.
int64_t pwrite_full(int fd, const char* p, int64_t n, int64_t off);

// Runs the whole block on the calling thread and finishes it. Blocks that O_DIRECT cannot take
// as they are go through `bounce` (block_size + 2 sectors, 4096-aligned).
void run_block_sync(const Block& b, char* bounce);

// Before a write: records the block's CRC-32C when the request wants checksums.
void checksum_before_write(const Block& b);
// After the block's bytes are in memory: checksum, compare with the expected one, finish.
void finish_read(const Block& b);

}  // namespace zk_aio
