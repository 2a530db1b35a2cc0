// The SIMD layer every kernel is written over: one vector of 16 fp32 lanes (Vec16) and its
// operations, for arrays of the model's dtype T (bf16, fp16 or fp32): loads that widen, stores that
// round as PyTorch rounds, horizontal sums, and an exp.
//
// The kernels are built once per instruction set, chosen by one macro:
//   BLOOM_ISA_AVX512: Vec16 is one __m512 (AVX512F/BW/VL, plus AVX512-BF16 for the few pieces
//                     that multiply bf16 pairs directly, guarded by the same macro where used);
//   BLOOM_ISA_AVX2:   Vec16 is two __m256 (AVX2, FMA, F16C: e.g. AMD Zen 3), no AVX-512 at all.
// Both give the same results lane by lane: the horizontal sum adds in the same tree as
// _mm512_reduce_add_ps, and exp16 scales by 2^k with the same single rounding as _mm512_scalef_ps.
//
// Every store of a T rounds like c10's conversion from fp32 (round to nearest even), so a value
// computed here is stored exactly as the op-by-op PyTorch code would store the same fp32 value.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(BLOOM_ISA_AVX512) == defined(BLOOM_ISA_AVX2)
#error "build with exactly one of -DBLOOM_ISA_AVX512 and -DBLOOM_ISA_AVX2"
#endif
#ifndef BLOOM_OPS
#error "build with -DBLOOM_OPS=<namespace of the operators>, e.g. bloom_avx512"
#endif

// Both builds can be loaded into one process, so everything with external linkage here lives in
// a namespace named after the build (bloom_cpu::bloom_avx512::exp16, ...): an inline function that
// the compiler did not inline is never shared between the two libraries' symbol tables.
#define BLOOM_CPU_BEGIN namespace bloom_cpu { inline namespace BLOOM_OPS {
#define BLOOM_CPU_END } }

// The TORCH_LIBRARY macros paste their namespace argument as a token; through these, BLOOM_OPS is
// expanded first, so the operators are torch.ops.bloom_avx512.*, torch.ops.bloom_avx2.*.
#define BLOOM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define BLOOM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define BLOOM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

BLOOM_CPU_BEGIN

template <typename T>
inline T round_to(float value) {
  return T(value);  // bf16, fp16: round to nearest even, as PyTorch stores an fp32 result
}

#if defined(BLOOM_ISA_AVX512)

struct Vec16 {
  __m512 v;
};

inline Vec16 zero16() { return {_mm512_setzero_ps()}; }
inline Vec16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec16 min16(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float reduce_add(Vec16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec16 a) { return _mm512_reduce_max_ps(a.v); }

// Lanes 0..n-1 on (n <= 16); the rest off.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 elements as fp32 (bf16 widens exactly: its bits are the top half of the fp32's).
inline Vec16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load16(const at::BFloat16* p) {
  return {_mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec16 load16(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }

// The first n (<= 16) elements as fp32, zeros in the other lanes; reads nothing past p + n.
inline Vec16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first_lanes(n), p)}; }
inline Vec16 load_first(const at::BFloat16* p, int64_t n) {
  const __m256i bits = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
inline Vec16 load_first(const at::Half* p, int64_t n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), p))}; }
// The same, with `fill` in the other lanes.
inline Vec16 load_first(const float* p, int64_t n, float fill) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p)};
}

// v's first n (<= 16) lanes, zeros in the others.
inline Vec16 keep_first(Vec16 v, int64_t n) { return {_mm512_maskz_mov_ps(first_lanes(n), v.v)}; }

// Each lane rounded to T and widened back: what storing it in T and reading it again gives.
// (NaN is left to the callers' data: scores and probabilities here are finite.)
template <typename T>
inline Vec16 round16(Vec16 v);
template <>
inline Vec16 round16<float>(Vec16 v) {
  return v;
}
template <>
inline Vec16 round16<at::BFloat16>(Vec16 v) {
  const __m512i bits = _mm512_castps_si512(v.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return {_mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))))};
}
template <>
inline Vec16 round16<at::Half>(Vec16 v) {
  return {_mm512_cvtph_ps(_mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}

// Stores 16 lanes at p, rounded to T.
inline void store16(float* p, Vec16 v) { _mm512_storeu_ps(p, v.v); }
inline void store16(at::BFloat16* p, Vec16 v) {
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16<at::BFloat16>(v).v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline void store16(at::Half* p, Vec16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Stores the first n (<= 16) lanes of v at p, rounded to T; writes nothing past p + n.
inline void store_first(float* p, Vec16 v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v.v); }
inline void store_first(at::BFloat16* p, Vec16 v, int64_t n) {
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16<at::BFloat16>(v).v), 16);
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(top));
}
inline void store_first(at::Half* p, Vec16 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Each lane rounded to the nearest integer (ties to even).
inline Vec16 round_to_integer(Vec16 v) { return {_mm512_roundscale_ps(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

// p * 2^k for integral k in [-150, 128], rounded once (denormal and infinite results included).
inline Vec16 scale_by_power_of_two(Vec16 p, Vec16 k) { return {_mm512_scalef_ps(p.v, k.v)}; }

#else  // BLOOM_ISA_AVX2

struct Vec16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};

inline Vec16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {  // a * b + c
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) {  // c - a * b
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec16 min16(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }

// The sum of 8 lanes, added pairwise in the tree _mm512_reduce_add_ps uses for its upper and lower
// halves (halves of 128 bits, then lanes 2 apart, then 1): with reduce_add below, the very same sum.
inline float reduce_add8(__m256 v) {
  const __m128 quarter = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline float reduce_add(Vec16 a) { return reduce_add8(_mm256_add_ps(a.hi, a.lo)); }
inline float reduce_max(Vec16 a) {
  const __m256 half = _mm256_max_ps(a.hi, a.lo);
  const __m128 quarter = _mm_max_ps(_mm256_extractf128_ps(half, 1), _mm256_castps256_ps128(half));
  const __m128 pairs = _mm_max_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}

// 8 elements as fp32: bf16 widens exactly (its bits are the top half of the fp32's), fp16 by F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename T>
inline Vec16 load16(const T* p) {
  return {load8(p), load8(p + 8)};
}

// The first n (<= 16) elements as fp32, zeros in the other lanes; reads nothing past p + n.
// AVX2 has no masked 16-bit loads: a short row goes through a copy on the stack (tails are rare).
template <typename T>
inline Vec16 load_first(const T* p, int64_t n) {
  if (n >= 16) return load16(p);
  T copy[16] = {};  // zero bits: 0.0 in all three dtypes
  std::memcpy(copy, p, size_t(n) * sizeof(T));
  return load16(copy);
}
// The same, with `fill` in the other lanes.
inline Vec16 load_first(const float* p, int64_t n, float fill) {
  if (n >= 16) return load16(p);
  float copy[16];
  for (int i = 0; i < 16; ++i) copy[i] = i < n ? p[i] : fill;
  return load16(copy);
}

// v's first n (<= 16) lanes, zeros in the others.
inline Vec16 keep_first(Vec16 v, int64_t n) {
  const __m256 limit = _mm256_set1_ps(float(n));
  const __m256 lo = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), limit, _CMP_LT_OQ);
  const __m256 hi = _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), limit, _CMP_LT_OQ);
  return {_mm256_and_ps(v.lo, lo), _mm256_and_ps(v.hi, hi)};
}

// 8 lanes rounded to bf16 (nearest even), still as fp32 bits.
inline __m256i round8_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_and_si256(rounded, _mm256_set1_epi32(int(0xFFFF0000u)));
}
inline __m128i to_half8(__m256 v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Each lane rounded to T and widened back: what storing it in T and reading it again gives.
// (NaN is left to the callers' data: scores and probabilities here are finite.)
template <typename T>
inline Vec16 round16(Vec16 v);
template <>
inline Vec16 round16<float>(Vec16 v) {
  return v;
}
template <>
inline Vec16 round16<at::BFloat16>(Vec16 v) {
  return {_mm256_castsi256_ps(round8_bf16_bits(v.lo)), _mm256_castsi256_ps(round8_bf16_bits(v.hi))};
}
template <>
inline Vec16 round16<at::Half>(Vec16 v) {
  return {_mm256_cvtph_ps(to_half8(v.lo)), _mm256_cvtph_ps(to_half8(v.hi))};
}

// Stores 16 lanes at p, rounded to T.
inline void store16(float* p, Vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store16(at::BFloat16* p, Vec16 v) {
  const __m256i lo = _mm256_srli_epi32(round8_bf16_bits(v.lo), 16), hi = _mm256_srli_epi32(round8_bf16_bits(v.hi), 16);
  // packus works within 128-bit halves (lo 0-3, hi 0-3, lo 4-7, hi 4-7): the permute restores the order.
  // (Values below 2^16 pass its unsigned saturation unchanged.)
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}
inline void store16(at::Half* p, Vec16 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_half8(v.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), to_half8(v.hi));
}

// Stores the first n (<= 16) lanes of v at p, rounded to T; writes nothing past p + n.
template <typename T>
inline void store_first(T* p, Vec16 v, int64_t n) {
  if (n >= 16) return store16(p, v);
  T copy[16];
  store16(copy, v);
  std::memcpy(p, copy, size_t(n) * sizeof(T));
}

inline Vec16 round_to_integer(Vec16 v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}

// p * 2^k for integral k in [-150, 128], rounded once (denormal and infinite results included), as
// _mm512_scalef_ps. 2^k itself is not a normal float at both ends of that range, so it is applied
// as 2^a * 2^b, a = floor(k / 2), b = k - a, both in [-75, 64]: p (in [0.7, 1.42] here) times 2^a
// is exact, and the one rounding is the last product's.
inline __m256 scale8(__m256 p, __m256 k) {
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i a = _mm256_srai_epi32(ki, 1), b = _mm256_sub_epi32(ki, a);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 two_a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const __m256 two_b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(p, two_a), two_b);
  // Opaque to the optimizer: a caller's `e + y` must not be contracted with this last product into
  // one FMA (GCC contracts across intrinsics), which would round differently from scalef's result.
  asm("" : "+x"(scaled));
  return scaled;
}
inline Vec16 scale_by_power_of_two(Vec16 p, Vec16 k) { return {scale8(p.lo, k.lo), scale8(p.hi, k.hi)}; }

#endif

// e^x per lane, within 1 fp32 ulp of libm's expf (measured over [-87, 89] at 3.9 million points,
// normal results): x = k ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes'
// coefficients), then scaled by 2^k. Below -104 the result is 0, as expf's is; above 88.7, +inf.
inline Vec16 exp16(Vec16 x) {
  x = max16(x, set16(-104.0f));
  x = min16(x, set16(88.8f));
  const Vec16 k = round_to_integer(x * set16(1.44269504088896341f));
  Vec16 r = fnmadd(k, set16(0.693359375f), x);  // ln 2 in two parts, exact products
  r = fnmadd(k, set16(-2.12194440e-4f), r);
  Vec16 p = set16(1.9875691500e-4f);
  p = fmadd(p, r, set16(1.3981999507e-3f));
  p = fmadd(p, r, set16(8.3334519073e-3f));
  p = fmadd(p, r, set16(4.1665795894e-2f));
  p = fmadd(p, r, set16(1.6666665459e-1f));
  p = fmadd(p, r, set16(5.0000001201e-1f));
  p = fmadd(p, r * r, r + set16(1.0f));
  return scale_by_power_of_two(p, k);
}

// A weight group of zeros keeps the smallest normal scale (quantize.py clamps it there), and its
// scale times an input block's is a denormal float, which x86 multiplies through microcode assists
// at about a hundred times the cost (a vocabulary padded with zero rows made the LM head 30x slower).
// The products' threads flush such values to zero while they run (the quantized kernels: int4_rows.h,
// block_q8.h): the result is the same, as every q of such a group is 0.
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

BLOOM_CPU_END
