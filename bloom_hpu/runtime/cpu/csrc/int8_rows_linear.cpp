// The operator int8_rows_linear: products of a few rows with an int8 weight (weight-only int8,
// bloom_hpu/quantize.py), at the speed of reading int8 bytes.
//
// out[m, n] = scales[n] * sum_k x[m, k] * q[n, k] + bias[n]    x [M, K], q [N, K] int8, M small
//
// A decode step's time is the time to stream the weights; int8 halves their bytes against bf16.
// Each 16 int8 weights are loaded as 16 bytes, widened to 16 fp32 (sign extension, conversion) and
// multiplied into fp32 sums by one FMA per input row; the row's scale multiplies the finished sum
// once. The inputs are widened to fp32 once per call (a few rows: a few KB). Weight rows are taken
// four at a time and prefetched a few KB ahead, as in few_rows.h; work is split over PyTorch's
// intra-op threads by blocks of rows. K must be a multiple of 16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "dtypes.h"
#include "vec16.h"

BLOOM_CPU_BEGIN

// 16 int8 weights as fp32.
#if defined(BLOOM_ISA_AVX512)
inline Vec16 load16_int8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
constexpr int kInt8XRows = 2;  // input rows per pass over a block (4 measured no faster)
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

// sums[m * R + r] = dot(q row r, x row m) for R weight rows and MB fp32 input rows.
template <int R, int MB>
inline void int8_block(const int8_t* q, const float* x, int64_t K, float* sums) {
  Vec16 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = zero16();
  for (int64_t k = 0; k < K; k += 16) {
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(q + r * K + k + kInt8PrefetchBytes), _MM_HINT_T0);
    Vec16 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load16(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec16 w = load16_int8(q + r * K + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = fmadd(w, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sums[m * R + r] = reduce_add(acc[r][m]);
}

template <int R, int MB>
inline void int8_rows(int64_t mb, const int8_t* q, const float* x, int64_t K, float* sums) {
  if constexpr (MB > 1) {
    if (mb < MB) return int8_rows<R, MB - 1>(mb, q, x, K, sums);
  }
  int8_block<R, MB>(q, x, K, sums);
}

template <typename T, int R>
inline void int8_outputs(const int8_t* q, const float* scales, const float* x, const T* bias, T* out, int64_t n,
                         int64_t M, int64_t N, int64_t K) {
  float sums[R * kInt8XRows];
  for (int64_t m0 = 0; m0 < M; m0 += kInt8XRows) {
    const int64_t mb = std::min<int64_t>(kInt8XRows, M - m0);
    int8_rows<R, kInt8XRows>(mb, q, x + m0 * K, K, sums);
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        const float value = sums[m * R + r] * scales[n + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
        out[(m0 + m) * N + n + r] = T(value);
      }
  }
}

BLOOM_CPU_END

namespace {

// x [..., K] (bf16, fp16, fp32) -> [..., N] in x's dtype.
at::Tensor int8_rows_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 1 && q.dim() == 2 && input.size(-1) == q.size(1), "int8_rows_linear: x [..., K], q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_rows_linear: a contiguous int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == q.size(0) && scales.is_contiguous(),
              "int8_rows_linear: fp32 scales [N]");
  const int64_t K = q.size(1), N = q.size(0);
  TORCH_CHECK(K % 16 == 0, "int8_rows_linear: K must be a multiple of 16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "int8_rows_linear: bias [N] of x's dtype");
  }
  const at::Tensor x = input.to(at::kFloat).contiguous();  // a few rows, widened once
  const int64_t M = x.numel() / K;
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, input.options());
  using namespace bloom_cpu;
  with_element_type(input.scalar_type(), "int8_rows_linear", [&](auto zero) {
    using T = decltype(zero);
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = scales.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    const T* bp = has_bias ? bias->data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    const int64_t blocks = N / kInt8Rows;
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kInt8Rows * K));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        int8_outputs<T, kInt8Rows>(qp + b * kInt8Rows * K, sp, xp, bp, op, b * kInt8Rows, M, N, K);
    });
    for (int64_t n = blocks * kInt8Rows; n < N; ++n) int8_outputs<T, 1>(qp + n * K, sp, xp, bp, op, n, M, N, K);
  });
  return out;
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("int8_rows_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("int8_rows_linear", &int8_rows_linear);
}
