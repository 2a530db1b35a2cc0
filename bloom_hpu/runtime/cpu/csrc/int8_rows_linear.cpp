// The operator int8_rows_linear (torch.ops.<BLOOM_OPS>.int8_rows_linear): products of a few rows with
// an int8 weight; the kernel, and why it is fast, is in int8_rows.h.

#include <torch/library.h>

#include "dtypes.h"
#include "int8_rows.h"


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
  const at::Tensor x = input.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, input.options());
  using namespace bloom_cpu;
  with_element_type(input.scalar_type(), "int8_rows_linear", [&](auto zero) {
    using T = decltype(zero);
    int8_linear<T>(x.data_ptr<T>(), M, q.data_ptr<int8_t>(), scales.data_ptr<float>(), N, K,
                   has_bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
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
