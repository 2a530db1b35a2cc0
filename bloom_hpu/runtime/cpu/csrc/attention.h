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

namespace bloom_cpu {

// sum_d a[d] * b[d] in fp32, for any n (head sizes are 16, 64, 80, 96, 128...).
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(load16(a + d), load16(b + d), acc);
  if (d < n) acc = _mm512_fmadd_ps(load_first(a + d, n - d), load_first(b + d, n - d), acc);
  return _mm512_reduce_add_ps(acc);
}

// scores [n] (each already rounded to T) -> probabilities rounded to T, in place:
// exp(s - max) / sum, in fp32.
template <typename T>
inline void softmax_rounded(float* scores, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, scores + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), shift));
    total = _mm512_mask_add_ps(total, lanes, total, e);
    _mm512_mask_storeu_ps(scores + j, lanes, e);
  }
  const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = first_lanes(n - j);
    _mm512_mask_storeu_ps(scores + j, lanes, round16<T>(_mm512_div_ps(_mm512_maskz_loadu_ps(lanes, scores + j), sum)));
  }
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
      __m512 sum = _mm512_loadu_ps(context + c);  // context has room for whole vectors (see attend_one)
      for (int u = 0; u < 4; ++u) sum = _mm512_fmadd_ps(_mm512_set1_ps(probs[j + u]), load_first(v + u * D + c, width), sum);
      _mm512_storeu_ps(context + c, sum);
    }
  }
  for (; j < n; ++j)
    for (int64_t c = 0; c < D; c += 16) {
      const int64_t width = std::min<int64_t>(16, D - c);
      const __m512 sum = _mm512_fmadd_ps(_mm512_set1_ps(probs[j]), load_first(values + j * D + c, width),
                                         _mm512_loadu_ps(context + c));
      _mm512_storeu_ps(context + c, sum);
    }
  for (int64_t c = 0; c < D; c += 16) store_first(out + c, _mm512_loadu_ps(context + c), std::min<int64_t>(16, D - c));
}

// scores [seen] = alibi + q . k_j / sqrt(D), rounded to T, for the keys [seen, D] of a head's cache.
// Four keys at a time: four independent sums, whose loads are in flight together.
template <typename T>
inline void decode_scores(const T* q, const T* keys, const T* alibi, int64_t seen, int64_t D, float inv_norm,
                          float* scores) {
  int64_t j = 0;
  for (; j + 4 <= seen; j += 4) {
    prefetch_rows(keys + std::min(j + kAhead, seen - 4) * D, 4 * D);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t d = 0; d < D; d += 16) {
      const int64_t width = std::min<int64_t>(16, D - d);
      const __m512 query = load_first(q + d, width);
      for (int u = 0; u < 4; ++u) sum[u] = _mm512_fmadd_ps(query, load_first(keys + (j + u) * D + d, width), sum[u]);
    }
    for (int u = 0; u < 4; ++u)
      scores[j + u] = float(round_to<T>(float(alibi[j + u]) + inv_norm * _mm512_reduce_add_ps(sum[u])));
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

}  // namespace bloom_cpu
