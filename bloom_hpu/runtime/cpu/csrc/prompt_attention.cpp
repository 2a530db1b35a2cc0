// A prefill's attention in one call (CPU, bf16, fp16 or fp32): every position of right-padded prompts
// writes its key and value to the cache and attends, straight from the query_key_value output.
//
// Op by op (model.py, Attention.prefill) the same attention is a dozen PyTorch calls per block:
// head split and layout copies, a [B*H, P, P] score tensor, a masked copy of it, an fp32 softmax,
// a bf16 copy of that, a product and another layout copy. Here each (row, head) is one task that
// reads its queries, keys and values where the product left them, with the same roundings
// (attention.h). Scores and weighted values are computed in tiles of 4 queries x 16 keys (or 16
// value dimensions) from the head's keys and values laid out per dtype (Tiles, below): each vector
// read serves 4 queries, and no horizontal sums are needed; the softmax's exp is vectorised too.
// No score tensor is written or copied, which is what long prompts pay for op by op
// (bench/prompt_attention_bench.py compares the two).
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
#include "dtypes.h"

namespace {

using bloom_cpu::load_first;
using bloom_cpu::load16;
using bloom_cpu::set16;
using bloom_cpu::Vec16;

constexpr int64_t kQueries = 4;  // queries per tile: 4 independent sums hide the FMA latency

inline int64_t whole_vectors(int64_t n) { return (n + 15) / 16 * 16; }

// The tile's kQueries fp32 sums, one vector of 16 lanes per query, kept in registers.
struct Sums {
  Vec16 q0 = bloom_cpu::zero16(), q1 = bloom_cpu::zero16(), q2 = bloom_cpu::zero16(), q3 = bloom_cpu::zero16();

  // query r's sum += a_r * v, lane by lane
  void add(Vec16 a0, Vec16 a1, Vec16 a2, Vec16 a3, Vec16 v) {
    q0 = bloom_cpu::fmadd(a0, v, q0), q1 = bloom_cpu::fmadd(a1, v, q1);
    q2 = bloom_cpu::fmadd(a2, v, q2), q3 = bloom_cpu::fmadd(a3, v, q3);
  }
#if defined(BLOOM_ISA_AVX512)
  // query r's sum += both products of the bf16 pair a_r (broadcast) with each lane's pair in v
  void add_pairs(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, __m512i v) {
    const __m512bh w = (__m512bh)v;
    q0.v = _mm512_dpbf16_ps(q0.v, (__m512bh)_mm512_set1_epi32(int(a0)), w);
    q1.v = _mm512_dpbf16_ps(q1.v, (__m512bh)_mm512_set1_epi32(int(a1)), w);
    q2.v = _mm512_dpbf16_ps(q2.v, (__m512bh)_mm512_set1_epi32(int(a2)), w);
    q3.v = _mm512_dpbf16_ps(q3.v, (__m512bh)_mm512_set1_epi32(int(a3)), w);
  }
#endif
  // A copy of query r's sum. (Not a conditional expression over the members: that selects an
  // lvalue, and GCC then keeps the sums in memory rather than in registers.)
  Vec16 operator[](int64_t r) const {
    switch (r) {
      case 0: return q0;
      case 1: return q1;
      case 2: return q2;
      default: return q3;
    }
  }
};
static_assert(kQueries == 4, "Sums keeps one vector per query");

// One head's keys, values and a tile's queries, laid out for the tile products, and those
// products, per dtype. The driver (attend_prompt_head) is the same for all.
//
// By default (fp32 and fp16; bf16 on the AVX2 build): keys widened to fp32 and copied key-minor
// ([D, keys]): a score vector is 16 keys, summed over d by FMAs of a broadcast query element
// (queries widened to fp32 too); the values are read, and widened, where they are.
// bf16 on the AVX-512 build: VDPBF16PS multiplies pairs of bf16 and adds both products into one
// fp32 lane, so every operand is laid out in pairs along the summed dimension: keys as [D / 2,
// keys] pairs of dimensions, values as [keys / 2, D] pairs of keys, queries and probabilities as
// pairs. Half the instructions of the fp32 layout. (Products of two bf16 are exact in fp32, as in
// the FMA; the sums differ from them by the order of additions only.)
template <typename T>
struct Tiles {
  std::vector<float> keys_t;   // [D, stride], fp32; zero past the real keys
  std::vector<float> queries;  // [kQueries, D], fp32
  const T* values = nullptr;      // the cache's [keys, D]
  const float* probs = nullptr;   // the driver's [kQueries, stride]
  int64_t D = 0, stride = 0;

  void lay_out(const T* k_cache, const T* v_cache, int64_t length, int64_t stride_, int64_t D_) {
    D = D_, stride = stride_, values = v_cache;
    keys_t.assign(D * stride, 0.0f);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t d = 0; d < D; ++d) keys_t[d * stride + j] = float(k_cache[j * D + d]);
    queries.resize(kQueries * D);
  }

  // Queries i0..i0 + rows - 1 (position i's at head + i * step); missing rows are zeros.
  void take_queries(const T* head, int64_t step, int64_t i0, int64_t rows) {
    std::fill(queries.begin(), queries.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) std::copy(head + (i0 + r) * step, head + (i0 + r) * step + D, queries.data() + r * D);
  }

  // acc[r] = q_r . k_j for keys j0..j0 + 15.
  void scores(int64_t j0, Sums& acc) const {
    const float *q0 = queries.data(), *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    for (int64_t d = 0; d < D; ++d)
      acc.add(set16(q0[d]), set16(q1[d]), set16(q2[d]), set16(q3[d]), load16(keys_t.data() + d * stride + j0));
  }

  // The tile's probabilities [kQueries, stride], rounded to T, zero past each query's keys.
  void take_probs(const float* probs_, int64_t) { probs = probs_; }

  // acc[r] = sum_j probs_r[j] * values[j, c..c + width - 1] over keys j < n.
  void weighted_values(int64_t n, int64_t c, int64_t width, Sums& acc) const {
    const float *p0 = probs, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
    for (int64_t j = 0; j < n; ++j)
      acc.add(set16(p0[j]), set16(p1[j]), set16(p2[j]), set16(p3[j]), load_first(values + j * D + c, width));
  }
};

#if defined(BLOOM_ISA_AVX512)
template <>
struct Tiles<at::BFloat16> {
  std::vector<uint32_t> key_pairs;    // [ceil(D / 2), stride]: lane j holds (k[j, 2e], k[j, 2e + 1])
  std::vector<uint32_t> value_pairs;  // [stride / 2, D]: lane d holds (v[2m, d], v[2m + 1, d])
  std::vector<uint32_t> query_pairs;  // [kQueries, ceil(D / 2)]
  std::vector<uint16_t> probs;        // [kQueries, stride]: the probabilities' bf16 bits
  int64_t D = 0, half_D = 0, stride = 0;

  static uint32_t pair(uint16_t first, uint16_t second) { return uint32_t(first) | (uint32_t(second) << 16); }
  static uint16_t bits(at::BFloat16 x) { return x.x; }

  void lay_out(const at::BFloat16* k_cache, const at::BFloat16* v_cache, int64_t length, int64_t stride_, int64_t D_) {
    D = D_, half_D = (D + 1) / 2, stride = stride_;
    key_pairs.assign(half_D * stride, 0);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t e = 0; e < half_D; ++e) {
        const at::BFloat16* k = k_cache + j * D + 2 * e;
        key_pairs[e * stride + j] = pair(bits(k[0]), 2 * e + 1 < D ? bits(k[1]) : 0);
      }
    value_pairs.assign(stride / 2 * D, 0);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t d = 0; d < D; ++d)
        value_pairs[(j / 2) * D + d] |= uint32_t(bits(v_cache[j * D + d])) << (16 * (j % 2));
    query_pairs.resize(kQueries * half_D);
    probs.resize(kQueries * stride);
  }

  void take_queries(const at::BFloat16* head, int64_t step, int64_t i0, int64_t rows) {
    std::fill(query_pairs.begin(), query_pairs.end(), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < half_D; ++e) {
        const at::BFloat16* q = head + (i0 + r) * step + 2 * e;
        query_pairs[r * half_D + e] = pair(bits(q[0]), 2 * e + 1 < D ? bits(q[1]) : 0);
      }
  }

  void scores(int64_t j0, Sums& acc) const {
    const uint32_t* q = query_pairs.data();
    for (int64_t e = 0; e < half_D; ++e)
      acc.add_pairs(q[e], q[half_D + e], q[2 * half_D + e], q[3 * half_D + e],
                    _mm512_loadu_si512(key_pairs.data() + e * stride + j0));
  }

  // As bf16 bits (their top halves: they are rounded to bf16 already). The driver has zeroed
  // them past n, up to whole vectors, so an odd last key pairs with a zero.
  void take_probs(const float* probs_f, int64_t n) {
    for (int64_t r = 0; r < kQueries; ++r)
      for (int64_t j = 0; j < n; j += 16) {
        const __m512i top = _mm512_srli_epi32(_mm512_loadu_si512(probs_f + r * stride + j), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + r * stride + j), _mm512_cvtepi32_epi16(top));
      }
  }

  void weighted_values(int64_t n, int64_t c, int64_t width, Sums& acc) const {
    const __mmask16 lanes = bloom_cpu::first_lanes(width);
    const uint32_t* p = reinterpret_cast<const uint32_t*>(probs.data());  // pairs of keys
    const int64_t row = stride / 2;
    for (int64_t m = 0; m < (n + 1) / 2; ++m)
      acc.add_pairs(p[m], p[row + m], p[2 * row + m], p[3 * row + m],
                    _mm512_maskz_loadu_epi32(lanes, value_pairs.data() + m * D + c));
  }
};
#endif

// Attention of the queries at slots first..length-1 of one (row, head) over its keys 0..length-1
// (causal). head: this head's [q, k, v] of the token at slot `base`, slot i's at head + (i - base) *
// step (a prefill: base 0; an extend: the slot its rest starts at); k_cache/v_cache: this head's
// [K, D] in the cache, already written; alibi [K]. Query i's output goes to out + (i - first) * out_step.
// probs: the tile's scores, then probabilities; alibi_f: fp32 bias (both reused across calls).
template <typename T>
void attend_prompt_head(const T* head, int64_t base, int64_t step, const T* k_cache, const T* v_cache, const T* alibi,
                        int64_t length, int64_t first, int64_t D, float inv_norm, Tiles<T>& tiles,
                        std::vector<float>& probs, std::vector<float>& alibi_f, T* out, int64_t out_step) {
  // Whole vectors of 16 keys, plus one: rows of a power-of-two size would all fall in the same few
  // L1 sets, and a tile reads one vector from each row of the keys' layout.
  const int64_t stride = whole_vectors(length) + 16;
  tiles.lay_out(k_cache, v_cache, length, stride, D);
  alibi_f.assign(stride, 0.0f);
  for (int64_t j = 0; j < length; ++j) alibi_f[j] = float(alibi[j]);
  probs.resize(kQueries * stride);
  const Vec16 norm = set16(inv_norm);
  for (int64_t i0 = first; i0 < length; i0 += kQueries) {
    const int64_t rows = std::min(kQueries, length - i0), seen_by_last = i0 + rows;
    tiles.take_queries(head, step, i0 - base, rows);
    // Scores of the tile's queries against every key its last query sees, 16 keys at a time.
    for (int64_t j0 = 0; j0 < seen_by_last; j0 += 16) {
      Sums acc;
      tiles.scores(j0, acc);
      const Vec16 bias = load16(alibi_f.data() + j0);
      for (int64_t r = 0; r < kQueries; ++r)  // alibi + q.k / sqrt(D), rounded to T
        bloom_cpu::store16(probs.data() + r * stride + j0, bloom_cpu::round16<T>(bloom_cpu::fmadd(acc[r], norm, bias)));
    }
    for (int64_t r = 0; r < kQueries; ++r) {
      float* row = probs.data() + r * stride;
      const int64_t seen = r < rows ? i0 + r + 1 : 0;  // query i0 + r sees keys 0..i0 + r
      if (seen) bloom_cpu::softmax_rounded<T>(row, seen);
      std::fill(row + seen, row + whole_vectors(seen_by_last), 0.0f);  // keys it does not see; missing queries
    }
    // Each value vector read serves the tile's queries; keys past a query's own weigh 0.
    tiles.take_probs(probs.data(), seen_by_last);
    for (int64_t c = 0; c < D; c += 16) {
      const int64_t width = std::min<int64_t>(16, D - c);
      Sums acc;
      tiles.weighted_values(seen_by_last, c, width, acc);
      for (int64_t r = 0; r < rows; ++r) bloom_cpu::store_first(out + (i0 - first + r) * out_step + c, acc[r], width);
    }
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
    Tiles<T> tiles;  // working memory, reused across the (row, head) pairs this thread takes
    std::vector<float> probs, alibi_f;
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
      attend_prompt_head<T>(head, 0, H * 3 * D, k_cache, v_cache, alibi + bh * K, length, last_only ? length - 1 : 0, D,
                            inv_norm, tiles, probs, alibi_f, o, H * D);
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
  bloom_cpu::with_element_type(dtype, "prompt_attention", [&](auto zero) {
    using T = decltype(zero);
    run<T>(qkv.data_ptr<T>(), length, keys.data_ptr<T>(), values.data_ptr<T>(), alibi.data_ptr<T>(), B, P, H, K, D,
           last_only, out.data_ptr<T>());
  });
  return out;
}

// An extend's attention (a prefix cache's hit: model.py, StaticBloom.extend): row b's R tokens
// continue after the starts[b] slots the cache holds of it. Token r writes its key and value to slot
// starts[b] + r and attends slots 0..starts[b] + r, as the op-by-op extend does; every token of the
// rest is computed (a pad token's output is never used) but those past the cache's end, which the
// op-by-op extend clamps onto its last slot: here they write nothing and get zeros. Attention over
// the slots a row holds, not over the whole cache: what a chat's later turn costs grows with its
// history only as its keys do. out [B, R, H * D], or [B, 1, H * D] at last[b] (a rest position).
template <typename T>
void run_extend(const T* qkv, const int64_t* starts, const int64_t* last, T* keys, T* values, const T* alibi,
                int64_t B, int64_t R, int64_t H, int64_t K, int64_t D, T* out) {
  const float inv_norm = 1.0f / std::sqrt(float(D));
  const int64_t Q = last ? 1 : R;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Tiles<T> tiles;
    std::vector<float> probs, alibi_f;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, start = starts[b], tokens = std::min(R, K - start);
      T* k_cache = keys + bh * K * D;
      T* v_cache = values + bh * K * D;
      const T* head = qkv + b * R * H * 3 * D + h * 3 * D;  // rest position r's [q, k, v] at head + r * H * 3 * D
      for (int64_t r = 0; r < tokens; ++r) {
        const T* qr = head + r * H * 3 * D;
        std::copy(qr + D, qr + 2 * D, k_cache + (start + r) * D);
        std::copy(qr + 2 * D, qr + 3 * D, v_cache + (start + r) * D);
      }
      T* o = out + b * Q * H * D + h * D;  // query n's output at o + n * H * D
      for (int64_t n = last ? Q : tokens; n < Q; ++n)  // past the cache: zeros (never used)
        std::fill(o + n * H * D, o + n * H * D + D, T(0.0f));
      const int64_t length = last ? start + last[b] + 1 : start + tokens;  // keys of the last query attended
      attend_prompt_head<T>(head, start, H * 3 * D, k_cache, v_cache, alibi + bh * K, length, last ? length - 1 : start,
                            D, inv_norm, tiles, probs, alibi_f, o, H * D);
    }
  });
}

at::Tensor extend_attention(const at::Tensor& qkv_in, const at::Tensor& starts_in, at::Tensor keys, at::Tensor values,
                            const at::Tensor& alibi, const c10::optional<at::Tensor>& last_in) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(),
              "extend_attention: contiguous keys/values [B, H, K, D] (one layer of the cache)");
  const int64_t H = keys.size(1), K = keys.size(2), D = keys.size(3), B = qkv_in.size(0);
  TORCH_CHECK(qkv_in.dim() == 3 && B <= keys.size(0) && qkv_in.size(2) == H * 3 * D,
              "extend_attention: qkv [B, R, H * 3 * D] for rows of the cache");
  TORCH_CHECK(alibi.is_contiguous() && alibi.numel() >= B * H * K, "extend_attention: alibi [B * H, 1, K]");
  const auto dtype = keys.scalar_type();
  TORCH_CHECK(qkv_in.scalar_type() == dtype && values.scalar_type() == dtype && alibi.scalar_type() == dtype,
              "extend_attention: one dtype");
  TORCH_CHECK(starts_in.scalar_type() == at::kLong && starts_in.numel() == B, "extend_attention: int64 starts [B]");
  const int64_t R = qkv_in.size(1);
  const at::Tensor qkv = qkv_in.contiguous(), starts = starts_in.contiguous();
  const int64_t* start = starts.data_ptr<int64_t>();
  at::Tensor last;
  if (last_in.has_value()) {
    last = last_in->contiguous();
    TORCH_CHECK(last.scalar_type() == at::kLong && last.numel() == B, "extend_attention: int64 last [B]");
  }
  const int64_t* pick = last.defined() ? last.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b] >= 0 && start[b] < K, "extend_attention: every row starts inside the cache");
    TORCH_CHECK(!pick || (pick[b] >= 0 && pick[b] < R && start[b] + pick[b] < K),
                "extend_attention: each last position a token of its row inside the cache");
  }
  auto out = at::empty({B, pick ? 1 : R, H * D}, qkv.options());
  bloom_cpu::with_element_type(dtype, "extend_attention", [&](auto zero) {
    using T = decltype(zero);
    run_extend<T>(qkv.data_ptr<T>(), start, pick, keys.data_ptr<T>(), values.data_ptr<T>(), alibi.data_ptr<T>(), B, R,
                  H, K, D, out.data_ptr<T>());
  });
  return out;
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("prompt_attention(Tensor qkv, Tensor lengths, Tensor(a!) keys, Tensor(b!) values, Tensor alibi, "
        "bool last_only) -> Tensor");
  m.def("extend_attention(Tensor qkv, Tensor starts, Tensor(a!) keys, Tensor(b!) values, Tensor alibi, "
        "Tensor? last) -> Tensor");
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
  m.impl("extend_attention", &extend_attention);
}
