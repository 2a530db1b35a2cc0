// How the products of a few rows prefetch the weight rows they will read next, for the process.
//
// A decode product streams every weight from memory once; a core keeps the memory busy only with
// enough reads in flight, which the loops ask for with prefetches ahead of their loads. Which
// prefetch keeps the memory busiest depends on the CPU (measured in docs/performance.md):
//   kNoPrefetch   nothing (a block in scratch, or a later pass over a block already in L1);
//   kL1Ahead      into L1, a fixed distance further along the same rows (for rows longer than
//                 that distance, the block's next row: the hardware's stream prefetchers fetch the
//                 rest). The Xeons streamed at the memory's speed with it; a Zen 4 at about half.
//   kL2NextBlock  into L2, a later block of weight rows at the same column: every row of that
//                 block, whatever the row length, the first block at least kL2AheadBytes ahead (the
//                 next one for bf16's blocks of 4 x 2 KB rows; for int4's blocks of 4 x 512 B, the
//                 next one is too close to hide the memory's latency: a Zen 4's int4 and int8 decode
//                 products ran 1.2-1.6x slower on one thread prefetching 2 KB ahead than 8 KB).
//                 A Zen 4 streams at the memory's speed with it.
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

constexpr int64_t kL2AheadBytes = 8192;  // the least distance of kL2NextBlock's prefetches

// The prefetch of a loop reading `here`, in a block of weight rows `block_bytes` long: the same
// column of the first block at least kL2AheadBytes on into L2 (`next_block`), else `ahead_bytes`
// further on into L1. Prefetches never fault: the last blocks' point past the weight's end.
inline void prefetch_weights(const void* here, int64_t block_bytes, int64_t ahead_bytes, bool next_block) {
  const char* at = static_cast<const char*>(here);
  if (next_block)
    _mm_prefetch(at + block_bytes * ((kL2AheadBytes + block_bytes - 1) / block_bytes), _MM_HINT_T1);
  else
    _mm_prefetch(at + ahead_bytes, _MM_HINT_T0);
}

BLOOM_CPU_END
