// Products of a few rows with a group-wise int4 weight (weight-only int4, bloom_hpu/int4.py): the
// operator int4_rows_linear and the one-call quantized decode step use it.
//
// out[m, n] = sum_g scales[n, g] * sum_{k in group g} x[m, k] * (v[n, k] - 8) + bias[n]
//
// x [M, K], M small; the weight is packed [N, K / 2] bytes: in each block of 32 weights of a row
// (16 bytes), byte j holds weight j in its low nibble and weight j + 16 in its high one, each as
// v = q + 8 (q in [-7, 7]); scales [N, K / G] fp32, one per group of G weights (G % 32 == 0).
//
// A decode step streams the weights, and int4 reads about a quarter of bf16's bytes; what is left
// is the work of widening them:
//
// * bf16 inputs on the AVX-512 build: per group and weight row, the 16 weights a nibble can stand
//   for, (v - 8) * scale, are computed in fp32 and rounded to bf16 once (exactly the weights of a
//   bf16 model holding the dequantized checkpoint). The 16 bytes of a block are loaded into both
//   halves of a register, one half shifted by a nibble, masked and widened to 32 16-bit indices in
//   k order, and one VPERMW looks the 32 weights up; one VDPBF16PS per input row multiplies them
//   into fp32 sums, as for bf16 weights (few_rows.h).
// * Otherwise (fp32 or fp16 inputs, and the AVX2 build) x is widened to fp32 once per call and each
//   16 nibbles are widened to the fp32 values v and multiplied in by FMAs, into sums per group that
//   the group's scale multiplies. The 8 of v - 8 (times the scale and the group's sum of x) is taken
//   off once per group and row at the end, from sums of x per group computed once per call,
//   instead of once per weight. That path widens a block again for every pair of input rows; from
//   kWidenOnceRows rows each block of weight rows is dequantized to fp32 once, into scratch, and
//   multiplied by few_rows.h's fp32 loop instead.
//
// Weight rows are taken a few at a time and prefetched ahead; work is split over PyTorch's intra-op
// threads by blocks of rows, as in int8_rows.h.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_rows.h"
#include "few_rows.h"
#include "int8_rows.h"
#include "prefetch.h"
#include "vec16.h"

BLOOM_CPU_BEGIN

constexpr int64_t kInt4Block = 32;               // weights per packed block (16 bytes)
constexpr int64_t kInt4PrefetchBytes = 2048;     // weight bytes ahead of the loads

// The nibbles of one packed block: weights 0..15 (low nibbles) and 16..31 (high nibbles), as bytes.
inline void unpack_block(const uint8_t* p, __m128i& low, __m128i& high) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  low = _mm_and_si128(bytes, mask);
  high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
}

// 16 nibble values (bytes 0..15 of `nibbles`) as fp32.
#if defined(BLOOM_ISA_AVX512)
inline Vec16 widen16(__m128i nibbles) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles))}; }
#else
inline Vec16 widen16(__m128i nibbles) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(nibbles, nibbles)))};
}
#endif

#if defined(BLOOM_ISA_AVX512)
inline Int8Sums sums_scaled_add(Int8Sums acc, Int8Sums part, float scale) { return fmadd(part, set16(scale), acc); }
#else
inline Int8Sums sums_scaled_add(Int8Sums acc, Int8Sums part, float scale) {
  return _mm256_fmadd_ps(part, _mm256_set1_ps(scale), acc);
}
#endif

// A block kind: Block<R, MB>::run(q, row_bytes, scales, groups, x, K, G, sums) sets sums[m * R + r]
// to the product of input row m with weight row r plus Block::offset * sum_g scales[r, g] *
// (x row m's sum over group g), for R packed weight rows (row_bytes apart) and MB input rows of
// type Block<R, MB>::X; int4_outputs takes the offset term off.

// The widening path: fp32 inputs, 16 nibbles widened to fp32 per step; offset 8.
template <int R, int MB>
struct Int4WidenedBlock {
  using X = float;
  static constexpr float offset = 8.0f;
  static void run(const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, const float* x, int64_t K,
                  int64_t G, float* sums) {
    Int8Sums acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = sums_zero();
    const int prefetch = weight_prefetch(kInt4Weights);
    for (int64_t g = 0; g < groups; ++g) {
      Int8Sums part[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) part[r][m] = sums_zero();
      for (int64_t k = g * G; k < (g + 1) * G; k += kInt4Block) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* block = q + r * row_bytes + k / 2;
          prefetch_weights(block, R * row_bytes, kInt4PrefetchBytes, prefetch);
          __m128i low, high;
          unpack_block(block, low, high);
          const Vec16 w_low = widen16(low), w_high = widen16(high);
          for (int m = 0; m < MB; ++m) {
            part[r][m] = sums_add(part[r][m], w_low, load16(x + m * K + k));
            part[r][m] = sums_add(part[r][m], w_high, load16(x + m * K + k + 16));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const float scale = scales[r * groups + g];
        for (int m = 0; m < MB; ++m) acc[r][m] = sums_scaled_add(acc[r][m], part[r][m], scale);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = sums_total(acc[r][m]);
  }
};
constexpr int kInt4Rows = 2;   // weight rows per block of the widening path
constexpr int kInt4XRows = 2;  // input rows per pass (AVX2: 2 x 2 sums and partial sums, in 16 registers)

#if defined(BLOOM_ISA_AVX512)
// A group's 16 possible weights, (v - 8) * scale for v = 0..15, computed in fp32 and rounded to bf16
// (as a bf16 model holding the dequantized weights has them), in the low 16 words.
inline __m512i bf16_group_table(float scale) {
  const __m512 q = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(q, _mm512_set1_ps(scale))));
}

// 32 packed weights as bf16, in k order: each nibble looks its weight up in the group's table.
inline __m512bh load32_int4_bf16(const uint8_t* p, __m512i table) {
  const __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // The upper copy shifted by a nibble: its bytes' low nibbles are the high nibbles of the block.
  const __m256i shifted = _mm256_srlv_epi64(twice, _mm256_set_epi64x(4, 4, 0, 0));
  const __m256i nibbles = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
}

// The VDPBF16PS path: bf16 inputs; each 32 weights become bf16 through their group's table (one
// permute), then one VDPBF16PS per input row, as for bf16 weights (few_rows.h). Offset 0.
template <int R, int MB>
struct Int4Bf16DotBlock {
  using X = at::BFloat16;
  static constexpr float offset = 0.0f;
  static void run(const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, const at::BFloat16* x,
                  int64_t K, int64_t G, float* sums) {
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    const int prefetch = weight_prefetch(kInt4Weights);
    for (int64_t g = 0; g < groups; ++g) {
      __m512i table[R];
      for (int r = 0; r < R; ++r) table[r] = bf16_group_table(scales[r * groups + g]);
      for (int64_t k = g * G; k < (g + 1) * G; k += kInt4Block) {
        __m512bh w[R];
        for (int r = 0; r < R; ++r) {
          const uint8_t* block = q + r * row_bytes + k / 2;
          prefetch_weights(block, R * row_bytes, kInt4PrefetchBytes, prefetch);
          w[r] = load32_int4_bf16(block, table[r]);
        }
        for (int m = 0; m < MB; ++m) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
          for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
};
constexpr int kInt4Bf16Rows = 4;   // weight rows per block of the VDPBF16PS path
constexpr int kInt4Bf16XRows = 4;  // input rows per pass: 16 sums in registers (2 x 8 measured alike)
#endif

// Outputs n..n+R-1 of every input row, XRows input rows per pass over the R weight rows.
// x_groups [M, groups]: each input row's sums over each group (for the offset).
template <template <int, int> class Block, int R, int XRows, typename X, typename T>
inline void int4_outputs(const uint8_t* q, const float* scales, const X* x, const float* x_groups, const T* bias,
                         T* out, int64_t n, int64_t M, int64_t N, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  const float* row_scales = scales + n * groups;
  float sums[R * XRows];
  for (int64_t m0 = 0; m0 < M; m0 += XRows) {
    const int64_t mb = std::min<int64_t>(XRows, M - m0);
    run_block<Block, R, XRows>(mb, q, K / 2, row_scales, groups, x + m0 * K, K, G, sums);
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        float value = sums[m * R + r];
        if constexpr (Block<R, XRows>::offset != 0.0f) {
          float taken = 0.0f;
          for (int64_t g = 0; g < groups; ++g) taken += row_scales[r * groups + g] * x_groups[(m0 + m) * groups + g];
          value -= Block<R, XRows>::offset * taken;
        }
        out[(m0 + m) * N + n + r] = T(value + (bias ? static_cast<float>(bias[n + r]) : 0.0f));
      }
  }
}

// out [M, N] by blocks of Rows weight rows split over the threads; the last N % Rows rows alone.
template <template <int, int> class Block, int Rows, int XRows, typename X, typename T>
inline void int4_products(const X* x, int64_t M, const uint8_t* q, const float* scales, int64_t N, int64_t K,
                          int64_t G, const T* bias, T* out) {
  std::vector<float> x_groups;
  if constexpr (Block<Rows, XRows>::offset != 0.0f) {
    const int64_t groups = K / G;
    x_groups.assign(M * groups, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) x_groups[m * groups + k / G] += static_cast<float>(x[m * K + k]);
  }
  const int64_t blocks = N / Rows;
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / (Rows * K / 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    FlushDenormals flushed;  // a group of zeros (vec16.h)
    for (int64_t b = begin; b < end; ++b)
      int4_outputs<Block, Rows, XRows>(q + b * Rows * (K / 2), scales, x, x_groups.data(), bias, out, b * Rows, M, N,
                                       K, G);
  });
  FlushDenormals flushed;
  for (int64_t n = blocks * Rows; n < N; ++n)
    int4_outputs<Block, 1, XRows>(q + n * (K / 2), scales, x, x_groups.data(), bias, out, n, M, N, K, G);
}

template <typename T>
inline void dequantize_row(const uint8_t* q, const float* scales, int64_t K, int64_t G, T* w);  // below

// Input rows from which the widening path dequantizes each block once: unpacking nibbles for every
// pass costs more than the products (int8's sign extension is cheap enough to keep, int8_rows.h).
constexpr int64_t kWidenOnceRows = 4;

// out [M, N] (T) for fp32 inputs x [M, K], M >= kWidenOnceRows: each block of kRows weight rows is
// dequantized to fp32 once (dequantize_row), into scratch that stays in the cache (kRows * K
// floats), and multiplied into every input row by few_rows.h's fp32 loop. Blocks split over the
// threads; the last N % kRows rows alone. Denormals flushed: a weight group of zeros has the
// smallest scale, and its weights come out denormal.
template <typename T>
void int4_dequantized_products(const float* x, int64_t M, const uint8_t* q, const float* scales, int64_t N,
                               int64_t K, int64_t G, const T* bias, T* out) {
  const auto run = [&](int64_t n, auto rows_constant, float* block) {
    constexpr int rows = decltype(rows_constant)::value;
    for (int r = 0; r < rows; ++r) dequantize_row(q + (n + r) * (K / 2), scales + (n + r) * (K / G), K, G, block + r * K);
    block_passes<float, rows>(block, x, M, K, kNoPrefetch, [&](int64_t m, int r, float sum) {
      out[m * N + n + r] = T(sum + (bias ? static_cast<float>(bias[n + r]) : 0.0f));
    });
  };
  const auto scratch = [K](std::vector<float>& buffer) {  // 64-byte aligned: whole cache lines per load
    buffer.resize(size_t(kRows * K + 16));
    const auto address = reinterpret_cast<uintptr_t>(buffer.data());
    return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
  };
  const int64_t blocks = N / kRows;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * int64_t(sizeof(float))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    FlushDenormals flushed;
    std::vector<float> buffer;
    float* block = scratch(buffer);
    for (int64_t b = begin; b < end; ++b) run(b * kRows, std::integral_constant<int, kRows>{}, block);
  });
  FlushDenormals flushed;
  std::vector<float> buffer;
  float* block = scratch(buffer);
  for (int64_t n = blocks * kRows; n < N; ++n) run(n, std::integral_constant<int, 1>{}, block);
}

// out [M, N] = x [M, K] @ dequantized(q [N, K / 2], scales [N, K / G])^T (+ bias [N]): bf16 inputs on
// the AVX-512 build as they are, others widened to fp32 once (a few rows). K % G == 0, G % 32 == 0.
template <typename T>
void int4_linear(const T* x_in, int64_t M, const uint8_t* q, const float* scales, int64_t N, int64_t K, int64_t G,
                 const T* bias, T* out) {
#if defined(BLOOM_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // Many rows on AMX tiles (amx_rows.h), where enabled: each strip of weight rows dequantized as
    // int4_dequantize does it (the weights the reference multiplies), in the cache, as it is needed.
    if (amx_takes_quantized(M, N, K)) {
      const auto strip_of = [&](int64_t n0, int64_t rows, at::BFloat16* strip) {
        for (int64_t r = 0; r < rows; ++r)
          dequantize_row(q + (n0 + r) * (K / 2), scales + (n0 + r) * (K / G), K, G, strip + r * K);
        return static_cast<const at::BFloat16*>(strip);
      };
      return amx_products(x_in, M, N, K, strip_of, true, nullptr, bias, out, N);
    }
  }
#endif
#if defined(BLOOM_ISA_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return int4_products<Int4Bf16DotBlock, kInt4Bf16Rows, kInt4Bf16XRows>(x_in, M, q, scales, N, K, G, bias, out);
  }
#endif
  std::vector<float> x(M * K);
  for (int64_t i = 0; i < M * K; ++i) x[i] = static_cast<float>(x_in[i]);
  if (M >= kWidenOnceRows) return int4_dequantized_products(x.data(), M, q, scales, N, K, G, bias, out);
  int4_products<Int4WidenedBlock, kInt4Rows, kInt4XRows>(x.data(), M, q, scales, N, K, G, bias, out);
}

// One packed row [K / 2] with its group scales [K / G] as K weights of type T: (v - 8) * scale,
// computed in fp32 and rounded once to T (the weights a float model would hold).
template <typename T>
inline void dequantize_row(const uint8_t* q, const float* scales, int64_t K, int64_t G, T* w) {
  const Vec16 eight = set16(8.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kInt4Block) {
    const Vec16 scale = set16(scales[k0 / G]);
    __m128i low, high;
    unpack_block(q + k0 / 2, low, high);
    store16(w + k0, (widen16(low) - eight) * scale);
    store16(w + k0 + 16, (widen16(high) - eight) * scale);
  }
}

// w [N, K], every row dequantized: for products of many rows, which go to oneDNN.
template <typename T>
void int4_dequantize(const uint8_t* q, const float* scales, int64_t N, int64_t K, int64_t G, T* w) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(q + n * (K / 2), scales + n * (K / G), K, G, w + n * K);
  });
}

BLOOM_CPU_END
