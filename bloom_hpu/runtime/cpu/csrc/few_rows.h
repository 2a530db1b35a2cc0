// Matrix products of a few rows with a large weight, at the speed of memory (bf16 and fp32).
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]    x [M, K], w [N, K] (nn.Linear's layout), M small
//
// A decode step multiplies one row per sequence by every weight of the model once, so its time is
// the time to stream the weights from memory. On a Xeon with AVX512-BF16, PyTorch's bf16 kernels
// for a [1, 1024] x [1024, 250880] product read 12-15 GB/s where a plain reduction reads 25: per
// byte they issue more instructions (bf16 -> fp32 conversions), so fewer loads are in flight. Here
// each 64-byte load feeds one VDPBF16PS (32 products into fp32 sums) directly, and the weight rows
// a few blocks ahead are prefetched explicitly, which keeps the memory busy: ~26 GB/s on the same
// machine. The fp32 version is the same loop with FMAs; it matters for small models, where a
// product is a few microseconds and PyTorch's call overhead (~10 us) was most of it.
//
// Work is split over PyTorch's intra-op threads by blocks of 4 weight rows; for each block the x
// rows are taken 4 at a time, so a block read once from memory serves up to 4 rows from L1.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace bloom_cpu {

constexpr int kRows = 4;                  // weight rows per block
constexpr int64_t kPrefetchBytes = 8192;  // a few blocks ahead of the loads (measured: 4-16 KB alike)

// One 64-byte step of a dot product, per element type: `step` elements per load, fp32 sums.
template <typename T> struct Lanes;

template <> struct Lanes<at::BFloat16> {
  static constexpr int step = 32;
  using Vec = __m512bh;
  static Vec load(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};

template <> struct Lanes<float> {
  static constexpr int step = 16;
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

// sums[m * R + r] = dot(w row r, x row m) for R weight rows and MB input rows.
template <typename T, int R, int MB>
inline void dot_block(const T* w, const T* x, int64_t K, float* sums) {
  using L = Lanes<T>;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(T);
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += L::step) {
    typename L::Vec xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = L::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + ahead), _MM_HINT_T0);
      typename L::Vec wv = L::load(w + r * K + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = L::dot(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Outputs n .. n+R-1 of every input row.
template <typename T, int R>
inline void output_rows(const T* w, const T* x, const T* bias, T* out, int64_t n, int64_t M, int64_t N, int64_t K) {
  float sums[R * 4];
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mb = std::min<int64_t>(4, M - m0);
    const T* xm = x + m0 * K;
    switch (mb) {
      case 4: dot_block<T, R, 4>(w, xm, K, sums); break;
      case 3: dot_block<T, R, 3>(w, xm, K, sums); break;
      case 2: dot_block<T, R, 2>(w, xm, K, sums); break;
      default: dot_block<T, R, 1>(w, xm, K, sums); break;
    }
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        float value = sums[m * R + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
        out[(m0 + m) * N + n + r] = T(value);  // bf16: rounded to nearest even once, as F.linear
      }
  }
}

// out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), all contiguous; M at most a few rows.
template <typename T>
void linear_rows(const T* x, int64_t M, const T* w, int64_t N, int64_t K, const T* bias, T* out) {
  const int64_t blocks = N / kRows;
  // At least ~64 KB of weights per task, so small layers are not split into tasks too short to pay.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * int64_t(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) output_rows<T, kRows>(w + b * kRows * K, x, bias, out, b * kRows, M, N, K);
  });
  for (int64_t n = blocks * kRows; n < N; ++n) output_rows<T, 1>(w + n * K, x, bias, out, n, M, N, K);
}

}  // namespace bloom_cpu
