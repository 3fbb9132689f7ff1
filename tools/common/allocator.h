#pragma once
// Process-wide allocator policy, which only a tool's main may set: a
// library linked into another program (the Python module) leaves the
// host's malloc as it found it.

#include <malloc.h>

namespace cfmo::tool {

/// Expert parallelism allocates and frees the exchanged rows in every MoE
/// layer and step (a few 100 KiB a message, on three threads): glibc's
/// sliding mmap threshold and its trimming of per-thread heaps handed them
/// back to the kernel and faulted them in zeroed again, 12-29% of the CPU
/// time of a 4-rank run on 2 cores. Kept instead, for a few MB more peak
/// resident memory a rank (bench/RESULTS.md).
inline void keep_exchange_buffers() {
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace cfmo::tool
