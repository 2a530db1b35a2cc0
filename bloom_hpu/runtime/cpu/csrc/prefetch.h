// How the products of a few rows prefetch the weight rows they will read next, for the process.
//
// A decode product streams every weight from memory once; a core keeps the memory busy only with
// enough reads in flight, which the loops ask for with prefetches ahead of their loads. Which
// prefetch keeps the memory busiest depends on the CPU (measured in docs/performance.md):
//   kNoPrefetch   nothing (a block in scratch, or a later pass over a block already in L1);
//   kL1Ahead      into L1, a fixed distance further along the same rows (for rows longer than
//                 that distance, the block's next row: the hardware's stream prefetchers fetch the
//                 rest). The Xeons streamed at the memory's speed with it; a Zen 4 at about half.
//   kL2NextBlock  into L2, the next block of weight rows at the same column: every row of the next
//                 block, whatever the row length, one block ahead. A Zen 4 streams at the memory's
//                 speed with it.
// set_prefetch (few_rows_linear.cpp) sets the kind once per process; the products read it once
// per call.

#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>

#include "vec16.h"

BLOOM_CPU_BEGIN

enum PrefetchKind : int { kNoPrefetch = 0, kL1Ahead = 1, kL2NextBlock = 2 };

inline std::atomic<int>& prefetch_kind() {
  static std::atomic<int> kind{kL1Ahead};
  return kind;
}

// Whether this product prefetches the next block (read once per call, before its loops).
inline bool prefetch_next_block() { return prefetch_kind().load(std::memory_order_relaxed) == kL2NextBlock; }

// The prefetch of a loop reading `here`, in a block of weight rows `block_bytes` long: the same
// column of the next block into L2 (`next_block`), else `ahead_bytes` further on into L1.
// Prefetches never fault: the last block's point past the weight's end.
inline void prefetch_weights(const void* here, int64_t block_bytes, int64_t ahead_bytes, bool next_block) {
  const char* at = static_cast<const char*>(here);
  if (next_block)
    _mm_prefetch(at + block_bytes, _MM_HINT_T1);
  else
    _mm_prefetch(at + ahead_bytes, _MM_HINT_T0);
}

BLOOM_CPU_END
