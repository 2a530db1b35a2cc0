// How the products of a few rows prefetch the weight rows they will read next, for the process.
//
// A decode product streams every weight from memory once; a core keeps the memory busy only with
// enough reads in flight, which the loops ask for with prefetches ahead of their loads. Which
// prefetch keeps the memory busiest depends on the CPU (measured in docs/performance.md):
//   kNoPrefetch   nothing: the hardware's stream prefetchers alone (also for a block in scratch,
//                 or a later pass over a block already in L1). A Zen 5 streamed fastest so.
//   kL1Ahead      into L1, a fixed distance further along the same rows (for rows longer than
//                 that distance, the block's next row: the hardware's stream prefetchers fetch the
//                 rest). The Xeons streamed at the memory's speed with it; a Zen 4 at about half.
//   kL2NextBlock  into L2, a later block of weight rows at the same column: every row of that
//                 block, whatever the row length, the first block at least kL2AheadBytes ahead (the
//                 next one for bf16's blocks of 4 x 2 KB rows; for int4's blocks of 4 x 512 B, the
//                 next one is too close to hide the memory's latency: a Zen 4's int4 and int8 decode
//                 products ran 1.2-1.6x slower on one thread prefetching 2 KB ahead than 8 KB).
//                 A Zen 4 streams at the memory's speed with it.
// Each weight format has its own kind, as what streams fastest differs by format on one CPU (a Zen
// 5: bf16 and fp32 fastest with none, int4 half as fast with none as with either prefetch). The
// float products also pick it by how many input rows they multiply (a row class: 1, 2-3, 4-7, 8
// or more): the more rows, the more arithmetic per weight byte and the fewer loads in flight, so a
// kind that only costs issue slots at one row can keep the memory busy at eight (that Zen 5's bf16
// products of 8 rows: 1.3x as fast with L2 as with none). The int8 and int4 products read one kind
// for every row count (their row classes are set alike). set_prefetch (few_rows_linear.cpp) sets a
// format's kind for a row count and those above it, for the process; the products read theirs once
// per call (weight_prefetch) and pass it to prefetch_weights.

#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>

#include "vec16.h"

BLOOM_CPU_BEGIN

enum PrefetchKind : int { kNoPrefetch = 0, kL1Ahead = 1, kL2NextBlock = 2 };
// The weights a product streams: bf16, fp16 or fp32 (few_rows.h), int8 (int8_rows.h, and block_q8.h
// with int8 weights), int4 (int4_rows.h, and block_q8.h with int4 weights).
enum WeightFormat : int { kFloatWeights = 0, kInt8Weights = 1, kInt4Weights = 2 };
constexpr int kWeightFormats = 3;

// The row classes: the first input row count of each.
constexpr int kRowClasses = 4;
constexpr int64_t kRowClassStart[kRowClasses] = {1, 2, 4, 8};
inline int row_class(int64_t rows) {
  int c = 0;
  while (c + 1 < kRowClasses && rows >= kRowClassStart[c + 1]) ++c;
  return c;
}

inline std::atomic<int>& prefetch_kind(int format, int row_class) {
  static std::atomic<int> kinds[kWeightFormats][kRowClasses] = {
      {kL1Ahead, kL1Ahead, kL1Ahead, kL1Ahead}, {kL1Ahead, kL1Ahead, kL1Ahead, kL1Ahead},
      {kL1Ahead, kL1Ahead, kL1Ahead, kL1Ahead}};
  return kinds[format][row_class];
}

// The kind a product of `rows` input rows over `format` weights prefetches with (read once per call,
// before its loops; the int8 and int4 products, whose classes are alike, read the one-row class).
inline int weight_prefetch(int format, int64_t rows = 1) {
  return prefetch_kind(format, row_class(rows)).load(std::memory_order_relaxed);
}

constexpr int64_t kL2AheadBytes = 8192;  // the least distance of kL2NextBlock's prefetches

// The prefetch of a loop reading `here`, in a block of weight rows `block_bytes` long, as `kind`
// says: kL2NextBlock the same column of the first block at least kL2AheadBytes on into L2,
// kL1Ahead `ahead_bytes` further on into L1, kNoPrefetch none. Prefetches never fault: the last
// blocks' point past the weight's end.
inline void prefetch_weights(const void* here, int64_t block_bytes, int64_t ahead_bytes, int kind) {
  const char* at = static_cast<const char*>(here);
  if (kind == kL2NextBlock)
    _mm_prefetch(at + block_bytes * ((kL2AheadBytes + block_bytes - 1) / block_bytes), _MM_HINT_T1);
  else if (kind == kL1Ahead)
    _mm_prefetch(at + ahead_bytes, _MM_HINT_T0);
}

BLOOM_CPU_END
