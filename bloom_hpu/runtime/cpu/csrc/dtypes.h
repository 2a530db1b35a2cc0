// The dtypes the CPU kernels serve, bf16, fp16 and fp32, and the one switch from a tensor's dtype to the
// C++ element type T every kernel is written over.

#pragma once

#include <ATen/ATen.h>

#include "vec16.h"

BLOOM_CPU_BEGIN

// body(T{}) with T = at::BFloat16, at::Half or float, after `dtype`; other dtypes: an error naming `op`.
// Call it with a generic lambda: [&](auto zero) { using T = decltype(zero); ... }.
template <typename Body>
void with_element_type(at::ScalarType dtype, const char* op, Body body) {
  if (dtype == at::kBFloat16) {
    body(at::BFloat16(0.0f));
  } else if (dtype == at::kHalf) {
    body(at::Half(0.0f));
  } else {
    TORCH_CHECK(dtype == at::kFloat, op, ": bf16, fp16 or fp32 only, not ", dtype);
    body(0.0f);
  }
}

BLOOM_CPU_END
