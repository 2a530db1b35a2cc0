// Matrix products of a few bf16 rows with a large bf16 weight, at the speed of memory.
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]    x [M, K], w [N, K] (nn.Linear's layout), M small
//
// A decode step multiplies one row per sequence by every weight of the model once, so its time is
// the time to stream the weights from memory. On a Xeon with AVX512-BF16, PyTorch's bf16 kernels
// for a [1, 1024] x [1024, 250880] product read 12-15 GB/s where a plain reduction reads 25: per
// byte they issue more instructions (bf16 -> fp32 conversions), so fewer loads are in flight. Here
// each 64-byte load feeds VDPBF16PS directly (32 products, fp32 sums) and the weight rows a few
// blocks ahead are prefetched explicitly, which keeps the memory busy: ~26 GB/s on the same machine.
//
// Work is split over PyTorch's intra-op threads by blocks of 4 weight rows; for each block the x
// rows are taken 4 at a time, so a block read once from memory serves up to 4 rows from L1.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRows = 4;                // weight rows per block
#ifndef BLOOM_PREFETCH_AHEAD
#define BLOOM_PREFETCH_AHEAD 4096
#endif
constexpr int64_t kPrefetchAhead = BLOOM_PREFETCH_AHEAD;  // elements: 8 KB, a few blocks ahead of the loads

// acc[r][m] = dot(w row r, x row m) for R weight rows and MB input rows; K a multiple of 32.
template <int R, int MB>
inline void dot_block(const at::BFloat16* w, const at::BFloat16* x, int64_t K, float* sums) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + kPrefetchAhead), _MM_HINT_T0);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Rows n .. n+R-1 of the output for every input row.
template <int R>
inline void output_rows(const at::BFloat16* w, const at::BFloat16* x, const at::BFloat16* bias,
                        at::BFloat16* out, int64_t n, int64_t M, int64_t N, int64_t K) {
  float sums[R * 4];
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mb = std::min<int64_t>(4, M - m0);
    const at::BFloat16* xm = x + m0 * K;
    switch (mb) {
      case 4: dot_block<R, 4>(w, xm, K, sums); break;
      case 3: dot_block<R, 3>(w, xm, K, sums); break;
      case 2: dot_block<R, 2>(w, xm, K, sums); break;
      default: dot_block<R, 1>(w, xm, K, sums); break;
    }
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        float value = sums[m * R + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
        out[(m0 + m) * N + n + r] = at::BFloat16(value);  // round to nearest even, as F.linear
      }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_linear: contiguous inputs only");
  TORCH_CHECK(w.size(1) % 32 == 0, "bf16_linear: K must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "bf16_linear: bias [N] bf16");
    bp = bias->data_ptr<at::BFloat16>();
  }
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = N / kRows;
  // At least ~64 KB of weights per task, so small layers are not split into tasks too short to pay.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) output_rows<kRows>(wp + b * kRows * K, xp, bp, op, b * kRows, M, N, K);
  });
  for (int64_t n = blocks * kRows; n < N; ++n) output_rows<1>(wp + n * K, xp, bp, op, n, M, N, K);
  return out;
}

}  // namespace

// An operator (torch.ops.bloom_cpu.few_rows_linear), not a Python function, so torch.compile can
// keep it in a graph as an external kernel; its shape function is registered from Python.
TORCH_LIBRARY(bloom_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(bloom_cpu, CPU, m) {
  m.impl("few_rows_linear", &linear);
}
