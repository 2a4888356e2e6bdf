// CRC-32C (Castagnoli), torch-free. Used for per-block checksums of swapped tensors: a flipped
// bit on disk must be caught on read, and the check must cost far less than the I/O itself.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zk_aio {

// Extends `crc` (0 for a fresh checksum) over n bytes at p. Picks the SSE4.2 instruction at run
// time where the CPU has it, else a slicing-by-8 table; both give the same value.
uint32_t crc32c(uint32_t crc, const void* p, size_t n);

// Which implementation crc32c() runs on this CPU: "sse4.2" or "table".
const char* crc32c_impl();

}  // namespace zk_aio
