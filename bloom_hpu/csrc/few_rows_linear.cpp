// Matrix products of a few rows with a large weight, at the speed of memory (bf16 and fp32).
//
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]    x [M, K], w [N, K] (nn.Linear's layout), M small
//
// A decode step multiplies one row per sequence by every weight of the model once, so its time is
// the time to stream the weights from memory. On a Xeon with AVX512-BF16, PyTorch's bf16 kernels
// for a [1, 1024] x [1024, 250880] product read 12-15 GB/s where a plain reduction reads 25: per
// byte they issue more instructions (bf16 -> fp32 conversions), so fewer loads are in flight. Here
// each 64-byte load feeds one VDPBF16PS (32 products into fp32 sums) directly, and the weight rows
// a few blocks ahead are prefetched explicitly, which keeps the memory busy: ~26 GB/s on the same
// machine. The fp32 version is the same loop with FMAs; it matters for small models, where a
// product is a few microseconds and PyTorch's call overhead (~10 us) was most of it.
//
// Work is split over PyTorch's intra-op threads by blocks of 4 weight rows; for each block the x
// rows are taken 4 at a time, so a block read once from memory serves up to 4 rows from L1.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRows = 4;                  // weight rows per block
constexpr int64_t kPrefetchBytes = 8192;  // a few blocks ahead of the loads (measured: 4-16 KB alike)

// One 64-byte step of a dot product, per element type: `step` elements per load, fp32 sums.
template <typename T> struct Lanes;

template <> struct Lanes<at::BFloat16> {
  static constexpr int step = 32;
  using Vec = __m512bh;
  static Vec load(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};

template <> struct Lanes<float> {
  static constexpr int step = 16;
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

// sums[m * R + r] = dot(w row r, x row m) for R weight rows and MB input rows.
template <typename T, int R, int MB>
inline void dot_block(const T* w, const T* x, int64_t K, float* sums) {
  using L = Lanes<T>;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(T);
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += L::step) {
    typename L::Vec xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = L::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + ahead), _MM_HINT_T0);
      typename L::Vec wv = L::load(w + r * K + k);
      for (int m = 0; m < MB; ++m) acc[r][m] = L::dot(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) sums[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Outputs n .. n+R-1 of every input row.
template <typename T, int R>
inline void output_rows(const T* w, const T* x, const T* bias, T* out, int64_t n, int64_t M, int64_t N, int64_t K) {
  float sums[R * 4];
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mb = std::min<int64_t>(4, M - m0);
    const T* xm = x + m0 * K;
    switch (mb) {
      case 4: dot_block<T, R, 4>(w, xm, K, sums); break;
      case 3: dot_block<T, R, 3>(w, xm, K, sums); break;
      case 2: dot_block<T, R, 2>(w, xm, K, sums); break;
      default: dot_block<T, R, 1>(w, xm, K, sums); break;
    }
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        float value = sums[m * R + r] + (bias ? static_cast<float>(bias[n + r]) : 0.0f);
        out[(m0 + m) * N + n + r] = T(value);  // bf16: rounded to nearest even once, as F.linear
      }
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& out) {
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t blocks = N / kRows;
  // At least ~64 KB of weights per task, so small layers are not split into tasks too short to pay.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kRows * K * int64_t(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) output_rows<T, kRows>(wp + b * kRows * K, xp, bias, op, b * kRows, M, N, K);
  });
  for (int64_t n = blocks * kRows; n < N; ++n) output_rows<T, 1>(wp + n * K, xp, bias, op, n, M, N, K);
}

// x [..., K] (any leading shape, made contiguous if it is not) -> [..., N]: callers pass decode's
// [B, 1, K] as it is, since every Python-side reshape costs microseconds on small models.
at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 1 && w.dim() == 2 && input.size(-1) == w.size(1), "few_rows_linear: x [..., K], w [N, K]");
  TORCH_CHECK(input.scalar_type() == w.scalar_type(), "few_rows_linear: x and w of one dtype");
  TORCH_CHECK(w.is_contiguous(), "few_rows_linear: contiguous weight only");
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || input.scalar_type() == at::kFloat, "few_rows_linear: bf16 or fp32 only");
  TORCH_CHECK(w.size(1) % (bf16 ? 32 : 16) == 0, "few_rows_linear: K must be a multiple of 64 bytes");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->numel() == w.size(0) && bias->is_contiguous(),
                "few_rows_linear: bias [N] of x's dtype");
  }
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = w.size(0);
  auto out = at::empty(sizes, x.options());
  if (bf16) {
    run<at::BFloat16>(x, w, has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, out);
  } else {
    run<float>(x, w, has_bias ? bias->data_ptr<float>() : nullptr, out);
  }
  return out;
}

}  // namespace

// An operator (torch.ops.bloom_cpu.few_rows_linear), not a Python function, so torch.compile can
// keep it in a graph as an external kernel; its shape function is registered from Python.
TORCH_LIBRARY(bloom_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(bloom_cpu, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
