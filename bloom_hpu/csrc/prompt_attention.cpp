// A prefill's attention in one call (CPU, bf16 or fp32): every position of right-padded prompts
// writes its key and value to the cache and attends, straight from the query_key_value output.
//
// Op by op (model.py, Attention.prefill) the same attention is a dozen PyTorch calls per block:
// head split and layout copies, a [B*H, P, P] score tensor, a masked copy of it, an fp32 softmax,
// a bf16 copy of that, a product and another layout copy. Here each (row, head) is one task that
// reads its queries, keys and values where the product left them, with the same roundings
// (attention.h). With every position real that is no faster (a 128-token bloom-560m prefill: 573
// against 582 ms, docs/performance.md): one dot, one exp and two roundings per (query, key) pair,
// where oneDNN vectorises across keys. What it saves is the work of pad positions (below).
//
// Masking: a query at slot i of a row with `length` real tokens sees the keys at slots <= i. A pad
// query (i >= length) gets zeros: its output is never used for a real token (real queries never
// see pad keys, and decode overwrites a pad slot before attending it), so with prompts padded to
// a static length the attention costs what the real tokens need. (The op-by-op prefill lets pad
// queries attend every real key instead; either way their outputs stay finite.)

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "attention.h"

namespace {

// qkv [B, P, H * 3 * D] (per head [q, k, v]); keys/values: this layer's [B, H, K, D], slots
// 0..P-1 written here; alibi [B * H, 1, K]; lengths [B]. out [B, Q, H * D], Q = P, or 1 with
// last_only (each row's last real token: the last block of a prefill for generation).
template <typename T>
void run(const T* qkv, const int64_t* lengths, T* keys, T* values, const T* alibi, int64_t B, int64_t P, int64_t H,
         int64_t K, int64_t D, bool last_only, T* out) {
  const float inv_norm = 1.0f / std::sqrt(float(D));
  const int64_t Q = last_only ? 1 : P;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(P), context(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, length = lengths[b];
      T* k_cache = keys + bh * K * D;
      T* v_cache = values + bh * K * D;
      const T* head = qkv + b * P * H * 3 * D + h * 3 * D;  // position i's [q, k, v] at head + i * H * 3 * D
      for (int64_t i = 0; i < P; ++i) {
        const T* qi = head + i * H * 3 * D;
        std::copy(qi + D, qi + 2 * D, k_cache + i * D);
        std::copy(qi + 2 * D, qi + 3 * D, v_cache + i * D);
      }
      for (int64_t n = 0; n < Q; ++n) {
        const int64_t i = last_only ? length - 1 : n;
        T* o = out + (b * Q + n) * H * D + h * D;
        if (i >= length) {  // a pad query: zeros (finite, like the op-by-op output; never used)
          std::fill(o, o + D, T(0.0f));
          continue;
        }
        bloom_cpu::attend_one<T>(head + i * H * 3 * D, k_cache, v_cache, alibi + bh * K, i + 1, D, inv_norm,
                                 scratch.data(), context.data(), o);
      }
    }
  });
}

at::Tensor prompt_attention(const at::Tensor& qkv_in, const at::Tensor& lengths_in, at::Tensor keys, at::Tensor values,
                            const at::Tensor& alibi, bool last_only) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(),
              "prompt_attention: contiguous keys/values [B, H, K, D] (one layer of the cache)");
  const int64_t B = keys.size(0), H = keys.size(1), K = keys.size(2), D = keys.size(3);
  TORCH_CHECK(qkv_in.dim() == 3 && qkv_in.size(0) == B && qkv_in.size(2) == H * 3 * D && qkv_in.size(1) <= K,
              "prompt_attention: qkv [B, P, H * 3 * D] with P within the cache");
  TORCH_CHECK(alibi.is_contiguous() && alibi.numel() == B * H * K, "prompt_attention: alibi [B * H, 1, K]");
  const auto dtype = keys.scalar_type();
  TORCH_CHECK(qkv_in.scalar_type() == dtype && values.scalar_type() == dtype && alibi.scalar_type() == dtype,
              "prompt_attention: one dtype");
  TORCH_CHECK(lengths_in.scalar_type() == at::kLong && lengths_in.numel() == B, "prompt_attention: int64 lengths [B]");
  const int64_t P = qkv_in.size(1);
  const at::Tensor qkv = qkv_in.contiguous(), lengths = lengths_in.contiguous();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(length[b] >= 1 && length[b] <= P, "prompt_attention: every row needs 1..P real tokens");
  auto out = at::empty({B, last_only ? 1 : P, H * D}, qkv.options());
  if (dtype == at::kBFloat16) {
    using T = at::BFloat16;
    run<T>(qkv.data_ptr<T>(), length, keys.data_ptr<T>(), values.data_ptr<T>(), alibi.data_ptr<T>(), B, P, H, K, D,
           last_only, out.data_ptr<T>());
  } else {
    TORCH_CHECK(dtype == at::kFloat, "prompt_attention: bf16 or fp32 only");
    run<float>(qkv.data_ptr<float>(), length, keys.data_ptr<float>(), values.data_ptr<float>(), alibi.data_ptr<float>(),
               B, P, H, K, D, last_only, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(bloom_cpu, m) {
  m.def("prompt_attention(Tensor qkv, Tensor lengths, Tensor(a!) keys, Tensor(b!) values, Tensor alibi, "
        "bool last_only) -> Tensor");
}

TORCH_LIBRARY_IMPL(bloom_cpu, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
}
