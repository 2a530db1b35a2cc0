// The operators over quantized weights (torch.ops.<BLOOM_OPS>.*): int8_rows_linear and int4_rows_linear,
// products of a few rows with an int8 or a packed int4 weight, and int4_dequantize, an int4 weight as
// floats for products of many rows; block_q8_quantize and block_q8_linear, the integer products (the
// input rounded to int8 per block of 32, bloom_hpu/int8_activations.py). The kernels, and why they
// are fast, are in int8_rows.h, int4_rows.h (the int4 layout too) and block_q8.h.

#include <torch/library.h>

#include "block_q8.h"
#include "dtypes.h"
#include "int4_rows.h"
#include "int8_rows.h"

namespace {

// The output [..., N] of a product of x [..., K] (bf16, fp16, fp32) with an N-row weight, its bias
// checked: then body(T{}, x, M, bias or nullptr, out) for x's element type T.
template <typename Body>
at::Tensor rows_product(const char* op, const at::Tensor& input, int64_t N, int64_t K,
                        const std::optional<at::Tensor>& bias, Body body) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == K, op, ": x [..., K] for a weight of K columns");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->numel() == N && bias->is_contiguous(), op,
                ": bias [N] of x's dtype");
  }
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, input.options());
  bloom_cpu::with_element_type(input.scalar_type(), op, [&](auto zero) {
    using T = decltype(zero);
    body(zero, x.data_ptr<T>(), x.numel() / K, has_bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
  });
  return out;
}

// x [..., K] @ (q [N, K] int8 * scales [N])^T -> [..., N] in x's dtype.
at::Tensor int8_rows_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "int8_rows_linear: a contiguous int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == q.size(0) && scales.is_contiguous(),
              "int8_rows_linear: fp32 scales [N]");
  const int64_t K = q.size(1), N = q.size(0);
  TORCH_CHECK(K % 16 == 0, "int8_rows_linear: K must be a multiple of 16");
  return rows_product("int8_rows_linear", input, N, K, bias, [&](auto zero, const auto* x, int64_t M, const auto* b, auto* out) {
    using T = decltype(zero);
    bloom_cpu::int8_linear<T>(x, M, q.data_ptr<int8_t>(), scales.data_ptr<float>(), N, K, b, out);
  });
}

// The group size of a packed int4 weight q [N, K / 2] with scales [N, K / G], checked.
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

// x [..., K] @ dequantized(q [N, K / 2], scales [N, K / G])^T -> [..., N] in x's dtype.
at::Tensor int4_rows_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
  const int64_t G = checked_group(q, scales, "int4_rows_linear");
  const int64_t K = 2 * q.size(1), N = q.size(0);
  return rows_product("int4_rows_linear", input, N, K, bias, [&](auto zero, const auto* x, int64_t M, const auto* b, auto* out) {
    using T = decltype(zero);
    bloom_cpu::int4_linear<T>(x, M, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K, G, b, out);
  });
}

// out [N, K] (bf16, fp16, fp32; given, so that a caller can reuse its memory): each weight
// (v - 8) * its group's scale, rounded once.
void int4_dequantize(const at::Tensor& q, const at::Tensor& scales, at::Tensor out) {
  const int64_t G = checked_group(q, scales, "int4_dequantize");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "int4_dequantize: a contiguous out [N, K]");
  bloom_cpu::with_element_type(out.scalar_type(), "int4_dequantize", [&](auto zero) {
    using T = decltype(zero);
    bloom_cpu::int4_dequantize<T>(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K, G, out.data_ptr<T>());
  });
}

// (xq int8 [..., K], d fp32 [..., K / 32]) of x [..., K]: int8_activations.quantize_blocks, bit for bit.
std::tuple<at::Tensor, at::Tensor> block_q8_quantize(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1, "block_q8_quantize: x [..., K]");
  const int64_t K = input.size(-1);
  TORCH_CHECK(K > 0 && K % bloom_cpu::kQ8Block == 0, "block_q8_quantize: K must be a positive multiple of 32, not ", K);
  const at::Tensor x = input.contiguous();
  auto xq = at::empty(input.sizes(), input.options().dtype(at::kChar));
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = K / bloom_cpu::kQ8Block;
  auto d = at::empty(sizes, input.options().dtype(at::kFloat));
  bloom_cpu::with_element_type(input.scalar_type(), "block_q8_quantize", [&](auto zero) {
    using T = decltype(zero);
    bloom_cpu::block_q8_quantize<T>(x.data_ptr<T>(), x.numel() / K, K, xq.data_ptr<int8_t>(), d.data_ptr<float>());
  });
  return {xq, d};
}

// x [..., K] @ weight^T (+ bias) -> [..., N] in x's dtype, x rounded to int8 per block of 32:
// int8 q [N, K] with scales [N], or packed int4 q [N, K / 2] with scales [N, K / G].
at::Tensor block_q8_linear(const at::Tensor& input, const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias) {
  const char* op = "block_q8_linear";
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && (q.scalar_type() == at::kChar || q.scalar_type() == at::kByte), op,
              ": a contiguous int8 weight [N, K] or packed int4 weight (uint8 [N, K / 2])");
  const bool int4 = q.scalar_type() == at::kByte;
  const int64_t N = q.size(0), K = int4 ? 2 * q.size(1) : q.size(1);
  TORCH_CHECK(K > 0 && K % bloom_cpu::kQ8Block == 0, op, ": K must be a positive multiple of 32, not ", K);
  int64_t G = K;
  if (int4) {
    G = checked_group(q, scales, op);
  } else {
    TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.numel() == N && scales.is_contiguous(),
                op, ": fp32 scales [N] for an int8 weight");
  }
  return rows_product(op, input, N, K, bias, [&](auto zero, const auto* x, int64_t M, const auto* b, auto* out) {
    using T = decltype(zero);
    if (int4) {
      bloom_cpu::block_q8_linear<bloom_cpu::Q8Weight::kInt4, T>(x, M, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N,
                                                                K, G, b, out);
    } else {
      bloom_cpu::block_q8_linear<bloom_cpu::Q8Weight::kInt8, T>(
          x, M, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), scales.data_ptr<float>(), N, K, G, b, out);
    }
  });
}

// The most input rows the integer products over int8 (format 1) or int4 (2) weights multiply with
// the weight read in place, for the process; more go to the panel (block_q8.h). From kQ8FewPass
// (one pass) to kQ8FewRows; returns the count in force.
int64_t set_q8_few_rows(int64_t rows, int64_t format) {
  TORCH_CHECK(format == bloom_cpu::kInt8Weights || format == bloom_cpu::kInt4Weights,
              "set_q8_few_rows: format 1 (int8) or 2 (int4)");
  TORCH_CHECK(rows >= bloom_cpu::kQ8FewPass && rows <= bloom_cpu::kQ8FewRows, "set_q8_few_rows: rows from ",
              bloom_cpu::kQ8FewPass, " to ", bloom_cpu::kQ8FewRows, " on this build, not ", rows);
  bloom_cpu::q8_few_rows(int(format)).store(rows);
  return bloom_cpu::q8_few_rows(int(format)).load();
}

// The few-rows path's row counts on this build: [the rows of one pass, the default limit, the most].
std::vector<int64_t> q8_few_rows_bounds() {
  return {bloom_cpu::kQ8FewPass, bloom_cpu::kQ8FewRowsDefault, bloom_cpu::kQ8FewRows};
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("int8_rows_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int4_rows_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor q, Tensor scales, Tensor(a!) out) -> ()");
  m.def("block_q8_quantize(Tensor x) -> (Tensor, Tensor)");
  m.def("block_q8_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("set_q8_few_rows(int rows, int format) -> int", &set_q8_few_rows);
  m.def("q8_few_rows_bounds() -> int[]", &q8_few_rows_bounds);
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("int8_rows_linear", &int8_rows_linear);
  m.impl("int4_rows_linear", &int4_rows_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("block_q8_quantize", &block_q8_quantize);
  m.impl("block_q8_linear", &block_q8_linear);
}
