// bf16 products of many rows on AMX tiles (Xeon Sapphire Rapids and later), reading the weight in
// nn.Linear's own layout, so the few-rows kernel and this one share a single copy of every weight.
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]    x [M, K], w [N, K], bf16; fp32 sums
//
// Without AMX a product's cost grows with its rows: VDPBF16PS does 32 products per instruction, so
// at 16 rows the few-rows kernel is compute-bound at several times the time its weight takes to
// stream. One AMX instruction (TDPBF16PS) multiplies a 16x32 tile by a 32x16 one, 8192 products, so
// tens of rows cost little more than one read of the weight: the server's mixed steps, whose prompt
// tokens then ride on the decode step's read of the weights, as on a card.
//
// TDPBF16PS multiplies a tile A [16 rows, 32 bf16] by a tile B whose rows hold pairs of k
// ([16 pairs of k, 16 columns x 2]). A weight row is already an A row (16 weight rows x 32 of
// their k, loaded with the row stride), so the weight is read in place and the small input is the
// one rearranged: xv, per block of 16 input rows, xv[j][k / 2][m][k % 2] = x[16 j + m][k] (zeros
// past M). The result tile is then out transposed: C[n][m], written out with the bias, rounded once.
//
// Products over int8 and int4 weights (int8_rows.h, int4_rows.h) of 8 rows or more take the same
// tiles: each strip of 32 weight rows is widened (int8: exactly; int4: dequantized as
// int4_dequantize does it) into a per-thread bf16 buffer as the strip's turn comes, so the weight
// is read once, as quantized bytes, where the product through oneDNN first writes a bf16 copy of
// all of it; int8's row scales multiply the finished sums.
//
// The tile state belongs to each thread, and oneDNN (which PyTorch runs on the same threads) sets
// its own: every task loads this kernel's configuration first and releases the tiles when done.
// Linux gives a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), which
// enable_amx makes once.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "vec16.h"

BLOOM_CPU_BEGIN

#if defined(BLOOM_AMX)

constexpr int64_t kTileRows = 16;   // rows of every tile; fp32 columns of a result tile
constexpr int64_t kTileK = 32;      // bf16 of k per tile row: 64 bytes

// The fewest rows a bf16 product sends to AMX; 0: AMX off (the default, until enable_amx).
inline std::atomic<int64_t>& amx_min_rows() {
  static std::atomic<int64_t> rows{0};
  return rows;
}

// Asks Linux for the AMX tile state (once per process); false where it refuses (an older kernel).
inline bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// AMX for products of at least `min_rows` rows (0: off). Returns the limit now in force: 0 where
// the process was refused the tile state. The caller has checked the CPU has AMX-BF16.
inline int64_t enable_amx(int64_t min_rows) {
  const int64_t rows = min_rows > 0 && amx_permitted() ? min_rows : 0;
  amx_min_rows().store(rows);
  return rows;
}

// The tile configuration (palette 1; tiles 0-7 all 16 rows of 64 bytes), a constant in memory. Built
// on the stack, its rows and column widths can be lost: GCC 12's _tile_loadconfig tells the compiler
// it reads only the first 8 bytes, and in a small test program at -O2 GCC kept the zeroing and the
// palette byte and dropped the other stores, so the tiles were left unconfigured.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {kTileRows, kTileRows, kTileRows, kTileRows,
                                                 kTileRows, kTileRows, kTileRows, kTileRows}};

inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }

// rows [M, words] of 32-bit words -> ceil(M / 16) blocks of [words, 16] (zeros past M): the operand
// layout of a tile of 16 input rows, each 64-byte row of a block one gather of a word from 16 rows.
inline void words_of_16_rows(const uint32_t* rows, int64_t M, int64_t words, uint32_t* out) {
  const int64_t blocks = (M + kTileRows - 1) / kTileRows;
  const __m512i row_starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(int(words)));
  for (int64_t j = 0; j < blocks; ++j) {
    const int* first = reinterpret_cast<const int*>(rows + j * kTileRows * words);
    const __mmask16 present = __mmask16((1u << std::min(kTileRows, M - j * kTileRows)) - 1);  // 0xFFFF when 16
    uint32_t* block = out + j * words * kTileRows;
    for (int64_t w = 0; w < words; ++w)
      _mm512_storeu_si512(block + w * kTileRows,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, row_starts, first + w, 4));
  }
}

// x [M, K] -> xv (see above), ceil(M / 16) blocks of [K / 2, 16, 2]: a pair of bf16 moves as one word.
inline void pair_inputs(const at::BFloat16* x, int64_t M, int64_t K, uint32_t* xv) {
  words_of_16_rows(reinterpret_cast<const uint32_t*>(x), M, K / 2, xv);
}

// Input row m's 16 sums in a result tile [16 weight rows][16 input rows] of fp32: its column m.
inline __m512 tile_column(const float* tile, int64_t m) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int(kTileRows)));
  return _mm512_i32gather_ps(column, tile + m, 4);
}

// out[m0 + m, n0 + r] = tile[r][m] (* scales[n0 + r]) + bias[n0 + r] for m < rows, rounded once to
// bf16: each input row's 16 sums are a column of the tile, gathered into one register.
inline void store_tile(const float* tile, const float* scales, const at::BFloat16* bias, int64_t n0, int64_t m0,
                       int64_t rows, at::BFloat16* out, int64_t ld) {
  __m512 add = _mm512_setzero_ps();
  if (bias)
    add = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0))), 16));
  const __m512 scale = scales ? _mm512_loadu_ps(scales + n0) : _mm512_set1_ps(1.0f);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 sums = _mm512_fmadd_ps(tile_column(tile, m), scale, add);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * ld + n0), (__m256i)_mm512_cvtneps_pbh(sums));
  }
}

// One grid of result tiles: c[a][b] [16 weight rows][16 input rows] = weight block a (rows
// 16 a .. of w [NA * 16, K]) x input block b (xv's blocks b = 0 .. NB - 1), NA and NB 1 or 2. Tiles:
// results 0-3 (2 a + b), weights 4-5, inputs 6-7: every tile loaded serves two products, as in
// oneDNN's own AMX kernels, and a load never waits on the product before it. No software
// prefetch: the hardware's follows the 32 rows of a strip, and explicit prefetches only compete
// with it for the load slots the tiles need. GCC's tile intrinsics
// paste their tile numbers into the instruction as written, so each must be a literal: hence the
// lines below, one per tile, not loops.
template <int NA, int NB>
inline void tile_grid(const at::BFloat16* w, int64_t K, const uint32_t* xv, float* c) {
  const int64_t stride = K * int64_t(sizeof(at::BFloat16)), block = (K / 2) * kTileRows;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NA > 1) _tile_zero(2);
  if constexpr (NA > 1 && NB > 1) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {
    const uint32_t* inputs = xv + (k / 2) * kTileRows;  // 16 pairs of k of each input row, 64 bytes each
    _tile_loadd(4, w + k, stride);  // 16 weight rows, 32 of their k
    if constexpr (NA > 1) _tile_loadd(5, w + kTileRows * K + k, stride);
    _tile_loadd(6, inputs, 64);
    if constexpr (NB > 1) _tile_loadd(7, inputs + block, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NA > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NA > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t T = kTileRows * kTileRows;
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + T, 64);
  if constexpr (NA > 1) _tile_stored(2, c + 2 * T, 64);
  if constexpr (NA > 1 && NB > 1) _tile_stored(3, c + 3 * T, 64);
}

inline void tile_grid_of(int64_t na, int64_t nb, const at::BFloat16* w, int64_t K, const uint32_t* xv, float* c) {
  if (na == 2 && nb == 2) return tile_grid<2, 2>(w, K, xv, c);
  if (na == 2) return tile_grid<2, 1>(w, K, xv, c);
  if (nb == 2) return tile_grid<1, 2>(w, K, xv, c);
  tile_grid<1, 1>(w, K, xv, c);
}

// out [M, N] (row stride `ld`) = x [M, K] @ w [N, K]^T (* scales [N]) (+ bias), for N a multiple of
// 16 and K of 32, where strip_of(n0, rows, scratch) gives weight rows n0 .. n0 + rows - 1 ([rows, K]
// bf16): in place for a bf16 weight, or written into `scratch` (room for 2 * 16 rows) for a
// quantized one, which is then widened a strip at a time, in the cache, never whole.
template <typename StripOf>
inline void amx_products(const at::BFloat16* x, int64_t M, int64_t N, int64_t K, StripOf strip_of, bool scratch,
                         const float* scales, const at::BFloat16* bias, at::BFloat16* out, int64_t ld) {
  // The inputs, rearranged once on the calling thread, in a buffer it keeps (a few hundred KB at
  // most: a fresh one per product would cost more in page faults than the rearranging).
  thread_local std::vector<uint32_t> paired;
  const int64_t blocks = (M + kTileRows - 1) / kTileRows;
  paired.resize(blocks * kTileRows * (K / 2));
  pair_inputs(x, M, K, paired.data());
  const uint32_t* xv = paired.data();
  // Tasks of 32 weight rows (a strip): each strip streams from memory once and then serves every
  // pair of input blocks from the cache (a strip is at most 256 KB for K = 4096).
  const int64_t strips = (N / kTileRows + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (2 * kTileRows * K * int64_t(sizeof(at::BFloat16))));
  at::parallel_for(0, strips, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[4 * kTileRows * kTileRows];
    std::vector<at::BFloat16> widened(scratch ? size_t(2 * kTileRows * K) : 0);
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t n0 = strip * 2 * kTileRows, na = std::min<int64_t>(2, (N - n0) / kTileRows);
      const at::BFloat16* w = strip_of(n0, na * kTileRows, widened.data());
      for (int64_t j0 = 0; j0 < blocks; j0 += 2) {
        const int64_t nb = std::min<int64_t>(2, blocks - j0);
        tile_grid_of(na, nb, w, K, xv + j0 * (K / 2) * kTileRows, c);
        for (int64_t a = 0; a < na; ++a)
          for (int64_t b = 0; b < nb; ++b) {
            const int64_t m0 = (j0 + b) * kTileRows, rows = std::min(kTileRows, M - m0);
            store_tile(c + (2 * a + b) * kTileRows * kTileRows, scales, bias, n0 + a * kTileRows, m0, rows, out, ld);
          }
      }
    }
    _tile_release();
  });
}

inline void amx_linear(const at::BFloat16* x, int64_t M, const at::BFloat16* w, int64_t N, int64_t K,
                       const at::BFloat16* bias, at::BFloat16* out, int64_t ld) {
  amx_products(x, M, N, K, [&](int64_t n0, int64_t, at::BFloat16*) { return w + n0 * K; }, false, nullptr, bias, out,
               ld);
}

// The fewest rows a product over a quantized weight sends to the tiles: below, the quantized
// kernels' own loops, which widen each weight once into vector registers, keep up with them.
constexpr int64_t kAmxQuantizedMinRows = 8;

inline bool amx_takes_quantized(int64_t M, int64_t N, int64_t K) {
  const int64_t min_rows = amx_min_rows().load(std::memory_order_relaxed);
  return min_rows > 0 && M >= std::max(min_rows, kAmxQuantizedMinRows) && N % kTileRows == 0 && K % kTileK == 0;
}

#endif  // BLOOM_AMX

BLOOM_CPU_END
