// Integer products ("block Q8", bloom_hpu/int8_activations.py): the input of a product rounded to
// int8 per block of 32 values of a row, then multiplied by an int8 or int4 weight with integer dot
// products. The operators block_q8_quantize and block_q8_linear (quantized_linear.cpp) use it.
//
//   y[i, j] = sum_b d[i, b] * s[j, b] * (sum_{k in block b} xq[i, k] * q[j, k]) + bias[j]
//
// x [M, K] (K % 32 == 0) is rounded once per call (quantize_block: bit for bit the public op's
// arithmetic), into scratch memory in the form the product below reads. Weights: int8 q [N, K] at
// row scales s [N], or int4 packed [N, K / 2] (int4.py's layout: in each block of 32 weights, byte j
// holds weight j's v in its low nibble and weight j + 16's in its high one; q = v - 8) at group
// scales [N, K / G].
//
// Why it is fast: a block's integer dot for V output columns (V = 16 on AVX-512, 8 on AVX2) is
// accumulated in the V lanes of one vector, so that the only float work per block is one conversion
// and one or two multiplies per (input row, V columns), and no horizontal sum is ever taken. For
// that the weights of V columns are repacked on the fly, a block at a time, into a panel in which 4
// consecutive k of the V columns sit in one vector ([block][k / 4][column][4 bytes]): each 4 inputs
// of a row are broadcast (one load) and multiplied into all V columns by one instruction. The panel
// of a few columns is packed once per call (vector transposes, no gathers) and then read from the
// cache for every input row, so the packing is paid once per weight byte however many rows there
// are. Work is split over OpenMP threads by column tiles (and by row chunks where there are too
// few column tiles), each a register tile of R input rows x C vectors of columns.
//
// At a few rows (decode) packing would be most of the work, and the product must keep up with
// the memory streaming the weight: there the weight is read in place (block_q8_few, below), each
// vector of it multiplied into every input row as soon as it is loaded.
//
// On a CPU with AMX-INT8, int8 weights and more than kQ8FewPass rows go to the tiles instead
// (block_q8_amx.h), with the same result bit for bit as the panel.
//
// The integer dots, per ISA:
// * AVX-512 (VNNI): VPDPBUSD multiplies unsigned bytes by signed ones into int32 lanes, 64 products
//   an instruction. Int8 weights: the input is stored as xq + 128 (unsigned), the weight signed,
//   and the 128 * sum of a block's weights, computed while packing, starts each block's sums
//   negated. Int4 weights: the nibbles v = q + 8 are the unsigned operand, as they are (unpacked
//   in the panel), the input xq the signed one, and 8 * the block's sum of xq, computed at
//   quantization once per row, starts the sums negated. Either way the sums are exact.
// * AVX2, int4 weights: VPMADDUBSW multiplies the unsigned nibbles v (0..15) by the signed xq into
//   int16 pair sums of at most 2 * 15 * 127; eight such sums still fit int16, so a whole block is
//   summed in int16 and widened once (VPMADDWD by ones). The 8 of v - 8 comes off as 8 * the
//   block's sum of xq, computed at quantization, once per row and block.
// * AVX2, int8 weights: two int8 products of up to 127 * 127 cannot share an int16 lane, and the
//   sign trick (|x| times w with x's sign) costs an instruction per product vector; instead input
//   and weight are widened to int16 (the input once per call, the weight in the panel) and VPMADDWD
//   multiplies pairs straight into int32, 16 products an instruction. (The few-rows path, which
//   loads each weight vector once for all its rows, takes the sign trick: weights in [-127, 127],
//   as bloom_hpu/quantize.py makes them.)

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#include "vec16.h"

BLOOM_CPU_BEGIN

constexpr int64_t kQ8Block = 32;  // values per block of the input (and of an int4 weight's packing)

// ---------------------------------------------------------------------------------------------
// Quantization of the input.

// 16 integral fp32 lanes in [-127, 127] as 16 int8.
#if defined(BLOOM_ISA_AVX512)
inline __m128i int8_of(Vec16 v) { return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v.v)); }
#else
inline __m128i int8_of(Vec16 v) {
  // packs works within 128-bit halves: lo 0-3, hi 0-3 | lo 4-7, hi 4-7; the shuffle restores the order.
  const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  return _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
}
#endif

// One block of 32 values rounded as int8_activations.quantize_blocks rounds it: xq [32] written,
// the scale d returned, *sum set to the sum of xq. The inverse is computed as the reference's
// public ops compute it (PyTorch's `127 / t` is reciprocal(t) * 127: two roundings), so that xq
// is bit for bit the same.
template <typename T>
inline float quantize_block(const T* x, int8_t* xq, int32_t* sum) {
  const Vec16 a = load16(x), b = load16(x + 16);
  const Vec16 zero = zero16();
  const float amax = reduce_max(max16(max16(a, zero - a), max16(b, zero - b)));
  const float inverse = amax > 0.0f ? (1.0f / amax) * 127.0f : 0.0f;
  const Vec16 hi = set16(127.0f), lo = set16(-127.0f), scale = set16(inverse);
  const Vec16 qa = min16(max16(round_to_integer(a * scale), lo), hi);
  const Vec16 qb = min16(max16(round_to_integer(b * scale), lo), hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), int8_of(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), int8_of(qb));
  *sum = static_cast<int32_t>(reduce_add(qa + qb));  // integers of magnitude < 2^13: exact
  return amax / 127.0f;
}

// xq [M, K] and d [M, K / 32] of x [M, K] (block_q8_quantize), rows split over the threads.
template <typename T>
void block_q8_quantize(const T* x, int64_t M, int64_t K, int8_t* xq, float* d) {
  const int64_t blocks = K / kQ8Block;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    int32_t sum;
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        d[m * blocks + b] = quantize_block(x + m * K + b * kQ8Block, xq + m * K + b * kQ8Block, &sum);
  });
}

// ---------------------------------------------------------------------------------------------
// The weight kinds and the panel.

enum class Q8Weight { kInt8, kInt4 };

#if defined(BLOOM_ISA_AVX512)
constexpr int kQ8Lanes = 16;  // output columns per vector
using IVec = __m512i;
using FVec = __m512;
inline FVec fvec_zero() { return _mm512_setzero_ps(); }
inline FVec fvec_set(float v) { return _mm512_set1_ps(v); }
inline FVec fvec_load(const float* p) { return _mm512_loadu_ps(p); }
inline void fvec_store(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec fvec_fmadd_int(IVec sums, FVec scale, FVec acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc); }
inline FVec fvec_mul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
// p[0], p[stride], ..., p[15 * stride].
inline FVec fvec_gather(const float* p, int32_t stride) {
  return _mm512_i32gather_ps(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(stride)), p, 4);
}
#else
constexpr int kQ8Lanes = 8;
using IVec = __m256i;
using FVec = __m256;
inline FVec fvec_zero() { return _mm256_setzero_ps(); }
inline FVec fvec_set(float v) { return _mm256_set1_ps(v); }
inline FVec fvec_load(const float* p) { return _mm256_loadu_ps(p); }
inline void fvec_store(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec fvec_fmadd_int(IVec sums, FVec scale, FVec acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc); }
inline FVec fvec_mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
// p[0], p[stride], ..., p[7 * stride].
inline FVec fvec_gather(const float* p, int32_t stride) {
  return _mm256_i32gather_ps(p, _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride)), 4);
}
#endif
constexpr int kQ8VecBytes = kQ8Lanes * 4;

// What one row of the input looks like to the product, per weight kind and ISA: bytes per value
// (AVX2 with int8 weights: int16), and whether the product needs each block's sum of xq.
template <Q8Weight W>
struct Q8Input {
#if defined(BLOOM_ISA_AVX512)
  static constexpr int kBytes = 1;                    // int8: xq + 128, unsigned; int4: xq, signed
  static constexpr bool kSums = W == Q8Weight::kInt4;  // -8 * sum of xq per block
#else
  static constexpr int kBytes = W == Q8Weight::kInt8 ? 2 : 1;  // int16 or signed int8
  static constexpr bool kSums = W == Q8Weight::kInt4;          // -8 * sum of xq per block
#endif
};

// Vectors of the panel per block and vector of columns: k / 4 groups of 4 bytes, or (AVX2, int8:
// int16 pairs) k / 2 groups of 2 int16.
template <Q8Weight W>
constexpr int panel_vectors() {
  return Q8Input<W>::kBytes == 2 ? kQ8Block / 2 : kQ8Block / 4;
}

// The quantized input rows of a call: values [M, K * bytes], d [M, blocks], and on AVX2 with int4
// weights -8 * each block's sum of xq [M, blocks].
template <typename T, Q8Weight W>
void quantize_rows(const T* x, int64_t M, int64_t K, uint8_t* values, float* d, int32_t* corrections) {
  const int64_t blocks = K / kQ8Block;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    alignas(64) int8_t xq[kQ8Block];
    int32_t sum;
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = m * blocks + b;
        d[at] = quantize_block(x + m * K + b * kQ8Block, xq, &sum);
        uint8_t* out = values + (m * K + b * kQ8Block) * Q8Input<W>::kBytes;
#if defined(BLOOM_ISA_AVX512)
        if constexpr (W == Q8Weight::kInt8) {
          const __m256i bytes = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_xor_si256(bytes, _mm256_set1_epi8(char(0x80))));
        } else {
          std::memcpy(out, xq, kQ8Block);
          corrections[at] = -8 * sum;
        }
#else
        if constexpr (W == Q8Weight::kInt8) {
          const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(xq));
          const __m128i hi = _mm_load_si128(reinterpret_cast<const __m128i*>(xq + 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_cvtepi8_epi16(lo));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_cvtepi8_epi16(hi));
        } else {
          std::memcpy(out, xq, kQ8Block);
          corrections[at] = -8 * sum;
        }
#endif
      }
  });
}

// Transposes of 32-bit elements. AVX2: 8 rows of 8 -> 8 columns of 8, in place.
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // t0 = a0 b0 a1 b1 | a4 b4 a5 b5, t1 = a2 b2 a3 b3 | ..., t2 = c0 d0 c1 d1 | ..., t3 = c2 d2 c3 d3
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);  // a0 b0 c0 d0 | a4 b4 c4 d4
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);  // a1 b1 c1 d1 | a5 ...
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);  // a2 ...       | a6 ...
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);  // a3 ...       | a7 ...
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

#if defined(BLOOM_ISA_AVX512)
// 8 vectors, vector i holding row i's 8 elements in its lower half and row i + 8's in its upper
// half -> 8 vectors, vector t holding element t of rows 0..15.
inline void transpose16x8(__m512i r[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Per 256-bit half, as permute2x128 0x20 / 0x31 of AVX2's transpose, in 64-bit elements.
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_permutex2var_epi64(u[i], low, u[4 + i]);
    r[4 + i] = _mm512_permutex2var_epi64(u[i], high, u[4 + i]);
  }
}
#endif

// The panel of one tile of columns: for each block b and each vector c of kQ8Lanes columns,
// panel_vectors<W>() vectors of weights, then (AVX-512) the int32 start of each column's sums and
// (int4) each column's scale for the block.
template <Q8Weight W>
struct Q8Panel {
  int C;            // vectors of columns in the tile
  int64_t blocks;   // K / 32
  std::vector<uint8_t> weights;  // [blocks][C][panel_vectors][kQ8VecBytes]
  std::vector<int32_t> starts;   // AVX-512, int8: [blocks][C][kQ8Lanes]
  std::vector<float> scales;     // int4: [blocks][C][kQ8Lanes]; int8: [C][kQ8Lanes]

  Q8Panel(int C_, int64_t blocks_) : C(C_), blocks(blocks_) {
    weights.resize(size_t(blocks * C * panel_vectors<W>() * kQ8VecBytes) + 64);
#if defined(BLOOM_ISA_AVX512)
    if (W == Q8Weight::kInt8) starts.resize(size_t(blocks * C * kQ8Lanes));
#endif
    scales.resize(size_t((W == Q8Weight::kInt4 ? blocks : 1) * C * kQ8Lanes));
  }
  const uint8_t* block(int64_t b, int c) const {
    return weights.data() + (b * C + c) * panel_vectors<W>() * kQ8VecBytes;
  }
  uint8_t* block(int64_t b, int c) { return weights.data() + (b * C + c) * panel_vectors<W>() * kQ8VecBytes; }
};

// Packs columns n0 .. n0 + C * kQ8Lanes - 1 of the weight (zeros past N) into the panel.
// q: int8 [N, K] or packed int4 [N, K / 2]; scales [N] or [N, K / G].
template <Q8Weight W>
void pack_panel(const uint8_t* q, const float* scales, int64_t N, int64_t K, int64_t G, int64_t n0, Q8Panel<W>& panel) {
  const int64_t blocks = K / kQ8Block;
  const int64_t row_bytes = W == Q8Weight::kInt8 ? K : K / 2;
  constexpr int64_t block_bytes = W == Q8Weight::kInt8 ? 32 : 16;
  const int64_t groups = W == Q8Weight::kInt4 ? K / G : 1;
  alignas(64) static const uint8_t zeros[32] = {};
  for (int c = 0; c < panel.C; ++c) {
    const int64_t first = n0 + c * kQ8Lanes;
    const uint8_t* rows[kQ8Lanes];
    for (int l = 0; l < kQ8Lanes; ++l) rows[l] = first + l < N ? q + (first + l) * row_bytes : nullptr;
    if constexpr (W == Q8Weight::kInt8) {
      for (int l = 0; l < kQ8Lanes; ++l) panel.scales[c * kQ8Lanes + l] = first + l < N ? scales[first + l] : 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src[kQ8Lanes];
      for (int l = 0; l < kQ8Lanes; ++l) src[l] = rows[l] ? rows[l] + b * block_bytes : zeros;
      uint8_t* dst = panel.block(b, c);
      if constexpr (W == Q8Weight::kInt4) {
        // The block's scale of each column: its group's, copied from the block before within a
        // group, else gathered (one instruction for a whole vector of columns, not one load each).
        const int64_t g = b * kQ8Block / G;
        float* to = panel.scales.data() + (b * panel.C + c) * kQ8Lanes;
        if (b > 0 && (b - 1) * kQ8Block / G == g) {
          fvec_store(to, fvec_load(to - panel.C * kQ8Lanes));
        } else if (first + kQ8Lanes <= N) {
          fvec_store(to, fvec_gather(scales + first * groups + g, int32_t(groups)));
        } else {
          for (int l = 0; l < kQ8Lanes; ++l) to[l] = first + l < N ? scales[(first + l) * groups + g] : 0.0f;
        }
      }
#if defined(BLOOM_ISA_AVX512)
      if constexpr (W == Q8Weight::kInt8) {
        // rows l and l + 8 (32 bytes each = 8 dwords) -> dword t of the 16 columns.
        __m512i v[8];
        for (int i = 0; i < 8; ++i)
          v[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i]))),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i + 8])), 1);
        transpose16x8(v);
        // The start of the sums: -128 * each column's sum of weights over the block.
        __m512i sums = _mm512_setzero_si512();
        const __m512i ones = _mm512_set1_epi8(1);
        for (int i = 0; i < 8; ++i) {
          _mm512_storeu_si512(dst + i * 64, v[i]);
          sums = _mm512_dpbusd_epi32(sums, ones, v[i]);
        }
        _mm512_storeu_si512(panel.starts.data() + (b * panel.C + c) * kQ8Lanes,
                            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
      } else {
        // rows l, l + 4, l + 8, l + 12 (16 bytes = 4 dwords each) -> dword t (t < 4) of the 16
        // columns, by a 4 x 4 transpose in each 128-bit lane; then low nibbles (k = 4t..4t+3) and
        // high nibbles (k = 16 + 4t..) as they are, v = q + 8, unsigned: the input's -8 * its sum
        // starts the block's sums (tile_sums), so there is no start per column to compute here.
        __m512i r[4], t[4];
        for (int i = 0; i < 4; ++i) {
          __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i])));
          z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i + 4])), 1);
          z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i + 8])), 2);
          r[i] = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i + 12])), 3);
        }
        t[0] = _mm512_unpacklo_epi32(r[0], r[1]);
        t[1] = _mm512_unpackhi_epi32(r[0], r[1]);
        t[2] = _mm512_unpacklo_epi32(r[2], r[3]);
        t[3] = _mm512_unpackhi_epi32(r[2], r[3]);
        const __m512i dw[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                               _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int i = 0; i < 4; ++i) {
          _mm512_storeu_si512(dst + i * 64, _mm512_and_si512(dw[i], mask));
          _mm512_storeu_si512(dst + (i + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(dw[i], 4), mask));
        }
      }
#else
      if constexpr (W == Q8Weight::kInt8) {
        // Each row's 32 weights as 16 int16 pairs (two vectors of 8 dwords); two 8 x 8 transposes.
        __m256i lo[8], hi[8];
        for (int l = 0; l < 8; ++l) {
          lo[l] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[l])));
          hi[l] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[l] + 16)));
        }
        transpose8x8(lo);
        transpose8x8(hi);
        for (int t = 0; t < 8; ++t) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * 32), lo[t]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (8 + t) * 32), hi[t]);
        }
      } else {
        // rows l and l + 4 (16 bytes = 4 dwords each) -> dword t of the 8 columns (4 x 4 transpose in
        // each 128-bit lane); then the nibbles v unsigned.
        __m256i r[4];
        for (int i = 0; i < 4; ++i)
          r[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i]))),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[i + 4])), 1);
        const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        const __m256i dw[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                               _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 32), _mm256_and_si256(dw[i], mask));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 + i) * 32),
                              _mm256_and_si256(_mm256_srli_epi16(dw[i], 4), mask));
        }
      }
#endif
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The register tile: R input rows x C vectors of columns, over every block.

// acc[r][c] (float sums over the blocks so far) for rows x[r] (each row's values, at block 0).
template <Q8Weight W, int R, int C>
inline void tile_sums(const uint8_t* const* x, const float* const* d, const int32_t* const* corrections,
                      const Q8Panel<W>& panel, FVec acc[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = fvec_zero();
  for (int64_t b = 0; b < panel.blocks; ++b) {
    IVec sums[R][C];
    const uint8_t* w = panel.block(b, 0);
    constexpr int64_t vectors = panel_vectors<W>();
    constexpr int64_t x_bytes = kQ8Block * Q8Input<W>::kBytes;
#if defined(BLOOM_ISA_AVX512)
    // int8: x + 128 (unsigned) times the signed weight, from each column's start; int4: the
    // unsigned nibbles times the signed x, from the row's -8 * its sum.
    if constexpr (W == Q8Weight::kInt8) {
      for (int c = 0; c < C; ++c) {
        const IVec start = _mm512_loadu_si512(panel.starts.data() + (b * C + c) * kQ8Lanes);
        for (int r = 0; r < R; ++r) sums[r][c] = start;
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const IVec start = _mm512_set1_epi32(corrections[r][b]);
        for (int c = 0; c < C; ++c) sums[r][c] = start;
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < vectors; ++t) {
      IVec wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + (c * vectors + t) * kQ8VecBytes);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x[r] + b * x_bytes + 4 * t, 4);
        const IVec xv = _mm512_set1_epi32(four);
        for (int c = 0; c < C; ++c)
          sums[r][c] = W == Q8Weight::kInt8 ? _mm512_dpbusd_epi32(sums[r][c], xv, wv[c])
                                            : _mm512_dpbusd_epi32(sums[r][c], wv[c], xv);
      }
    }
#else
    if constexpr (W == Q8Weight::kInt8) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
      #pragma GCC unroll 16
      for (int t = 0; t < vectors; ++t) {
        IVec wv[C];
        for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (c * vectors + t) * kQ8VecBytes));
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x[r] + b * x_bytes + 4 * t, 4);
          const IVec xv = _mm256_set1_epi32(pair);
          for (int c = 0; c < C; ++c) {
            sums[r][c] = _mm256_add_epi32(sums[r][c], _mm256_madd_epi16(wv[c], xv));
            // Integer adds reassociate: without this GCC computed a block's 16 x R x C products
            // first, spilling them to the stack, and summed them after (1.06x slower at 128 rows).
            asm("" : "+x"(sums[r][c]));
          }
        }
      }
    } else {
      IVec pairs[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) pairs[r][c] = _mm256_setzero_si256();
      #pragma GCC unroll 16
      for (int t = 0; t < vectors; ++t) {
        IVec wv[C];
        for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (c * vectors + t) * kQ8VecBytes));
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, x[r] + b * x_bytes + 4 * t, 4);
          const IVec xv = _mm256_set1_epi32(four);
          for (int c = 0; c < C; ++c) pairs[r][c] = _mm256_add_epi16(pairs[r][c], _mm256_maddubs_epi16(wv[c], xv));
        }
      }
      const IVec ones = _mm256_set1_epi16(1);
      for (int r = 0; r < R; ++r) {
        const IVec correction = _mm256_set1_epi32(corrections[r][b]);
        for (int c = 0; c < C; ++c) sums[r][c] = _mm256_add_epi32(_mm256_madd_epi16(pairs[r][c], ones), correction);
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const FVec scale = fvec_set(d[r][b]);
      for (int c = 0; c < C; ++c) {
        if constexpr (W == Q8Weight::kInt4) {
          const FVec s = fvec_load(panel.scales.data() + (b * C + c) * kQ8Lanes);
          acc[r][c] = fvec_fmadd_int(sums[r][c], fvec_mul(scale, s), acc[r][c]);
        } else {
          acc[r][c] = fvec_fmadd_int(sums[r][c], scale, acc[r][c]);
        }
      }
    }
  }
}

// Rows m0 .. m0 + R - 1 (R' = rows left <= R, chosen at compile time) of the tile's columns.
template <Q8Weight W, int R, int C, typename T>
inline void tile_rows(int64_t rows, const uint8_t* values, const float* d, const int32_t* corrections, int64_t m0,
                      int64_t K, const Q8Panel<W>& panel, int64_t n0, int64_t N, const T* bias, T* out) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<W, R - 1, C>(rows, values, d, corrections, m0, K, panel, n0, N, bias, out);
  }
  const int64_t blocks = K / kQ8Block;
  const uint8_t* x[R];
  const float* dr[R];
  const int32_t* cr[R];
  for (int r = 0; r < R; ++r) {
    x[r] = values + (m0 + r) * K * Q8Input<W>::kBytes;
    dr[r] = d + (m0 + r) * blocks;
    cr[r] = corrections ? corrections + (m0 + r) * blocks : nullptr;
  }
  FVec acc[R][C];
  tile_sums<W, R, C>(x, dr, cr, panel, acc);
  alignas(64) float row[(C * kQ8Lanes + 15) / 16 * 16];  // whole Vec16s: lanes past the tile are never stored
  const int64_t width = std::min<int64_t>(C * kQ8Lanes, N - n0);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      FVec v = acc[r][c];
      if constexpr (W == Q8Weight::kInt8) v = fvec_mul(v, fvec_load(panel.scales.data() + c * kQ8Lanes));
      fvec_store(row + c * kQ8Lanes, v);
    }
    T* dst = out + (m0 + r) * N + n0;
    for (int64_t j = 0; j < width; j += 16) {
      Vec16 v = load16(row + j);
      if (bias) v = v + load_first(bias + n0 + j, std::min<int64_t>(16, width - j));
      store_first(dst + j, v, std::min<int64_t>(16, width - j));
    }
  }
}

// Register tiles per ISA and weight kind: rows x vectors of columns, as many as the registers hold
// (AVX-512: 32 zmm; AVX2: 16 ymm). On AVX2, 4 rows x 2 vectors (8 sums, 2 weight vectors, a
// broadcast) rather than 2 x 2: each weight vector read from the panel, which outgrows L1 at
// K = 4096, feeds 4 rows, and the products of 8-128 rows ran 1.2-1.4x faster; wider tiles (4 x 3,
// 6 x 2) spill and were slower.
#if defined(BLOOM_ISA_AVX512)
template <Q8Weight W> constexpr int kQ8Rows = 4;
template <Q8Weight W> constexpr int kQ8Cols = 2;
#else
template <Q8Weight W> constexpr int kQ8Rows = 4;
template <Q8Weight W> constexpr int kQ8Cols = 2;
#endif

// ---------------------------------------------------------------------------------------------
// A few input rows (decode): the weight read in place, no panel. The panel's packing is paid once
// per weight byte however many rows there are; at a row or two it is most of the work, while
// here each weight vector is loaded once and multiplied into every row straight away, so the
// product keeps up with the memory streaming the weight. The sums of a block stay spread over
// lanes (a float sum per lane, the block's scale per lane), and one horizontal sum per output
// ends the row. Up to kQ8FewPass rows are multiplied a pass; more rows (AVX-512, up to 8) take a
// second pass over each block of weight rows while it is still in L1, where that is faster than the
// panel: how many rows this path takes is set per weight format for the process (set_q8_few_rows,
// timed per machine by integer_rows.py), as it depends on the CPU and the weight prefetch (on a Zen
// 5, a bloom-560m layer streamed from memory, few-rows / panel time: int4 1.30 at 7 rows, 0.82-1.02
// at 8; int8 0.97-1.25 at 6-7 rows, 1.0-1.75 at 8, by the prefetch kind).

#if defined(BLOOM_ISA_AVX512)
constexpr int64_t kQ8FewRows = 8;         // the most input rows this path can take
constexpr int64_t kQ8FewRowsDefault = 7;  // until set_q8_few_rows says otherwise (the Zen 5's; q8_few_rows_bounds)
#else
constexpr int64_t kQ8FewRows = 4;
constexpr int64_t kQ8FewRowsDefault = 4;
#endif

// The most input rows the few-rows path takes over int8 (format 1) or int4 (2) weights, for the
// process (prefetch.h's WeightFormat numbering); more go to the panel.
inline std::atomic<int64_t>& q8_few_rows(int format) {
  static std::atomic<int64_t> rows[2] = {kQ8FewRowsDefault, kQ8FewRowsDefault};
  return rows[format == kInt4Weights ? 1 : 0];
}
constexpr int64_t kQ8FewPass = 4;        // input rows multiplied in one pass over a block of weight rows
constexpr int kQ8FewWeightRows = 4;      // weight rows per task step
constexpr int64_t kQ8FewPrefetch = 2048;  // weight bytes ahead of the loads

// The input as this path reads it: xq (signed), and per row and block its scale d and the start
// of its integer sums (AVX-512: per pair of blocks, a vector: lanes 0-7 block 2p, lanes 8-15
// block 2p + 1, each lane's share of the correction; AVX2: per block, one lane's share).
struct Q8FewInput {
  std::vector<int8_t> xq;       // [M, K]
  std::vector<uint8_t> xabs;    // AVX2, int8 weights: |xq| [M, K]
  std::vector<float> d;         // AVX-512: [M, blocks / 2, 16]; AVX2: [M, blocks]
  std::vector<int32_t> starts;  // AVX-512: [M, blocks / 2, 16]; AVX2 int4: [M, blocks]
  // AVX-512, int4 weights, blocks % 4 == 0 (FewQuad): per row and quad of blocks, xq as the quad's
  // 64 packed bytes meet it: [low halves of the 4 blocks | high halves], 128 bytes; and d and the
  // start of the sums per lane, lanes 4g..4g+3 for block g of the quad.
  std::vector<int8_t> quad_x;         // [M, blocks / 4, 128]
  std::vector<float> quad_d;          // [M, blocks / 4, 16]
  std::vector<int32_t> quad_starts;   // [M, blocks / 4, 16]
};

// Int4 weights four blocks (64 bytes, one cache line) a step: AVX-512, K % 128 == 0.
constexpr bool int4_quads(int64_t K) {
#if defined(BLOOM_ISA_AVX512)
  return K % (4 * kQ8Block) == 0;
#else
  return false;
#endif
}

template <typename T, Q8Weight W>
void quantize_few(const T* x, int64_t M, int64_t K, Q8FewInput& in) {
  const int64_t blocks = K / kQ8Block;
  in.xq.resize(size_t(M * K));
  // Int4 a quad of blocks a step (FewQuad) reads its own layout only, not the pairs' d and starts.
  const bool quads = W == Q8Weight::kInt4 && int4_quads(K);
  if (quads) {
    in.quad_x.resize(size_t(M * K));
    in.quad_d.resize(size_t(M * blocks * 4));
    in.quad_starts.resize(size_t(M * blocks * 4));
  }
#if defined(BLOOM_ISA_AVX512)
  if (!quads) {
    in.d.resize(size_t(M * blocks * 8));
    in.starts.resize(size_t(M * blocks * 8));
  }
  // int8 weights are read as w + 128 (unsigned): 128 * the block's sum of xq comes off, 16 per
  // lane of its 8; int4 nibbles v = q + 8: 8 * the sum, 1 per lane.
  const int32_t share = W == Q8Weight::kInt8 ? 16 : 1;
#else
  in.d.resize(size_t(M * blocks));
  if constexpr (W == Q8Weight::kInt8) {
    in.xabs.resize(size_t(M * K));
  } else {
    in.starts.resize(size_t(M * blocks));
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum;
      int8_t* xq = in.xq.data() + m * K + b * kQ8Block;
      const float d = quantize_block(x + m * K + b * kQ8Block, xq, &sum);
#if defined(BLOOM_ISA_AVX512)
      for (int l = 0; l < 8 && !quads; ++l) {
        in.d[(m * blocks + b) * 8 + l] = d;
        in.starts[(m * blocks + b) * 8 + l] = -share * sum;
      }
#else
      in.d[m * blocks + b] = d;
      if constexpr (W == Q8Weight::kInt8) {
        for (int k = 0; k < kQ8Block; ++k) in.xabs[m * K + b * kQ8Block + k] = uint8_t(xq[k] < 0 ? -xq[k] : xq[k]);
      } else {
        in.starts[m * blocks + b] = -2 * sum;  // 8 * the sum, a quarter per lane of a row's 4
      }
#endif
      if (quads) {
        const int64_t quad = b / 4, g = b % 4;
        int8_t* qx = in.quad_x.data() + (m * (blocks / 4) + quad) * 128;
        std::copy(xq, xq + 16, qx + 16 * g);             // the low nibbles' weights 0..15
        std::copy(xq + 16, xq + 32, qx + 64 + 16 * g);   // the high nibbles' weights 16..31
        for (int l = 0; l < 4; ++l) {
          in.quad_d[(m * (blocks / 4) + quad) * 16 + 4 * g + l] = d;
          in.quad_starts[(m * (blocks / 4) + quad) * 16 + 4 * g + l] = -2 * sum;  // 8 * the sum over 4 lanes
        }
      }
    }
}

#if defined(BLOOM_ISA_AVX512)
// 64 weights (two blocks) of a row at block b as bytes for VPDPBUSD's unsigned operand, in k order.
template <Q8Weight W>
inline __m512i few_weights(const uint8_t* row, int64_t b) {
  if constexpr (W == Q8Weight::kInt8) {
    return _mm512_xor_si512(_mm512_loadu_si512(row + b * kQ8Block), _mm512_set1_epi8(char(0x80)));
  } else {
    const __m512i z = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16)));
    const __m512i twice = _mm512_shuffle_i64x2(z, z, 0x50);  // 128-bit lanes: block b, b, b + 1, b + 1
    const __m512i shifted = _mm512_srlv_epi64(twice, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
  }
}
#endif

// sums[m * R + r] = the product of input row m with weight row r (scaled, without bias).
template <Q8Weight W, int R, int MB>
struct FewBlock {
  static void run(const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, int64_t G,
                  const Q8FewInput& in, int64_t m0, int64_t K, float* sums) {
#if defined(BLOOM_ISA_AVX512)
    const int64_t blocks = K / kQ8Block;
    const int prefetch = weight_prefetch(W == Q8Weight::kInt8 ? kInt8Weights : kInt4Weights);
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
      __m512i w[R];
      __m512 sv[R];  // int4: the two blocks' scales, 8 lanes each
      for (int r = 0; r < R; ++r) {
        prefetch_weights(q + r * row_bytes + b * (row_bytes / blocks), R * row_bytes, kQ8FewPrefetch, prefetch);
        w[r] = few_weights<W>(q + r * row_bytes, b);
        if constexpr (W == Q8Weight::kInt4) {
          const float* s = scales + r * groups;
          sv[r] = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(s[b * kQ8Block / G]),
                                       _mm512_set1_ps(s[(b + 1) * kQ8Block / G]));
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t at = ((m0 + m) * blocks + b) * 8;
        const __m512i xv = _mm512_loadu_si512(in.xq.data() + (m0 + m) * K + b * kQ8Block);
        const __m512i start = _mm512_loadu_si512(in.starts.data() + at);
        const __m512 d = _mm512_loadu_ps(in.d.data() + at);
        for (int r = 0; r < R; ++r) {
          const __m512 sums_f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w[r], xv));
          if constexpr (W == Q8Weight::kInt4) {
            acc[r][m] = _mm512_fmadd_ps(sums_f, _mm512_mul_ps(d, sv[r]), acc[r][m]);
          } else {
            acc[r][m] = _mm512_fmadd_ps(sums_f, d, acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m)
        sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]) * (W == Q8Weight::kInt8 ? scales[r] : 1.0f);
#else
    if constexpr (W == Q8Weight::kInt4) {
      int4_pairs(q, row_bytes, scales, groups, G, in, m0, K, sums);
    } else {
      int8_signs(q, row_bytes, scales, in, m0, K, sums);
    }
#endif
  }

#if !defined(BLOOM_ISA_AVX512)
  // AVX2, int8: each block of a weight row (32 bytes) multiplied into every input row by the sign
  // trick (module doc), the sums spread over 8 lanes.
  static void int8_signs(const uint8_t* q, int64_t row_bytes, const float* scales, const Q8FewInput& in, int64_t m0,
                         int64_t K, float* sums) {
    const int64_t blocks = K / kQ8Block;
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int prefetch = weight_prefetch(W == Q8Weight::kInt8 ? kInt8Weights : kInt4Weights);
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i w[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = q + r * row_bytes + b * (row_bytes / blocks);
        prefetch_weights(p, R * row_bytes, kQ8FewPrefetch, prefetch);
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t at = (m0 + m) * blocks + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xq.data() + (m0 + m) * K + b * kQ8Block));
        const float d = in.d[at];
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xabs.data() + (m0 + m) * K + b * kQ8Block));
        for (int r = 0; r < R; ++r) {
          // |x| times w with x's sign: each int16 pair sum at most 2 * 127 * 127.
          const __m256i sums_i = _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w[r], xv)), ones);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_i), _mm256_set1_ps(d), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = reduce_add8(acc[r][m]) * scales[r];
  }

  // AVX2, int4: two weight rows share each vector, so every instruction does a full vector of work
  // where one row's block (16 bytes) would fill half of one. Per pair and block the 16 packed bytes
  // of each row become lo = [row a: v 0..15 | row b: v 0..15] and hi = [a: v 16..31 | b: v 16..31]
  // (one load each, an AND, a shift), multiplied by the block's xq with each 128-bit half repeated
  // (VPMADDUBSW: int16 pair sums of at most 2 * 15 * 127, the lo and hi ones added in int16), widened
  // by VPMADDWD: lanes 0-3 hold row a's sums, 4-7 row b's. Each lane starts at -2 * the block's sum
  // of xq (the -8 of q = v - 8, a quarter per lane), and one multiply by d times the two rows'
  // scales ([a x 4 | b x 4]) ends the block. An odd last row is paired with itself.
  static void int4_pairs(const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, int64_t G,
                         const Q8FewInput& in, int64_t m0, int64_t K, float* sums) {
    constexpr int P = (R + 1) / 2;
    const int64_t blocks = K / kQ8Block, blocks_per_group = G / kQ8Block;
    __m256 acc[P][MB];
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < MB; ++m) acc[p][m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
    const int prefetch = weight_prefetch(W == Q8Weight::kInt8 ? kInt8Weights : kInt4Weights);
    int64_t g = 0, left = blocks_per_group;
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i lo[P], hi[P];
      __m256 s[P];
      for (int p = 0; p < P; ++p) {
        const int a = 2 * p, c = std::min(2 * p + 1, R - 1);
        const uint8_t* pa = q + a * row_bytes + b * 16;
        const uint8_t* pc = q + c * row_bytes + b * 16;
        if (b % 4 == 0) {  // one prefetch per 64-byte line of each row
          prefetch_weights(pa, R * row_bytes, kQ8FewPrefetch, prefetch);
          prefetch_weights(pc, R * row_bytes, kQ8FewPrefetch, prefetch);
        }
        const __m256i bytes = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pa))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(pc)), 1);
        lo[p] = _mm256_and_si256(bytes, mask);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        s[p] = _mm256_set_m128(_mm_set1_ps(scales[c * groups + g]), _mm_set1_ps(scales[a * groups + g]));
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t at = (m0 + m) * blocks + b;
        const int8_t* x = in.xq.data() + (m0 + m) * K + b * kQ8Block;
        const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
        const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16)));
        const __m256i start = _mm256_set1_epi32(in.starts[at]);
        const __m256 d = _mm256_set1_ps(in.d[at]);
        for (int p = 0; p < P; ++p) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xlo), _mm256_maddubs_epi16(hi[p], xhi));
          const __m256i sums_i = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), start);
          acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_i), _mm256_mul_ps(d, s[p]), acc[p][m]);
        }
      }
      if (--left == 0) {
        ++g;
        left = blocks_per_group;
      }
    }
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < MB; ++m) {
        const __m128 halves = _mm_hadd_ps(_mm256_castps256_ps128(acc[p][m]), _mm256_extractf128_ps(acc[p][m], 1));
        const __m128 both = _mm_hadd_ps(halves, halves);  // [a, b, a, b]
        sums[m * R + 2 * p] = _mm_cvtss_f32(both);
        if (2 * p + 1 < R) sums[m * R + 2 * p + 1] = _mm_cvtss_f32(_mm_shuffle_ps(both, both, 1));
      }
  }
#endif
};

#if defined(BLOOM_ISA_AVX512)
// Int4 weights, a quad of blocks (a row's 64 bytes) a step: one load gives the 4 blocks' low nibbles
// (weights 0..15 of each) and high nibbles (16..31), each multiplied by xq laid out to match
// (quad_x), lanes 4g..4g+3 summing block g; one conversion and one multiply by d times the block's
// scale end the step. About half the instructions per byte of FewBlock's two blocks a step, which
// leave a decode step bound by arithmetic rather than by the memory.
template <int R, int MB>
struct FewQuad {
  static void run(const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, int64_t G,
                  const Q8FewInput& in, int64_t m0, int64_t K, float* sums) {
    const int64_t quads = K / (4 * kQ8Block);
    const int prefetch = weight_prefetch(kInt4Weights);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    // A quad's 4 blocks span 4 / (G / 32) groups (G a power of two from 32): shifts, not divisions,
    // find them, and one masked load (no read past the row's last scale) takes their scales.
    int shift = 0;
    while ((kQ8Block << shift) < G) ++shift;
    const int scales_per_quad = shift >= 2 ? 1 : 4 >> shift;
    const __mmask16 scale_lanes = __mmask16((1 << scales_per_quad) - 1);
    const __m512i spread = _mm512_srli_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                             std::min(shift, 2));
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < quads; ++j) {
      __m512i lo[R], hi[R];
      __m512 sv[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* line = q + r * row_bytes + j * 64;
        prefetch_weights(line, R * row_bytes, kQ8FewPrefetch, prefetch);
        const __m512i z = _mm512_loadu_si512(line);
        lo[r] = _mm512_and_si512(z, nibble);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(z, 4), nibble);
        const float* s = scales + r * groups + ((4 * j) >> shift);
        if (((4 * j) >> shift) % 16 == 0)  // the next scales too, a line (16 of them) at a time
          prefetch_weights(s, R * groups * int64_t(sizeof(float)), kQ8FewPrefetch, prefetch);
        sv[r] = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(scale_lanes, s));
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t at = (m0 + m) * quads + j;
        const __m512i xlo = _mm512_loadu_si512(in.quad_x.data() + at * 128);
        const __m512i xhi = _mm512_loadu_si512(in.quad_x.data() + at * 128 + 64);
        const __m512i start = _mm512_loadu_si512(in.quad_starts.data() + at * 16);
        const __m512 d = _mm512_loadu_ps(in.quad_d.data() + at * 16);
        for (int r = 0; r < R; ++r) {
          const __m512i sum_i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo[r], xlo), hi[r], xhi);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_i), _mm512_mul_ps(d, sv[r]), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
};

template <int R, int MB>
inline void few_quad(int64_t mb, const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, int64_t G,
                     const Q8FewInput& in, int64_t m0, int64_t K, float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return few_quad<R, MB - 1>(mb, q, row_bytes, scales, groups, G, in, m0, K, sums);
  }
  FewQuad<R, MB>::run(q, row_bytes, scales, groups, G, in, m0, K, sums);
}
#endif

template <Q8Weight W, int R, int MB>
inline void few_block(int64_t mb, const uint8_t* q, int64_t row_bytes, const float* scales, int64_t groups, int64_t G,
                      const Q8FewInput& in, int64_t m0, int64_t K, float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return few_block<W, R, MB - 1>(mb, q, row_bytes, scales, groups, G, in, m0, K, sums);
  }
  FewBlock<W, R, MB>::run(q, row_bytes, scales, groups, G, in, m0, K, sums);
}

// out [M, N] for M <= kQ8FewRows (AVX-512: K % 64 == 0, two blocks a step).
template <Q8Weight W, typename T>
void block_q8_few(const T* x, int64_t M, const uint8_t* q, const float* scales, int64_t N, int64_t K, int64_t G,
                  const T* bias, T* out) {
  Q8FewInput in;
  quantize_few<T, W>(x, M, K, in);
  FlushDenormals flushed;  // after the rounding of x, which keeps the reference's values
  const int64_t row_bytes = W == Q8Weight::kInt8 ? K : K / 2;
  const int64_t groups = W == Q8Weight::kInt4 ? K / G : 1;
  const int64_t scale_stride = W == Q8Weight::kInt4 ? groups : 1;
  auto outputs = [&](auto rows, int64_t n) {
    constexpr int R = decltype(rows)::value;
    float sums[R * kQ8FewRows];  // [m][r]
    for (int64_t m0 = 0; m0 < M; m0 += kQ8FewPass) {  // a second pass finds the weight rows in L1
      const int64_t mb = std::min<int64_t>(kQ8FewPass, M - m0);
#if defined(BLOOM_ISA_AVX512)
      if (W == Q8Weight::kInt4 && int4_quads(K))
        few_quad<R, kQ8FewPass>(mb, q + n * row_bytes, row_bytes, scales + n * scale_stride, groups, G, in, m0, K,
                                sums + m0 * R);
      else
#endif
        few_block<W, R, kQ8FewPass>(mb, q + n * row_bytes, row_bytes, scales + n * scale_stride, groups, G, in, m0, K,
                                    sums + m0 * R);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        out[m * N + n + r] = T(sums[m * R + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f));
  };
  const int64_t steps = N / kQ8FewWeightRows;
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / (kQ8FewWeightRows * row_bytes));
  at::parallel_for(0, steps, grain, [&](int64_t begin, int64_t end) {
    FlushDenormals flushed_here;
    for (int64_t step = begin; step < end; ++step)
      outputs(std::integral_constant<int, kQ8FewWeightRows>{}, step * kQ8FewWeightRows);
  });
  for (int64_t n = steps * kQ8FewWeightRows; n < N; ++n) outputs(std::integral_constant<int, 1>{}, n);
}

#if defined(BLOOM_AMX)
// Int8 weights and many rows on AMX-INT8 tiles: block_q8_amx.h.
inline bool q8_amx_ready();
template <typename T>
void amx_q8_linear(const T* x, int64_t M, const int8_t* q, const float* scales, int64_t N, int64_t K, const T* bias,
                   T* out);
#endif

// out [M, N] = the product of x [M, K] with the weight (module doc), + bias [N]; K % 32 == 0.
template <Q8Weight W, typename T>
void block_q8_linear(const T* x, int64_t M, const uint8_t* q, const float* scales, int64_t N, int64_t K, int64_t G,
                     const T* bias, T* out) {
  if (M == 0 || N == 0) return;
#if defined(BLOOM_ISA_AVX512)
  const bool pairs = K % (2 * kQ8Block) == 0;
#else
  const bool pairs = true;
#endif
#if defined(BLOOM_AMX)
  // AMX-INT8 tiles take int8 weights past one pass of the few-rows path, as they did before that
  // path took a second pass (no AMX machine measured the two at 5-7 rows).
  if constexpr (W == Q8Weight::kInt8) {
    if (M > kQ8FewPass && N % 16 == 0 && q8_amx_ready())
      return amx_q8_linear(x, M, reinterpret_cast<const int8_t*>(q), scales, N, K, bias, out);
  }
#endif
  const int64_t few_rows = q8_few_rows(W == Q8Weight::kInt8 ? kInt8Weights : kInt4Weights).load(std::memory_order_relaxed);
  if (M <= few_rows && pairs) return block_q8_few<W>(x, M, q, scales, N, K, G, bias, out);
  constexpr int R = kQ8Rows<W>, C = kQ8Cols<W>;
  const int64_t blocks = K / kQ8Block;
  std::vector<uint8_t> values(size_t(M * K * Q8Input<W>::kBytes));
  std::vector<float> d(size_t(M * blocks));
  std::vector<int32_t> corrections(Q8Input<W>::kSums ? size_t(M * blocks) : 0);
  quantize_rows<T, W>(x, M, K, values.data(), d.data(), corrections.data());
  const int32_t* corr = Q8Input<W>::kSums ? corrections.data() : nullptr;

  // Tasks: column tiles x row chunks; a row chunk only where the column tiles alone leave threads
  // idle (each chunk packs its tile's panel again).
  const int64_t tile = C * kQ8Lanes;
  const int64_t tiles = (N + tile - 1) / tile;
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (tiles < 4 * threads) chunks = std::min<int64_t>((M + R - 1) / R, (4 * threads + tiles - 1) / tiles);
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + R - 1) / R * R;
  chunks = (M + chunk_rows - 1) / chunk_rows;
  const int64_t row_bytes = W == Q8Weight::kInt8 ? K : K / 2;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flushed;
    Q8Panel<W> panel(C, blocks);
    int64_t packed = -1;
    // The next tile's weight rows (contiguous), fetched while this tile is multiplied: the packing
    // reads its rows a block at a time, too many streams for the hardware's prefetchers. A slice
    // of them before each pass of R rows, not all at once, so the fetches overlap the arithmetic
    // rather than queue up before it. (A bloom-560m layer of int4 at 16 rows, weights streamed,
    // builds alternated in one process: all at once into L2 before the packing 0.79 ms, none 0.79,
    // spread 0.70, spread into L1 0.66; the weights in cache 0.47-0.51 whichever.)
    const char* next_rows = nullptr;
    int64_t next_bytes = 0, fetched = 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n_tile = task / chunks, chunk = task % chunks;
      const int64_t n0 = n_tile * tile;
      if (n_tile != packed) {
        pack_panel<W>(q, scales, N, K, G, n0, panel);
        packed = n_tile;
        const int64_t next = std::min<int64_t>(N, n0 + tile), next_end = std::min<int64_t>(N, n0 + 2 * tile);
        next_rows = reinterpret_cast<const char*>(q + next * row_bytes);
        next_bytes = (next_end - next) * row_bytes;
        fetched = 0;
      }
      const int64_t m_begin = chunk * chunk_rows, m_end = std::min<int64_t>(M, (chunk + 1) * chunk_rows);
      const int64_t slice = (next_bytes / ((m_end - m_begin + R - 1) / R) + 63) / 64 * 64;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += R) {
        for (const int64_t stop = std::min(next_bytes, fetched + slice); fetched < stop; fetched += 64)
          _mm_prefetch(next_rows + fetched, _MM_HINT_T0);
        tile_rows<W, R, C>(std::min<int64_t>(R, m_end - m0), values.data(), d.data(), corr, m0, K, panel, n0, N, bias,
                           out);
      }
    }
  });
}

BLOOM_CPU_END

#include "block_q8_amx.h"  // after block_q8_linear, which calls it
