// 16 fp32 lanes over arrays of the model's dtype T (bf16 or fp32): loads that widen, stores that
// round as PyTorch rounds, and an exp. The attention and the decode step's GELU are built from these.
//
// Every store of a T rounds like c10's conversion from fp32 (round to nearest even), so a value
// computed here is stored exactly as the op-by-op PyTorch code would store the same fp32 value.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace bloom_cpu {

template <typename T>
inline T round_to(float value) {
  return T(value);  // bf16: round to nearest even, as PyTorch stores an fp32 result
}

// Lanes 0..n-1 on (n <= 16); the rest off. Tails of rows whose length is not a multiple of 16.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 elements as fp32 (bf16 widens exactly: its bits are the top half of the fp32's).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The first n (<= 16) elements as fp32, zeros in the other lanes; reads nothing past p + n.
inline __m512 load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline __m512 load_first(const at::BFloat16* p, int64_t n) {
  const __m256i bits = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Each lane rounded to T and widened back: what storing it in T and reading it again gives.
// (NaN is left to the callers' data: scores and probabilities here are finite.)
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}
template <>
inline __m512 round16<at::BFloat16>(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// Stores the first n (<= 16) lanes of v at p, rounded to T.
inline void store_first(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline void store_first(at::BFloat16* p, __m512 v, int64_t n) {
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16<at::BFloat16>(v)), 16);
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(top));
}

// e^x per lane, within 1 fp32 ulp of libm's expf (measured over [-87, 89] at 3.9 million points,
// normal results): x = k ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes'
// coefficients), then scaled by 2^k. Below -104 the result is 0, as expf's is; above 88.7, +inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.8f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts, exact products
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

}  // namespace bloom_cpu
