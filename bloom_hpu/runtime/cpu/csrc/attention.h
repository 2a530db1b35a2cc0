// BLOOM's attention for the queries of one head over the first keys of that head's cache, with the
// roundings of model.py's op-by-op attention (which are transformers'): scores = alibi + q.k / sqrt(D)
// summed in fp32 and stored in the model's dtype T, softmax in fp32, probabilities stored in T,
// their weighted sum of values in fp32, stored in T. Here: the decode step's attention (attend_one:
// one query per row, over a cache read from memory) and the softmax that the prompt attention
// (tiles of queries and keys, prompt_attention.cpp) shares with it.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

BLOOM_CPU_BEGIN

// sum_d a[d] * b[d] in fp32, for any n (head sizes are 16, 64, 80, 96, 128...).
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  Vec16 acc = zero16();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = fmadd(load16(a + d), load16(b + d), acc);
  if (d < n) acc = fmadd(load_first(a + d, n - d), load_first(b + d, n - d), acc);
  return reduce_add(acc);
}

// scores [n] (each already rounded to T) -> probabilities rounded to T, in place:
// exp(s - max) / sum, in fp32. The tail's missing lanes are -inf in the max, and the max itself in
// the exp (then zeroed): an exp that underflows costs a microcode assist on Intel cores, and most
// rows end in a partial vector (a prefill's attention ran ~6% slower with -inf there).
template <typename T>
inline void softmax_rounded(float* scores, int64_t n) {
  const int64_t whole = n / 16 * 16, tail = n - whole;
  Vec16 top = set16(-INFINITY);
  for (int64_t j = 0; j < whole; j += 16) top = max16(top, load16(scores + j));
  if (tail) top = max16(top, load_first(scores + whole, tail, -INFINITY));
  const float max = reduce_max(top);
  const Vec16 shift = set16(max);
  Vec16 total = zero16();
  for (int64_t j = 0; j < whole; j += 16) {
    const Vec16 e = exp16(load16(scores + j) - shift);
    total = total + e;
    store16(scores + j, e);
  }
  if (tail) {
    const Vec16 e = keep_first(exp16(load_first(scores + whole, tail, max) - shift), tail);
    total = total + e;
    store_first(scores + whole, e, tail);
  }
  const Vec16 sum = set16(reduce_add(total));
  for (int64_t j = 0; j < whole; j += 16) store16(scores + j, round16<T>(load16(scores + j) / sum));
  if (tail) store_first(scores + whole, round16<T>(load_first(scores + whole, tail) / sum), tail);
}

// Decode reads a long cache once per step, from memory: the rows kAhead keys ahead (or the last
// ones) are asked for while these are summed.
constexpr int64_t kAhead = 64;
template <typename T>
inline void prefetch_rows(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * int64_t(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// out [D] = sum_j probs[j] * values[j, :] over j < n (values: rows of a head's cache), summed in
// fp32 in the order of the keys and rounded to T. context: D floats of scratch. Four keys per pass
// over the context, so that its D / 16 vectors stay in registers across them and the loads of four
// rows of values are in flight at once (decode over a long cache reads them from memory).
template <typename T>
inline void weighted_values(const float* probs, const T* values, int64_t n, int64_t D, float* context, T* out) {
  std::fill(context, context + (D + 15) / 16 * 16, 0.0f);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* v = values + j * D;
    prefetch_rows(values + std::min(j + kAhead, n - 4) * D, 4 * D);
    for (int64_t c = 0; c < D; c += 16) {
      const int64_t width = std::min<int64_t>(16, D - c);
      Vec16 sum = load16(context + c);  // context has room for whole vectors (see attend_one)
      for (int u = 0; u < 4; ++u) sum = fmadd(set16(probs[j + u]), load_first(v + u * D + c, width), sum);
      store16(context + c, sum);
    }
  }
  for (; j < n; ++j)
    for (int64_t c = 0; c < D; c += 16) {
      const int64_t width = std::min<int64_t>(16, D - c);
      store16(context + c, fmadd(set16(probs[j]), load_first(values + j * D + c, width), load16(context + c)));
    }
  for (int64_t c = 0; c < D; c += 16) store_first(out + c, load16(context + c), std::min<int64_t>(16, D - c));
}

// scores [seen] = alibi + q . k_j / sqrt(D), rounded to T, for the keys [seen, D] of a head's cache.
// Four keys at a time: four independent sums, whose loads are in flight together.
template <typename T>
inline void decode_scores(const T* q, const T* keys, const T* alibi, int64_t seen, int64_t D, float inv_norm,
                          float* scores) {
  int64_t j = 0;
  for (; j + 4 <= seen; j += 4) {
    prefetch_rows(keys + std::min(j + kAhead, seen - 4) * D, 4 * D);
    Vec16 sum[4] = {zero16(), zero16(), zero16(), zero16()};
    for (int64_t d = 0; d < D; d += 16) {
      const int64_t width = std::min<int64_t>(16, D - d);
      const Vec16 query = load_first(q + d, width);
      for (int u = 0; u < 4; ++u) sum[u] = fmadd(query, load_first(keys + (j + u) * D + d, width), sum[u]);
    }
    for (int u = 0; u < 4; ++u)
      scores[j + u] = float(round_to<T>(float(alibi[j + u]) + inv_norm * reduce_add(sum[u])));
  }
  for (; j < seen; ++j) scores[j] = float(round_to<T>(float(alibi[j]) + inv_norm * dot(q, keys + j * D, D)));
}

// out [D] = attention of q [D] over keys/values [seen, D] (rows 0..seen-1 of a head's cache),
// alibi [seen] the head's bias per key slot. scratch: at least `seen` floats; context: D floats
// rounded up to whole vectors of 16.
template <typename T>
void attend_one(const T* q, const T* keys, const T* values, const T* alibi, int64_t seen, int64_t D, float inv_norm,
                float* scratch, float* context, T* out) {
  decode_scores<T>(q, keys, alibi, seen, D, inv_norm, scratch);
  softmax_rounded<T>(scratch, seen);
  weighted_values<T>(scratch, values, seen, D, context, out);
}

BLOOM_CPU_END
