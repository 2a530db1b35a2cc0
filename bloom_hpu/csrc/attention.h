// BLOOM's attention for one query over the first keys of one head's cache, with the roundings of
// model.py's op-by-op attention (which are transformers'): scores = alibi + q.k / sqrt(D) summed in
// fp32 and stored in the model's dtype T, softmax in fp32, probabilities stored in T, their
// weighted sum of values in fp32, stored in T. Shared by the decode step (one query per row) and
// the prompt attention (every position of a prompt).

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace bloom_cpu {

template <typename T>
inline T round_to(float value) {
  return T(value);  // bf16: round to nearest even, as PyTorch stores an fp32 result
}

// 16 elements as fp32 (bf16 widens exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// sum_d a[d] * b[d] in fp32, for any n (head sizes are 16, 64, 80, 96, 128...).
template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(load16(a + d), load16(b + d), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; d < n; ++d) sum += float(a[d]) * float(b[d]);
  return sum;
}

// out [D] = attention of q [D] over keys/values [seen, D] (rows 0..seen-1 of a head's cache),
// alibi [seen] the head's bias per key slot. scratch: at least `seen` floats; context: D floats.
template <typename T>
void attend_one(const T* q, const T* keys, const T* values, const T* alibi, int64_t seen, int64_t D, float inv_norm,
                float* scratch, float* context, T* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < seen; ++j) {
    scratch[j] = float(round_to<T>(float(alibi[j]) + inv_norm * dot(q, keys + j * D, D)));
    top = std::max(top, scratch[j]);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < seen; ++j) total += (scratch[j] = std::exp(scratch[j] - top));
  std::fill(context, context + D, 0.0f);
  for (int64_t j = 0; j < seen; ++j) {
    const float p = float(round_to<T>(scratch[j] / total));
    const T* v = values + j * D;
    for (int64_t d = 0; d < D; ++d) context[d] += p * float(v[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] = round_to<T>(context[d]);
}

}  // namespace bloom_cpu
