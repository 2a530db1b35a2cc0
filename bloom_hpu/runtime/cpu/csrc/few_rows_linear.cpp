// The operator few_rows_linear (torch.ops.<BLOOM_OPS>.few_rows_linear, BLOOM_OPS naming the build:
// bloom_avx512 or bloom_avx2): products of a few rows with a large weight (the kernel itself, and
// why it is fast, is in few_rows.h).

#include <torch/library.h>

#include "dtypes.h"
#include "few_rows.h"

namespace {

using bloom_cpu::linear_rows;

// x [..., K] (any leading shape, made contiguous if it is not) -> [..., N]: callers pass decode's
// [B, 1, K] as it is, since every Python-side reshape costs microseconds on small models.
at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 1 && w.dim() == 2 && input.size(-1) == w.size(1), "few_rows_linear: x [..., K], w [N, K]");
  TORCH_CHECK(input.scalar_type() == w.scalar_type(), "few_rows_linear: x and w of one dtype");
  TORCH_CHECK(w.is_contiguous(), "few_rows_linear: contiguous weight only");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() && bias->numel() == w.size(0) && bias->is_contiguous(),
                "few_rows_linear: bias [N] of x's dtype");
  }
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = w.size(0);
  auto out = at::empty(sizes, x.options());
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  bloom_cpu::with_element_type(x.scalar_type(), "few_rows_linear", [&](auto zero) {
    using T = decltype(zero);
    static_assert(bloom_cpu::kStepBytes == 64, "the message below");
    TORCH_CHECK(K * int64_t(sizeof(T)) % bloom_cpu::kStepBytes == 0, "few_rows_linear: K must be a multiple of 64 bytes");
    linear_rows<T>(x.data_ptr<T>(), M, w.data_ptr<T>(), N, K, has_bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>());
  });
  return out;
}

// AMX tiles for bf16 products of at least `min_rows` rows (0: never); returns the limit in force,
// 0 where this build or this process cannot use them (amx_rows.h). The caller checks the CPU.
int64_t enable_amx(int64_t min_rows) {
#if defined(BLOOM_AMX)
  return bloom_cpu::enable_amx(min_rows);
#else
  return 0;
#endif
}

// How the few-rows products over one weight format (prefetch.h's WeightFormat: 0 bf16/fp16/fp32,
// 1 int8, 2 int4) of from_rows input rows or more prefetch the weight rows still to come, for the
// process (PrefetchKind: 0 not at all, 1 into L1 along the rows, 2 into L2 the next block; from_rows
// 1 sets every row count, and a later call for more rows overrides those); returns the kind in
// force at from_rows.
int64_t set_prefetch(int64_t kind, int64_t format, int64_t from_rows) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "set_prefetch: kind 0, 1 or 2");
  TORCH_CHECK(format >= 0 && format < bloom_cpu::kWeightFormats, "set_prefetch: format 0, 1 or 2");
  TORCH_CHECK(from_rows >= 1, "set_prefetch: from_rows 1 or more");
  for (int c = bloom_cpu::row_class(from_rows); c < bloom_cpu::kRowClasses; ++c)
    bloom_cpu::prefetch_kind(int(format), c).store(int(kind));
  return bloom_cpu::weight_prefetch(int(format), from_rows);
}

// The kind in force for products of `rows` input rows over `format` weights.
int64_t prefetch_in_force(int64_t format, int64_t rows) {
  TORCH_CHECK(format >= 0 && format < bloom_cpu::kWeightFormats, "prefetch_in_force: format 0, 1 or 2");
  TORCH_CHECK(rows >= 1, "prefetch_in_force: rows 1 or more");
  return bloom_cpu::weight_prefetch(int(format), rows);
}

// The first input row count of each row class the prefetch is set by (prefetch.h).
std::vector<int64_t> prefetch_row_classes() {
  return std::vector<int64_t>(bloom_cpu::kRowClassStart, bloom_cpu::kRowClassStart + bloom_cpu::kRowClasses);
}

}  // namespace

// An operator, not a Python function, so torch.compile can keep it in a graph as an external kernel;
// its shape function is registered from Python. This file defines the library; the other two add to it.
BLOOM_LIBRARY(BLOOM_OPS, m) {
  m.def("few_rows_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("enable_amx(int min_rows) -> int", &enable_amx);
  m.def("set_prefetch(int kind, int format, int from_rows=1) -> int", &set_prefetch);
  m.def("prefetch_in_force(int format, int rows) -> int", &prefetch_in_force);
  m.def("prefetch_row_classes() -> int[]", &prefetch_row_classes);
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
