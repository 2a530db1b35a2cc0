// A prefill's attention in one call (CPU, bf16 or fp32): every position of right-padded prompts
// writes its key and value to the cache and attends, straight from the query_key_value output.
//
// Op by op (model.py, Attention.prefill) the same attention is a dozen PyTorch calls per block:
// head split and layout copies, a [B*H, P, P] score tensor, a masked copy of it, an fp32 softmax,
// a bf16 copy of that, a product and another layout copy. Here each (row, head) is one task that
// reads its queries, keys and values where the product left them, with the same roundings
// (attention.h). The scores are computed in tiles of 4 queries x 16 keys from an fp32 copy of the
// head's keys laid out key-minor ([D, keys]): one broadcast query element times 16 keys per FMA,
// each key vector serving 4 queries, no horizontal sums; the softmax's exp is vectorised too.
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

using bloom_cpu::load16;
using bloom_cpu::load_first;

constexpr int64_t kQueries = 4;  // queries per tile: 4 independent sums hide the FMA latency

// Working memory of one task, reused across the (row, head) pairs a thread takes.
struct Scratch {
  std::vector<float> keys_t;   // [D, stride]: the head's keys, fp32, key-minor; zero past `length`
  std::vector<float> alibi;    // [stride]
  std::vector<float> queries;  // [kQueries, D]
  std::vector<float> probs;    // [kQueries, stride]: scores, then probabilities
  int64_t stride = 0;

  void resize(int64_t keys, int64_t D) {
    // Whole vectors of 16 keys, plus one: rows of a power-of-two size would all fall in the same
    // few L1 sets, and a tile reads one vector from each of the D rows.
    stride = (keys + 15) / 16 * 16 + 16;
    keys_t.assign(D * stride, 0.0f);
    alibi.assign(stride, 0.0f);
    queries.resize(kQueries * D);
    probs.resize(kQueries * stride);
  }
};

// Columns c..c + width - 1 of weighted_values_tile (below); load reads `width` values as fp32.
template <typename T, typename Load>
inline void weighted_values_tile_part(const float* probs, int64_t stride, const T* values, int64_t n, int64_t D,
                                      int64_t rows, T* out, int64_t out_step, int64_t c, int64_t width, Load load) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
  const float *p0 = probs, *p1 = probs + stride, *p2 = probs + 2 * stride, *p3 = probs + 3 * stride;
  for (int64_t j = 0; j < n; ++j) {
    const __m512 v = load(values + j * D + c);
    acc0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), v, acc0);
    acc1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), v, acc1);
    acc2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[j]), v, acc2);
    acc3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[j]), v, acc3);
  }
  const __m512 sums[kQueries] = {acc0, acc1, acc2, acc3};
  for (int64_t r = 0; r < rows; ++r) bloom_cpu::store_first(out + r * out_step + c, sums[r], width);
}

// For each query r of a tile: out_r [D] = sum_j probs_r[j] * values[j, :] over j < n, in fp32, rounded
// to T. Each value vector is read once for the tile's kQueries queries (probabilities of keys past a
// query's own are 0); each query's sum runs over the keys in order.
template <typename T>
void weighted_values_tile(const float* probs, int64_t stride, const T* values, int64_t n, int64_t D, int64_t rows,
                          T* out, int64_t out_step) {
  static_assert(kQueries == 4, "weighted_values_tile_part keeps one sum per query");
  for (int64_t c = 0; c < D; c += 16) {
    const int64_t width = std::min<int64_t>(16, D - c);
    if (width == 16)
      weighted_values_tile_part(probs, stride, values, n, D, rows, out, out_step, c, width,
                                [](const T* p) { return load16(p); });
    else  // head sizes that are not whole vectors (20 in the tests)
      weighted_values_tile_part(probs, stride, values, n, D, rows, out, out_step, c, width,
                                [width](const T* p) { return load_first(p, width); });
  }
}

// Attention of queries first..length-1 of one (row, head) over its keys 0..length-1 (causal).
// head: position 0's [q, k, v] of this head, position i's at head + i * step; k_cache/v_cache: this
// head's [K, D] in the cache, already written; alibi [K]. Query i's output goes to out + (i - first) * out_step.
template <typename T>
void attend_prompt_head(const T* head, int64_t step, const T* k_cache, const T* v_cache, const T* alibi,
                        int64_t length, int64_t first, int64_t D, float inv_norm, Scratch& s, T* out,
                        int64_t out_step) {
  s.resize(length, D);
  const int64_t stride = s.stride;
  for (int64_t j = 0; j < length; ++j) {
    s.alibi[j] = float(alibi[j]);
    for (int64_t d = 0; d < D; ++d) s.keys_t[d * stride + j] = float(k_cache[j * D + d]);
  }
  const __m512 norm = _mm512_set1_ps(inv_norm);
  for (int64_t i0 = first; i0 < length; i0 += kQueries) {
    const int64_t rows = std::min(kQueries, length - i0), seen_by_last = i0 + rows;
    std::fill(s.queries.begin(), s.queries.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) s.queries[r * D + d] = float(head[(i0 + r) * step + d]);
    // Scores of the tile's queries against every key its last query sees, 16 keys at a time.
    for (int64_t j0 = 0; j0 < seen_by_last; j0 += 16) {
      __m512 acc[kQueries] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const float* k = s.keys_t.data() + j0;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 keys16 = _mm512_loadu_ps(k + d * stride);
        for (int64_t r = 0; r < kQueries; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(s.queries[r * D + d]), keys16, acc[r]);
      }
      const __m512 bias = _mm512_loadu_ps(s.alibi.data() + j0);
      for (int64_t r = 0; r < kQueries; ++r)  // alibi + q.k / sqrt(D), rounded to T
        _mm512_storeu_ps(s.probs.data() + r * stride + j0, bloom_cpu::round16<T>(_mm512_fmadd_ps(acc[r], norm, bias)));
    }
    for (int64_t r = 0; r < kQueries; ++r) {
      float* probs = s.probs.data() + r * stride;
      const int64_t seen = r < rows ? i0 + r + 1 : 0;  // query i0 + r sees keys 0..i0 + r
      if (seen) bloom_cpu::softmax_rounded<T>(probs, seen);
      std::fill(probs + seen, probs + seen_by_last, 0.0f);  // keys it does not see; missing queries
    }
    weighted_values_tile<T>(s.probs.data(), stride, v_cache, seen_by_last, D, rows, out + (i0 - first) * out_step,
                            out_step);
  }
}

// qkv [B, P, H * 3 * D] (per head [q, k, v]); keys/values: this layer's [B, H, K, D], slots
// 0..P-1 written here; alibi [B * H, 1, K]; lengths [B]. out [B, Q, H * D], Q = P, or 1 with
// last_only (each row's last real token: the last block of a prefill for generation).
template <typename T>
void run(const T* qkv, const int64_t* lengths, T* keys, T* values, const T* alibi, int64_t B, int64_t P, int64_t H,
         int64_t K, int64_t D, bool last_only, T* out) {
  const float inv_norm = 1.0f / std::sqrt(float(D));
  const int64_t Q = last_only ? 1 : P;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
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
      T* o = out + b * Q * H * D + h * D;  // query n's output at o + n * H * D
      for (int64_t n = last_only ? Q : length; n < Q; ++n)  // pad queries: zeros (finite, never used)
        std::fill(o + n * H * D, o + n * H * D + D, T(0.0f));
      attend_prompt_head<T>(head, H * 3 * D, k_cache, v_cache, alibi + bh * K, length, last_only ? length - 1 : 0, D,
                            inv_norm, scratch, o, H * D);
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
