// Products of a few rows with an int8 weight (weight-only int8, bloom_hpu/quantize.py), at the speed
// of reading int8 bytes: the operator int8_rows_linear and the one-call int8 decode step use it.
//
// out[m, n] = scales[n] * sum_k x[m, k] * q[n, k] + bias[n]    x [M, K], q [N, K] int8, M small
//
// A decode step's time is the time to stream the weights; int8 halves their bytes against bf16.
// Each 16 int8 weights are loaded as 16 bytes, widened to 16 fp32 (sign extension, conversion) and
// multiplied into fp32 sums by one FMA per input row; the row's scale multiplies the finished sum
// once. The inputs are widened to fp32 once per call (a few rows: a few KB). Weight rows are taken
// four at a time and prefetched a few KB ahead, as in few_rows.h; work is split over PyTorch's
// intra-op threads by blocks of rows. K must be a multiple of 16.
//
// Widening costs two instructions per 16 weights, and that path widens a block again for every
// pair of input rows: with more rows the FMAs and the widening, not memory, set the pace. On the
// AVX2 build its sums are kept one register per pair of rows, so nothing spills. With bf16 inputs
// on the AVX-512 build (K % 32 == 0) another path runs: each 32 weights are widened once to 32
// bf16 (exact: every int8 value is a bf16) and multiplied into up to 8 input rows by one VDPBF16PS
// each, as the bf16 weights of few_rows.h are: one widening then serves many rows, so with more
// rows it keeps the pace of bf16 weights while reading half their bytes.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_rows.h"
#include "prefetch.h"
#include "vec16.h"

BLOOM_CPU_BEGIN

// 16 int8 weights as fp32.
#if defined(BLOOM_ISA_AVX512)
inline Vec16 load16_int8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
constexpr int kInt8XRows = 2;  // input rows per pass over a block: the widening, not the registers, limits it
#else
inline Vec16 load16_int8(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)))};
}
constexpr int kInt8XRows = 2;  // AVX2's 16 registers: 8 sums (two halves each) and the inputs
#endif

constexpr int kInt8Rows = 4;                 // weight rows per block
constexpr int64_t kInt8PrefetchBytes = 4096;  // weight bytes ahead of the loads

// The fp32 sums of the widening path, one per (weight row, input row). AVX-512: a Vec16 of sums.
// AVX2 holds a Vec16 in two registers: both halves of a product go into one register of 8 sums,
// so the 4 x 2 sums, the inputs and a weight fit the 16 registers without spilling.
#if defined(BLOOM_ISA_AVX512)
using Int8Sums = Vec16;
inline Int8Sums sums_zero() { return zero16(); }
inline Int8Sums sums_add(Int8Sums acc, Vec16 w, Vec16 x) { return fmadd(w, x, acc); }
inline float sums_total(Int8Sums acc) { return reduce_add(acc); }
#else
using Int8Sums = __m256;
inline Int8Sums sums_zero() { return _mm256_setzero_ps(); }
inline Int8Sums sums_add(Int8Sums acc, Vec16 w, Vec16 x) {
  return _mm256_fmadd_ps(w.hi, x.hi, _mm256_fmadd_ps(w.lo, x.lo, acc));
}
inline float sums_total(Int8Sums acc) { return reduce_add8(acc); }
#endif

// A block kind: Block<R, MB>::run(q, x, K, sums) sets sums[m * R + r] = dot(q row r, x row m) for
// R weight rows and MB input rows of type Block<R, MB>::X.

// The widening path: fp32 inputs, 16 weights widened to fp32 per step.
template <int R, int MB>
struct WidenedBlock {
  using X = float;
  static void run(const int8_t* q, const float* x, int64_t K, float* sums) {
    Int8Sums acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = sums_zero();
    const int prefetch = weight_prefetch(kInt8Weights);
    for (int64_t k = 0; k < K; k += 16) {
      for (int r = 0; r < R; ++r) prefetch_weights(q + r * K + k, R * K, kInt8PrefetchBytes, prefetch);
      Vec16 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const Vec16 w = load16_int8(q + r * K + k);
        for (int m = 0; m < MB; ++m) acc[r][m] = sums_add(acc[r][m], w, xv[m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = sums_total(acc[r][m]);
  }
};

#if defined(BLOOM_ISA_AVX512)
constexpr int kInt8Bf16Rows = 2;   // weight rows per block of the VDPBF16PS path
constexpr int kInt8Bf16XRows = 8;  // input rows per pass: 16 sums, 2 weight registers, 1 input

// 32 int8 weights as 32 bf16 in k order (exact).
inline __m512bh load32_int8_as_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The VDPBF16PS path: bf16 inputs, 32 weights widened to bf16 per step; K % 32 == 0.
template <int R, int MB>
struct Bf16DotBlock {
  using X = at::BFloat16;
  static void run(const int8_t* q, const at::BFloat16* x, int64_t K, float* sums) {
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    const int prefetch = weight_prefetch(kInt8Weights);
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh w[R];
      for (int r = 0; r < R; ++r) {
        prefetch_weights(q + r * K + k, R * K, kInt8PrefetchBytes, prefetch);
        w[r] = load32_int8_as_bf16(q + r * K + k);
      }
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
};
#endif

// Block<R, MB'>::run(args...) for the mb (<= MB) input rows left: MB' = mb, chosen at compile time
// (the int8 and int4 kernels' blocks alike).
template <template <int, int> class Block, int R, int MB, typename... Args>
inline void run_block(int64_t mb, Args... args) {
  if constexpr (MB > 1) {
    if (mb < MB) return run_block<Block, R, MB - 1>(mb, args...);
  }
  Block<R, MB>::run(args...);
}

// Outputs n..n+R-1 of every input row, XRows input rows per pass over the R weight rows.
template <template <int, int> class Block, int R, int XRows, typename X, typename T>
inline void int8_outputs(const int8_t* q, const float* scales, const X* x, const T* bias, T* out, int64_t n,
                         int64_t M, int64_t N, int64_t K) {
  float sums[R * XRows];
  for (int64_t m0 = 0; m0 < M; m0 += XRows) {
    const int64_t mb = std::min<int64_t>(XRows, M - m0);
    run_block<Block, R, XRows>(mb, q, x + m0 * K, K, sums);
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        const float value = sums[m * R + r] * scales[n + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
        out[(m0 + m) * N + n + r] = T(value);
      }
  }
}

// out [M, N] by blocks of Rows weight rows split over the threads; the last N % Rows rows alone.
template <template <int, int> class Block, int Rows, int XRows, typename X, typename T>
inline void int8_products(const X* x, int64_t M, const int8_t* q, const float* scales, int64_t N, int64_t K,
                          const T* bias, T* out) {
  const int64_t blocks = N / Rows;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (Rows * K));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      int8_outputs<Block, Rows, XRows>(q + b * Rows * K, scales, x, bias, out, b * Rows, M, N, K);
  });
  for (int64_t n = blocks * Rows; n < N; ++n) int8_outputs<Block, 1, XRows>(q + n * K, scales, x, bias, out, n, M, N, K);
}

// out [M, N] = (x [M, K] @ q [N, K]^T) * scales [N] (+ bias [N]): bf16 inputs on the AVX-512 build
// as they are, others widened to fp32 once (a few rows).
template <typename T>
void int8_linear(const T* x_in, int64_t M, const int8_t* q, const float* scales, int64_t N, int64_t K, const T* bias,
                 T* out) {
#if defined(BLOOM_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // Many rows on AMX tiles (amx_rows.h), where enabled: each strip of weight rows widened to bf16
    // (exact) in the cache as it is needed, each output's sum times its row's scale.
    if (amx_takes_quantized(M, N, K)) {
      const auto strip_of = [&](int64_t n0, int64_t rows, at::BFloat16* strip) {
        const int8_t* src = q + n0 * K;
        for (int64_t i = 0; i < rows * K; i += 32) _mm512_storeu_si512(strip + i, (__m512i)load32_int8_as_bf16(src + i));
        return static_cast<const at::BFloat16*>(strip);
      };
      return amx_products(x_in, M, N, K, strip_of, true, scales, bias, out, N);
    }
  }
#endif
#if defined(BLOOM_ISA_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (K % 32 == 0) return int8_products<Bf16DotBlock, kInt8Bf16Rows, kInt8Bf16XRows>(x_in, M, q, scales, N, K, bias, out);
  }
#endif
  std::vector<float> x(M * K);
  for (int64_t i = 0; i < M * K; ++i) x[i] = static_cast<float>(x_in[i]);
  int8_products<WidenedBlock, kInt8Rows, kInt8XRows>(x.data(), M, q, scales, N, K, bias, out);
}

BLOOM_CPU_END
