// The operators int4_rows_linear and int4_dequantize (torch.ops.<BLOOM_OPS>.*): products of a few rows
// with a group-wise int4 weight, and the weight dequantized for products of many; the kernels, and
// the packed layout, are in int4_rows.h.

#include <torch/library.h>

#include "dtypes.h"
#include "int4_rows.h"

namespace {

// The group size of a packed weight q [N, K / 2] with scales [N, K / G], checked.
int64_t checked_group(const at::Tensor& q, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), op, ": a contiguous uint8 weight [N, K / 2]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == q.size(0) && scales.size(1) > 0,
              op, ": fp32 scales [N, groups]");
  const int64_t K = 2 * q.size(1);
  TORCH_CHECK(K % scales.size(1) == 0 && (K / scales.size(1)) % bloom_cpu::kInt4Block == 0, op,
              ": groups of a multiple of 32 weights that divide the row");
  return K / scales.size(1);
}

// x [..., K] (bf16, fp16, fp32) -> [..., N] in x's dtype.
at::Tensor int4_rows_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  const int64_t G = checked_group(q, scales, "int4_rows_linear");
  const int64_t K = 2 * q.size(1), N = q.size(0);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, "int4_rows_linear: x [..., K], q [N, K / 2]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "int4_rows_linear: bias [N] of x's dtype");
  }
  const at::Tensor x = input.contiguous();
  const int64_t M = x.numel() / K;
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, input.options());
  using namespace bloom_cpu;
  with_element_type(input.scalar_type(), "int4_rows_linear", [&](auto zero) {
    using T = decltype(zero);
    int4_linear<T>(x.data_ptr<T>(), M, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K, G,
                   has_bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
  });
  return out;
}

// out [N, K] (bf16, fp16, fp32; given, so that a caller can reuse its memory): each weight
// (v - 8) * its group's scale, rounded once.
void int4_dequantize(const at::Tensor& q, const at::Tensor& scales, at::Tensor out) {
  const int64_t G = checked_group(q, scales, "int4_dequantize");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "int4_dequantize: a contiguous out [N, K]");
  using namespace bloom_cpu;
  with_element_type(out.scalar_type(), "int4_dequantize", [&](auto zero) {
    using T = decltype(zero);
    bloom_cpu::int4_dequantize<T>(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K, G, out.data_ptr<T>());
  });
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("int4_rows_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scales, Tensor(a!) out) -> ()");
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("int4_rows_linear", &int4_rows_linear);
  m.impl("int4_dequantize", &int4_dequantize);
}
