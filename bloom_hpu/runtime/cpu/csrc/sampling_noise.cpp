// The operator counter_uniform (torch.ops.<BLOOM_OPS>.counter_uniform): the uniform noise of sampled
// search, generation/search/sampling.py's `uniform`, in one pass.
//
// That function defines the noise: for row r and column c, bits = mix(base[r] ^ mix(c)) (`_mix`,
// integer rounds that stay below 2**31), and u = ((bits >> 8) + 0.5) * 2**-23 in float32. Written
// as PyTorch operations it makes some forty passes over an int64 [rows, vocabulary] tensor, at
// every sampled token: for BLOOM's vocabulary that costs more than the decode step itself.
// Here each value is computed once in registers (the same integer operations on uint32, which hold
// every intermediate exactly, and the same exact float conversion), so the result is bit-identical;
// sampling.py checks that before it uses this operator.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "dtypes.h"

namespace {

constexpr uint32_t kMult = 0x6B43;  // sampling.py's _MULT
constexpr int64_t kColumns = 2048;  // columns per task: their mixed indices stay in L1 for every row

// sampling.py's _mul: hi * M < 2**30 and lo * M < 2**31, so uint32 products are exact.
inline uint32_t multiply(uint32_t x) {
  const uint32_t hi = x >> 16, lo = x & 0xFFFF;
  return (((hi * kMult) & 0x7FFF) << 16) ^ (lo * kMult);
}

// sampling.py's _mix.
inline uint32_t mix(uint32_t x) {
  for (int round = 0; round < 4; ++round) {
    x ^= x >> 15;
    x = multiply(x);
  }
  return x ^ (x >> 16);
}

// base [R] int64 (sampling.py's per-row base, each in [0, 2**31)) -> [R, n] float32.
at::Tensor counter_uniform(const at::Tensor& base, int64_t n) {
  TORCH_CHECK(base.dim() == 1 && base.scalar_type() == at::kLong, "counter_uniform: base [R] int64");
  TORCH_CHECK(n >= 0 && n < (int64_t(1) << 31), "counter_uniform: n in [0, 2**31)");
  const at::Tensor bases = base.contiguous();
  TORCH_CHECK(bases.numel() == 0 || (bases.min().item<int64_t>() >= 0 && bases.max().item<int64_t>() < (int64_t(1) << 31)),
              "counter_uniform: base values in [0, 2**31)");
  const int64_t rows = bases.size(0);
  auto out = at::empty({rows, n}, bases.options().dtype(at::kFloat));
  const int64_t* b = bases.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t tasks = (n + kColumns - 1) / kColumns;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    uint32_t columns[kColumns];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c0 = task * kColumns, count = std::min(kColumns, n - c0);
      for (int64_t c = 0; c < count; ++c) columns[c] = mix(uint32_t(c0 + c));
      for (int64_t r = 0; r < rows; ++r) {
        const uint32_t row = uint32_t(b[r]);
        float* dst = o + r * n + c0;
        for (int64_t c = 0; c < count; ++c) {
          const int32_t top = int32_t(mix(row ^ columns[c]) >> 8);  // < 2**23: exact in float32
          dst[c] = (float(top) + 0.5f) * (1.0f / 8388608.0f);
        }
      }
    }
  });
  return out;
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("counter_uniform(Tensor base, int n) -> Tensor");
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("counter_uniform", &counter_uniform);
}
