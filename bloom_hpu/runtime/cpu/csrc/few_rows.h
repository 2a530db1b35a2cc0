// Matrix products of a few rows with a large weight, at the speed of memory (bf16, fp16, fp32).
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]    x [M, K], w [N, K] (nn.Linear's layout), M small
//
// A decode step multiplies one row per sequence by every weight of the model once, so its time is
// the time to stream the weights from memory. PyTorch's bf16 kernels for such a product read well
// below the memory's bandwidth: per byte they issue more instructions (bf16 -> fp32 conversions),
// so fewer loads are in flight. Here each 64-byte load of the AVX-512 build feeds one VDPBF16PS
// (32 products into fp32 sums) directly, and the weight rows a few blocks ahead are prefetched
// explicitly, which keeps the memory busy. The fp32 version is the same loop with FMAs; it matters
// for small models, where a product is so short that PyTorch's call overhead would be most of it.
//
// Without VDPBF16PS (fp16 on either build; everything on the AVX2 build) the weights are widened
// to fp32 as they are loaded, then multiplied by FMAs. bf16 widens by integer ops alone: 16 bf16
// weights cost one load, a shift, an and and two FMAs, within what streaming them from memory
// allows. x is widened the same way, once per block of weight rows that it serves.
//
// Work is split over PyTorch's intra-op threads by blocks of 4 weight rows; for each block the x
// rows are taken a few at a time (kXRows), so a block read once from memory serves them from L1.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx_rows.h"
#include "prefetch.h"
#include "vec16.h"

BLOOM_CPU_BEGIN

// The one constraint on K, on both builds: every step of the loops below reads 64 bytes of a
// weight row (one AVX-512 register, or two AVX2 ones) and there is no tail, so K * sizeof(T) must
// be a multiple of kStepBytes (bf16, fp16: K % 32 == 0; fp32: K % 16 == 0).
constexpr int64_t kStepBytes = 64;
constexpr int kRows = 4;                  // weight rows per block
constexpr int64_t kPrefetchBytes = 8192;  // a few blocks ahead of the loads: far enough to hide the latency


// A 64-byte step of a dot product, per element type and instruction set, in `parts` parts of
// `step` elements (one register of weights each):
//   X, load_x(p)        a part of x [step elements] in registers, as dot multiplies it;
//   dot(acc, w, x)      acc += the products of w [step elements] with x, lane by lane, in fp32.
// acc is an Acc: a register of fp32 sums, whose lanes acc_sum adds.
template <typename T>
struct Lanes;

#if defined(BLOOM_ISA_AVX512)

using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
// x rows per pass over a block: bf16 and fp32, 24 sums and 6 x rows in registers, of 32, so a verify
// pass of speculation (5 or 6 tokens a row) is one pass over each block (two passes cost it about
// 10% more time than one, on a weight streamed from memory); fp16, whose x parts take two registers
// each, 16 sums and 4 rows.
template <typename T>
constexpr int kXRows = 6;
template <>
constexpr int kXRows<at::Half> = 4;

template <>
struct Lanes<at::BFloat16> {  // VDPBF16PS: 32 products of bf16 pairs per instruction
  static constexpr int64_t step = 32;
  static constexpr int parts = 1;
  using X = __m512bh;
  static X load_x(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc dot(Acc acc, const at::BFloat16* w, X x) { return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), x); }
};

template <>
struct Lanes<float> {
  static constexpr int64_t step = 16;
  static constexpr int parts = 1;
  using X = __m512;
  static X load_x(const float* p) { return _mm512_loadu_ps(p); }
  static Acc dot(Acc acc, const float* w, X x) { return _mm512_fmadd_ps(_mm512_loadu_ps(w), x, acc); }
};

template <>
struct Lanes<at::Half> {  // F16C conversions, 16 per instruction, and two FMAs per 64 bytes
  static constexpr int64_t step = 32;
  static constexpr int parts = 1;
  struct X {
    __m512 lo, hi;
  };
  static __m512 widen16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static X load_x(const at::Half* p) { return {widen16(p), widen16(p + 16)}; }
  static Acc dot(Acc acc, const at::Half* w, const X& x) {
    acc = _mm512_fmadd_ps(widen16(w), x.lo, acc);
    return _mm512_fmadd_ps(widen16(w + 16), x.hi, acc);
  }
};

#else  // BLOOM_ISA_AVX2

using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a) { return reduce_add8(a); }
// x rows per pass over a block, as many as the 16 registers hold: fp32, 12 sums and 3 x rows' parts
// (16 rows: 1.2-1.4x the speed of 2 rows a pass, which re-reads the block from L1 more often);
// bf16 and fp16, whose parts take two registers each, 8 sums and 2 rows' parts.
template <typename T>
constexpr int kXRows = 2;
template <>
constexpr int kXRows<float> = 3;

// bf16 widened by integer ops alone: 16 bf16 loaded as 8 32-bit lanes hold the even elements in
// their low halves and the odd ones in their high halves, so the even elements as fp32 are the
// lanes shifted up by 16 bits, and the odd ones the lanes with their low 16 bits cleared. Weights
// and x split alike, the products pair up as they should; the sums only add them in another order.
struct EvenOdd {
  __m256 even, odd;
};
inline EvenOdd widen_bf16(const at::BFloat16* p) {
  __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // One load for both halves: without this empty barrier GCC folds a second load of the same 32
  // bytes into the and, and the extra load slows the stream of weights.
  asm("" : "+x"(pairs));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))))};
}

template <>
struct Lanes<at::BFloat16> {
  static constexpr int64_t step = 16;
  static constexpr int parts = 2;
  using X = EvenOdd;
  static X load_x(const at::BFloat16* p) { return widen_bf16(p); }
  static Acc dot(Acc acc, const at::BFloat16* w, const X& x) {
    const EvenOdd wv = widen_bf16(w);
    return _mm256_fmadd_ps(wv.odd, x.odd, _mm256_fmadd_ps(wv.even, x.even, acc));
  }
};

template <>
struct Lanes<float> {
  static constexpr int64_t step = 8;
  static constexpr int parts = 2;
  using X = __m256;
  static X load_x(const float* p) { return _mm256_loadu_ps(p); }
  static Acc dot(Acc acc, const float* w, X x) { return _mm256_fmadd_ps(_mm256_loadu_ps(w), x, acc); }
};

template <>
struct Lanes<at::Half> {  // F16C conversions, 8 per instruction
  static constexpr int64_t step = 16;
  static constexpr int parts = 2;
  struct X {
    __m256 lo, hi;
  };
  static X load_x(const at::Half* p) { return {load8(p), load8(p + 8)}; }
  static Acc dot(Acc acc, const at::Half* w, const X& x) {
    return _mm256_fmadd_ps(load8(w + 8), x.hi, _mm256_fmadd_ps(load8(w), x.lo, acc));
  }
};

// Many input rows (a prompt, a server's batch): each pass over a block would widen its weights
// again, so from kFewRowsWidenedFrom rows on, x is widened once per call and each block of weight rows
// once, into fp32 scratch, and the passes run the fp32 loop (3 x rows a pass, not 2) over it (a
// chunk of columns at a time where x outgrows L2: wide_chunk, below). The
// scratch holds each 16-element step as the two registers Lanes<T>::dot multiplies, in its order
// (bf16: the even elements, then the odd ones; fp16: the first 8, then the next 8), so the fp32
// loop makes the very FMAs of the direct one, in the same order: the same sums, bit for bit, at
// any row count (a row's result never depends on how many rows share its call).
constexpr int64_t kFewRowsWidenedFrom = 6;

template <typename T>
inline void widen_step(const T* p, float* out);  // 16 elements -> 16 floats, in Lanes<T>::dot's order

template <>
inline void widen_step(const at::BFloat16* p, float* out) {
  const EvenOdd v = widen_bf16(p);
  _mm256_storeu_ps(out, v.even);
  _mm256_storeu_ps(out + 8, v.odd);
}

template <>
inline void widen_step(const at::Half* p, float* out) {
  _mm256_storeu_ps(out, load8(p));
  _mm256_storeu_ps(out + 8, load8(p + 8));
}

#endif

// sums[m * R + r] = dot(w row r, x row m) for R weight rows and MB input rows; the weight rows
// still to come prefetched as Prefetch (a PrefetchKind) says, as they are read.
template <typename T, int R, int MB, int Prefetch>
inline void dot_block(const T* w, const T* x, int64_t K, float* sums) {
  using L = Lanes<T>;
  static_assert(L::step * L::parts * int64_t(sizeof(T)) == kStepBytes, "a step reads 64 bytes of a weight row");
  Acc acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = acc_zero();
  for (int64_t k = 0; k < K; k += L::step * L::parts) {
    for (int r = 0; r < R; ++r)
      prefetch_weights(w + r * K + k, R * K * int64_t(sizeof(T)), kPrefetchBytes, Prefetch);
    for (int part = 0; part < L::parts; ++part) {
      const int64_t kp = k + part * L::step;
      typename L::X xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = L::load_x(x + m * K + kp);
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = L::dot(acc[r][m], w + r * K + kp, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sums[m * R + r] = acc_sum(acc[r][m]);
}

// dot_block for mb (1..MB) input rows.
template <typename T, int R, int MB, int Prefetch>
inline void dot_rows(int64_t mb, const T* w, const T* x, int64_t K, float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return dot_rows<T, R, MB - 1, Prefetch>(mb, w, x, K, sums);
  }
  dot_block<T, R, MB, Prefetch>(w, x, K, sums);
}

// The passes over one block of R weight rows w [R, K] for the M input rows x [M, K]: as few as
// kXRows allows, the rows shared evenly among them (5 rows of AVX-512: 3 + 2, not 4 + 1).
// done(m, r, sum) takes the fp32 dot of input row m and weight row r. The first pass prefetches the
// rows still to come as `prefetch` (a PrefetchKind) says; the later ones read the block from L1,
// where prefetching again would only cost issue slots.
template <typename T, int R, typename Done>
inline void block_passes(const T* w, const T* x, int64_t M, int64_t K, int prefetch, Done&& done) {
  constexpr int xr = kXRows<T>;
  float sums[R * xr];
  const int64_t passes = (M + xr - 1) / xr;
  for (int64_t p = 0, m0 = 0; p < passes; ++p) {
    const int64_t mb = (M - m0 + passes - p - 1) / (passes - p);
    if (p == 0 && prefetch == kL1Ahead)
      dot_rows<T, R, xr, kL1Ahead>(mb, w, x + m0 * K, K, sums);
    else if (p == 0 && prefetch == kL2NextBlock)
      dot_rows<T, R, xr, kL2NextBlock>(mb, w, x + m0 * K, K, sums);
    else
      dot_rows<T, R, xr, kNoPrefetch>(mb, w, x + m0 * K, K, sums);
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) done(m0 + m, r, sums[m * R + r]);
    m0 += mb;
  }
}

// Outputs n .. n+R-1 of every input row.
template <typename T, int R>
inline void output_rows(const T* w, const T* x, const T* bias, T* out, int64_t n, int64_t M, int64_t N, int64_t K,
                        int prefetch) {
  if constexpr (!std::is_same_v<T, float>) {
    // One row (a batch-1 decode step): its one pass called directly. Through block_passes' choice
    // of passes, GCC's code for it streamed the weights measurably slower (bf16 on a Zen 5: the
    // whole decode step took 1.06x as long); fp32 keeps the general path, as the shortcut there
    // slowed its 2-row products by as much. Same sums, same bits.
    if (M == 1) {
      float sums[R];
      if (prefetch == kL1Ahead)
        dot_block<T, R, 1, kL1Ahead>(w, x, K, sums);
      else if (prefetch == kL2NextBlock)
        dot_block<T, R, 1, kL2NextBlock>(w, x, K, sums);
      else
        dot_block<T, R, 1, kNoPrefetch>(w, x, K, sums);
      for (int r = 0; r < R; ++r) out[n + r] = T(sums[r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f));
      return;
    }
  }
  block_passes<T, R>(w, x, M, K, prefetch, [&](int64_t m, int r, float sum) {
    const float value = sum + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
    out[m * N + n + r] = T(value);  // bf16, fp16: rounded to nearest even once, as F.linear
  });
}

#if !defined(BLOOM_ISA_AVX512)
// Where the widened x ([M, K] fp32) outgrows L2, it is read a chunk of columns at a time (Kc of
// them: wide_chunk), x and the widened weights laid out chunk by chunk ([chunk][rows][Kc]), so that
// one chunk of x (at most kWideChunkBytes) serves a group of weight blocks from L2
// (output_group_widened) where whole rows of x were streamed again for every block of 4 weight
// rows: 128 rows of 4096 (2 MB) made bloom-560m's product of 4096 columns into 1024 1.2x slower
// than its product of 1024 into 4096, the same arithmetic.
constexpr int64_t kWideChunkBytes = 512 * 1024;

// The chunk length for M rows of K: K where x fits kWideChunkBytes, else the largest divisor of K
// that is a multiple of 32 (a widening step) and keeps a chunk of x within it (at least 256
// columns); K where there is none.
inline int64_t wide_chunk(int64_t M, int64_t K) {
  const int64_t most = std::max<int64_t>(256, kWideChunkBytes / (M * int64_t(sizeof(float))));
  if (K <= most) return K;
  for (int64_t chunks = (K + most - 1) / most; chunks <= K / 32; ++chunks)
    if (K % chunks == 0 && (K / chunks) % 32 == 0) return K / chunks;
  return K;
}

// rows [R, K] of T widened into wide [K / Kc][R][Kc] (widen_step's layout), the rows still to
// come prefetched as `prefetch` says, as they are read.
template <typename T, int R>
inline void widen_rows(const T* w, int64_t K, int64_t Kc, int prefetch, float* wide) {
  for (int64_t c0 = 0; c0 < K; c0 += Kc) {
    float* chunk = wide + c0 * R;  // [R][Kc]
    for (int64_t k = 0; k < Kc; k += 32) {  // a 64-byte step of every row
      for (int r = 0; r < R; ++r) {
        const T* step = w + r * K + c0 + k;
        prefetch_weights(step, R * K * int64_t(sizeof(T)), kPrefetchBytes, prefetch);
        widen_step(step, chunk + r * Kc + k);
        widen_step(step + 16, chunk + r * Kc + k + 16);
      }
    }
  }
}

// dot_block's fp32 loop over one chunk of columns of R weight rows w [R, Kc] and MB input rows
// x [MB, Kc], its running sums (whole vectors) taken from `carry` [MB][R] unless `first` and put
// back unless `last`, which reduces them into sums[m * R + r] as dot_block does: each lane makes
// the FMAs of one pass over whole rows, in the same order, so the sums are the same bits.
template <int R, int MB>
inline void dot_chunk(const float* w, const float* x, int64_t Kc, bool first, bool last, Acc* carry, float* sums) {
  using L = Lanes<float>;
  Acc acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = first ? acc_zero() : carry[m * R + r];
  for (int64_t k = 0; k < Kc; k += L::step * L::parts) {
    for (int part = 0; part < L::parts; ++part) {
      const int64_t kp = k + part * L::step;
      L::X xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = L::load_x(x + m * Kc + kp);
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = L::dot(acc[r][m], w + r * Kc + kp, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      if (last)
        sums[m * R + r] = acc_sum(acc[r][m]);
      else
        carry[m * R + r] = acc[r][m];
    }
}

template <int R, int MB>
inline void dot_chunk_rows(int64_t mb, const float* w, const float* x, int64_t Kc, bool first, bool last, Acc* carry,
                           float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return dot_chunk_rows<R, MB - 1>(mb, w, x, Kc, first, last, carry, sums);
  }
  dot_chunk<R, MB>(w, x, Kc, first, last, carry, sums);
}

// output_rows from fp32 scratch (x32 [K / Kc][M][Kc], widened once per call) for blocks b0 .. b1 - 1
// of R weight rows: all of them widened first (`wide` [b1 - b0][K / Kc][R][Kc]), then chunk by
// chunk every block's passes (where Kc < K, their sums carried in `carry` [b1 - b0][M][R] vectors),
// so that x's chunk c ([M][Kc]: 512 KB for 128 rows of 1024) is read from L2 by each block of the
// group where whole rows of x (2 MB for 128 rows of 4096, past L2) were streamed again for every
// block. (Its store is written out as output_rows' is: one helper shared by both made these passes
// 1.2-1.3x slower with GCC, the same bits.)
template <typename T, int R>
inline void output_group_widened(const T* w, const float* x32, const T* bias, T* out, int64_t b0, int64_t b1,
                                 int64_t M, int64_t N, int64_t K, int64_t Kc, int prefetch, float* wide, Acc* carry) {
  for (int64_t b = b0; b < b1; ++b) widen_rows<T, R>(w + b * R * K, K, Kc, prefetch, wide + (b - b0) * R * K);
  constexpr int xr = kXRows<float>;
  float sums[R * xr];
  const int64_t chunks = K / Kc, passes = (M + xr - 1) / xr;
  for (int64_t c = 0; c < chunks; ++c) {
    const bool first = c == 0, last = c == chunks - 1;
    for (int64_t b = b0; b < b1; ++b) {
      const float* block = wide + (b - b0) * R * K + c * R * Kc;
      Acc* block_carry = carry + (b - b0) * M * R;
      const int64_t n = b * R;
      for (int64_t p = 0, m0 = 0; p < passes; ++p) {
        const int64_t mb = (M - m0 + passes - p - 1) / (passes - p);  // the rows of block_passes' pass p
        dot_chunk_rows<R, xr>(mb, block, x32 + (c * M + m0) * Kc, Kc, first, last, block_carry + m0 * R, sums);
        if (last)
          for (int64_t m = 0; m < mb; ++m)
            for (int r = 0; r < R; ++r) {
              const float value = sums[m * R + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
              out[(m0 + m) * N + n + r] = T(value);
            }
        m0 += mb;
      }
    }
  }
}

constexpr int64_t kWideGroupBytes = 256 * 1024;  // widened weights of a group of blocks (L2 beside x's chunk)

template <typename T>
void linear_rows_widened(const T* x, int64_t M, const T* w, int64_t N, int64_t K, const T* bias, T* out,
                         int prefetch) {
  const int64_t Kc = wide_chunk(M, K);
  // Scratch aligned to cache lines (PyTorch's allocator), as the fp32 loop's loads expect: a
  // 32-byte load across two lines costs about twice one within a line.
  const at::Tensor x32 = at::empty({M * K}, at::kFloat);
  float* x_wide = x32.data_ptr<float>();
  for (int64_t c0 = 0; c0 < K; c0 += Kc)  // x_wide [K / Kc][M][Kc]
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < Kc; k += 16) widen_step(x + m * K + c0 + k, x_wide + c0 * M + m * Kc + k);
  const int64_t blocks = N / kRows;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * int64_t(sizeof(T))));
  const int64_t group = Kc < K ? std::max<int64_t>(1, kWideGroupBytes / (kRows * K * int64_t(sizeof(float)))) : 1;
  const int64_t carried = Kc < K ? M * kRows * int64_t(sizeof(Acc) / sizeof(float)) : 0;  // per block
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const at::Tensor wide = at::empty({group * (kRows * K + carried)}, at::kFloat);
    Acc* carry = reinterpret_cast<Acc*>(wide.data_ptr<float>() + group * kRows * K);
    for (int64_t b = begin; b < end; b += group)
      output_group_widened<T, kRows>(w, x_wide, bias, out, b, std::min(end, b + group), M, N, K, Kc, prefetch,
                                     wide.data_ptr<float>(), carry);
  });
  const at::Tensor wide = at::empty({K + carried / kRows}, at::kFloat);
  Acc* carry = reinterpret_cast<Acc*>(wide.data_ptr<float>() + K);
  for (int64_t n = blocks * kRows; n < N; ++n)  // the last rows, one at a time
    output_group_widened<T, 1>(w, x_wide, bias, out, n, n + 1, M, N, K, Kc, prefetch, wide.data_ptr<float>(), carry);
}
#endif

// out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), all contiguous; M at most a few rows; K * sizeof(T)
// a multiple of kStepBytes.
template <typename T>
void linear_rows(const T* x, int64_t M, const T* w, int64_t N, int64_t K, const T* bias, T* out) {
  const int prefetch = weight_prefetch(kFloatWeights, M);
#if !defined(BLOOM_ISA_AVX512)
  if constexpr (!std::is_same_v<T, float>) {
    if (M >= kFewRowsWidenedFrom) return linear_rows_widened(x, M, w, N, K, bias, out, prefetch);
  }
#endif
#if defined(BLOOM_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // many rows: AMX tiles (amx_rows.h), where enabled
    const int64_t min_rows = amx_min_rows().load(std::memory_order_relaxed), tiled = N / kTileRows * kTileRows;
    if (min_rows > 0 && M >= min_rows && tiled > 0) {
      amx_linear(x, M, w, tiled, K, bias, out, N);
      for (int64_t n = tiled; n < N; ++n) output_rows<T, 1>(w + n * K, x, bias, out, n, M, N, K, prefetch);
      return;
    }
  }
#endif
  const int64_t blocks = N / kRows;
  // At least ~64 KB of weights per task, so small layers are not split into tasks too short to pay.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * int64_t(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      output_rows<T, kRows>(w + b * kRows * K, x, bias, out, b * kRows, M, N, K, prefetch);
  });
  for (int64_t n = blocks * kRows; n < N; ++n) output_rows<T, 1>(w + n * K, x, bias, out, n, M, N, K, prefetch);
}

BLOOM_CPU_END
