// The integer products (block_q8.h) of int8 weights and many input rows on AMX-INT8 tiles (Xeon
// Sapphire Rapids and later):
//
//   y[i, j] = s[j] * sum_b d[i, b] * S[i, j, b],   S[i, j, b] = sum_{k in block b} xq[i, k] * q[j, k]
//
// One TDPBSSD multiplies a tile of 16 weight rows x 32 int8 of k (one block) by a tile of the same
// 32 k of 16 input rows (as 8 rows of [16 input rows x 4 k]) into 16 x 16 int32 block sums S:
// 8192 products an instruction, where VPDPBUSD makes 64. The sums are exact and each block's is
// scaled and added in fp32 in the same order as the panel kernel's, so the result is the panel
// kernel's bit for bit; what is left per block is that float work: the 16 x 16 sums stored, and per
// weight row one conversion and one multiply-add into an accumulator kept in a register.
//
// The weight is read in place (16 rows at the row stride). The input is rounded once per call
// (quantize_block, as everywhere) and laid out per 16 rows and block as the tile reads it. A task
// is 16 weight rows; within it, per 16 input rows, a loop over the blocks (q8_tile_sums). The
// result tile is C[weight row][input row]; the accumulators are transposed once at the end, as
// amx_rows.h's store_tile does.
//
// int4 weights stay on the panel kernel: their per-block scale makes the float work per block
// twice int8's (d[i, b] * s[j, b] for every pair), and with the nibbles unpacked per task the tiles
// were no faster than VPDPBUSD at 8-37 rows and at most 1.3x at 128.
//
// Used where the process has the tile state (enable_amx, amx_rows.h) and the CPU has AMX-INT8
// (CPUID, checked once), for N a multiple of 16 and more than kQ8FewPass input rows.

#pragma once

#include "block_q8.h"

#if defined(BLOOM_AMX)
#include <cpuid.h>

#include "amx_rows.h"
#endif

BLOOM_CPU_BEGIN

#if defined(BLOOM_AMX)

inline bool cpu_has_amx_int8() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) != 0;  // CPUID.(7,0):EDX[25]
  }();
  return has;
}

// Tiles: 0-1 and 6-7 the sums C [16 weight rows, 16 int32] of two pairs of blocks, 2-3 the weights
// A [16 rows, 32 bytes] and 4-5 the inputs B [8 groups of 4 k, 16 input rows x 4 bytes] of a pair.
// A constant in memory, as amx_rows.h explains.
inline constexpr TileConfig kQ8TileConfig = {1, 0, {}, {64, 64, 32, 32, 64, 64, 64, 64}, {16, 16, 16, 16, 8, 8, 16, 16}};

constexpr int64_t kQ8TileRows = 16;

// dv [groups of 16 rows][blocks][16]: each block's scales of 16 input rows (zeros past M), the
// vector the block's sums are multiplied by; d [M, blocks].
inline void q8_tile_scales(const float* d, int64_t M, int64_t blocks, float* dv) {
  const int64_t groups = (M + kQ8TileRows - 1) / kQ8TileRows;
  std::fill(dv, dv + groups * blocks * kQ8TileRows, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) dv[((m / kQ8TileRows) * blocks + b) * kQ8TileRows + m % kQ8TileRows] = d[m * blocks + b];
}

// acc[r] += one block's sums c [16 weight rows][16 input rows] times d (the input rows' block scales).
inline void q8_add_block(const int32_t* c, __m512 d, __m512 acc[kQ8TileRows]) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < kQ8TileRows; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * kQ8TileRows)), d, acc[r]);
}

// acc[r] (16 input rows) = the products of 16 weight rows (A at a stride of `stride` bytes) with
// input group xv (its blocks), block by block in order, before the weight rows' scales; `next`, if
// given, the next 16 weight rows, fetched into the cache meanwhile.
//
// A block's sums must be stored and read back before its float work, and a tile is free again only
// once its store is done: block after block, the tiles and the vector units would wait on each
// other. So the sums of blocks b + 2 and b + 3 are computed (tiles 6-7) while those of b and b + 1
// (tiles 0-1) are added, and the other way round. GCC pastes tile numbers into the instructions, so
// they must be literals (amx_rows.h): hence a macro, not a function, starts each pair.
inline void q8_tile_sums(const int8_t* A, int64_t stride, const uint32_t* xv, const float* dv, int64_t blocks,
                         const int8_t* next, __m512 acc[kQ8TileRows]) {
  alignas(64) int32_t c[4][kQ8TileRows * kQ8TileRows];
  constexpr int64_t B = 8 * kQ8TileRows;  // words of xv per block
  const auto scales = [&](int64_t b) { return _mm512_loadu_ps(dv + b * kQ8TileRows); };
  for (int64_t r = 0; r < kQ8TileRows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t pipelined = blocks / 4 * 4;
  int64_t b = 0;
// Blocks b and b + 1 into result tiles ca and cb (zeroed), through weight tiles 2-3 and input tiles 4-5.
#define Q8_START_PAIR(ca, cb, b)                    \
  do {                                              \
    _tile_zero(ca);                                 \
    _tile_zero(cb);                                 \
    _tile_loadd(2, A + (b) * kQ8Block, stride);     \
    _tile_loadd(4, xv + (b) * B, 64);               \
    _tile_loadd(3, A + ((b) + 1) * kQ8Block, stride); \
    _tile_loadd(5, xv + ((b) + 1) * B, 64);         \
    _tile_dpbssd(ca, 2, 4);                         \
    _tile_dpbssd(cb, 3, 5);                         \
  } while (0)
  if (pipelined > 0) Q8_START_PAIR(0, 1, 0);
  for (; b < pipelined; b += 4) {
    if (next != nullptr)  // the next 16 weight rows' same 4 blocks (128 bytes a row) into the cache
      for (int64_t r = 0; r < kQ8TileRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(next + r * stride + b * kQ8Block), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next + r * stride + b * kQ8Block + 64), _MM_HINT_T0);
      }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    Q8_START_PAIR(6, 7, b + 2);
    q8_add_block(c[0], scales(b), acc);
    q8_add_block(c[1], scales(b + 1), acc);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    if (b + 4 < pipelined) Q8_START_PAIR(0, 1, b + 4);
    q8_add_block(c[2], scales(b + 2), acc);
    q8_add_block(c[3], scales(b + 3), acc);
  }
  for (; b < blocks; ++b) {  // K / 32 not a multiple of 4: the last blocks one by one
    _tile_zero(0);
    _tile_loadd(2, A + b * kQ8Block, stride);
    _tile_loadd(4, xv + b * B, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_stored(0, c[0], 64);
    q8_add_block(c[0], scales(b), acc);
  }
#undef Q8_START_PAIR
}

// out[m0 + m, n0 + r] = acc[r][m] * s[n0 + r] + bias[n0 + r], for m < rows. Each row's sums times
// its scale are rounded as the panel kernel rounds them (in memory, so that the compiler cannot
// fuse the multiply with the bias's add).
template <typename T>
inline void q8_tile_store(const __m512 acc[kQ8TileRows], const float* scales, const T* bias, int64_t n0, int64_t m0,
                          int64_t rows, T* out, int64_t N) {
  alignas(64) float tile[kQ8TileRows * kQ8TileRows];
  for (int64_t r = 0; r < kQ8TileRows; ++r)
    _mm512_store_ps(tile + r * kQ8TileRows, _mm512_mul_ps(acc[r], _mm512_set1_ps(scales[n0 + r])));
  const Vec16 add = bias ? load16(bias + n0) : zero16();
  for (int64_t m = 0; m < rows; ++m) store_first(out + (m0 + m) * N + n0, Vec16{tile_column(tile, m)} + add, kQ8TileRows);
}

// out [M, N] of x [M, K] and int8 q [N, K] at row scales [N], as block_q8_linear defines it, on the
// tiles. The caller has checked q8_amx_ready() and N % 16 == 0.
template <typename T>
void amx_q8_linear(const T* x, int64_t M, const int8_t* q, const float* scales, int64_t N, int64_t K, const T* bias,
                   T* out) {
  const int64_t blocks = K / kQ8Block, groups = (M + kQ8TileRows - 1) / kQ8TileRows;
  std::vector<int8_t> xq(size_t(M * K));
  std::vector<float> d(size_t(M * blocks));
  block_q8_quantize(x, M, K, xq.data(), d.data());
  // The input tiles: per 16 rows, [K / 4 groups of 4 k][16 rows][4 bytes], so block b's tile is the
  // 8 groups from 8 b on (amx_rows.h's layout, 4 int8 to a word where it puts 2 bf16).
  std::vector<uint32_t> xv(size_t(groups * (K / 4) * kQ8TileRows));
  words_of_16_rows(reinterpret_cast<const uint32_t*>(xq.data()), M, K / 4, xv.data());
  std::vector<float> dv(size_t(groups * blocks * kQ8TileRows));
  q8_tile_scales(d.data(), M, blocks, dv.data());

  at::parallel_for(0, N / kQ8TileRows, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flushed;
    _tile_loadconfig(&kQ8TileConfig);
    __m512 acc[kQ8TileRows];
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t n0 = strip * kQ8TileRows;
      for (int64_t j = 0; j < groups; ++j) {
        // While the first group of input rows runs, the next strip's weight is fetched (the tiles'
        // loads wait on memory in order; the hardware's prefetch follows 16 strided rows poorly).
        const int8_t* next = j == 0 && strip + 1 < end ? q + (n0 + kQ8TileRows) * K : nullptr;
        q8_tile_sums(q + n0 * K, K, xv.data() + j * blocks * 8 * kQ8TileRows, dv.data() + j * blocks * kQ8TileRows,
                     blocks, next, acc);
        const int64_t m0 = j * kQ8TileRows;
        q8_tile_store(acc, scales, bias, n0, m0, std::min(kQ8TileRows, M - m0), out, N);
      }
    }
    _tile_release();
  });
}

inline bool q8_amx_ready() { return amx_min_rows().load() > 0 && cpu_has_amx_int8(); }

#endif  // BLOOM_AMX

BLOOM_CPU_END
