// A whole BLOOM decode step in one call (CPU, bf16, fp16 or fp32, one process): the CPU's counterpart of
// replaying a captured graph on an accelerator.
//
// On a GPU or a Gaudi a decode step is captured once and replayed, so the host pays for one launch
// per token. A CPU has no graph to replay: run op by op from Python, a step is over a hundred small
// operations, each paying PyTorch's dispatch. For a small model (the embedded tiny checkpoint:
// three blocks of width 128) that overhead is the whole step; here the same step is one call
// whose loops run straight through. For large models the step stays the time to stream the
// weights (the products are the few-rows kernel of few_rows.h, as in the op-by-op step).
//
// It computes what model.py's StaticBloom.decode computes, with the same roundings: every result
// that the op-by-op step stores in the model's dtype (layer norms, products, attention scores,
// probabilities, residual sums, GELU) is rounded to it here too; sums, softmax and norms run in fp32.
//
// The same call runs the server's mixed step (StaticBloom.mixed: a decode that carries pieces of
// joining prompts). Its tokens are then more than the cache's rows: `rows` names the cache row of
// each token (a decode token's own row; a prompt token's, the row its prompt joins) and `keep` the
// tokens whose logits are returned. A prompt token is a decode token at its own slot: it writes its
// key and value there and attends its row's slots up to that one, which is StaticBloom.mixed's
// causal mask. Every token writes before any attends, in token order, as in StaticBloom.mixed.
//
// weights, in this order (the layout StaticBloom.cpu_decode_weights builds):
//   word_embeddings [V, E] (also the tied LM head), its layer norm (weight, bias), ln_f (weight, bias),
//   then per block: input_layernorm (w, b), query_key_value (w [3E, E], b), dense (w [E, E], b),
//   post_attention_layernorm (w, b), dense_h_to_4h (w [F, E], b), dense_4h_to_h (w [E, F], b).

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "block_q8.h"
#include "dtypes.h"
#include "few_rows.h"
#include "int4_rows.h"
#include "int8_rows.h"

namespace {

using bloom_cpu::linear_rows;
using bloom_cpu::round_to;
using bloom_cpu::Vec16;
using bloom_cpu::set16;

constexpr int kGlobalWeights = 5;
constexpr int kBlockWeights = 12;

// out [rows, n] = layer_norm(x [rows, n]) * weight + bias, statistics in fp32, 16 lanes at a time
// (n is a multiple of 16: run_step checks it). A mixed step's prompt tokens make this work grow
// with them, where on AMX tiles the products barely do (amx_rows.h).
template <typename T>
void layer_norm(const T* x, const T* weight, const T* bias, int64_t rows, int64_t n, float eps, T* out) {
  using bloom_cpu::load16;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    Vec16 sum = bloom_cpu::zero16();
    for (int64_t i = 0; i < n; i += 16) sum = sum + load16(xr + i);
    const Vec16 mean = set16(bloom_cpu::reduce_add(sum) / float(n));
    Vec16 squares = bloom_cpu::zero16();
    for (int64_t i = 0; i < n; i += 16) {
      const Vec16 d = load16(xr + i) - mean;
      squares = bloom_cpu::fmadd(d, d, squares);
    }
    const Vec16 rstd = set16(1.0f / std::sqrt(bloom_cpu::reduce_add(squares) / float(n) + eps));
    for (int64_t i = 0; i < n; i += 16)
      bloom_cpu::store16(out + r * n + i, bloom_cpu::fmadd((load16(xr + i) - mean) * rstd, load16(weight + i), load16(bias + i)));
  }
}

// x = residual + x, rounded (PyTorch adds two bf16 tensors in fp32 and rounds once); count is a
// multiple of 16.
template <typename T>
void add_into(const T* residual, T* x, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) bloom_cpu::store16(x + i, bloom_cpu::load16(residual + i) + bloom_cpu::load16(x + i));
}

// GELU with the tanh approximation (F.gelu(approximate="tanh")), in place. Written as
// x * sigmoid(2u), which equals 0.5 x (1 + tanh(u)) and costs one exp instead of a tanh (libm's
// tanhf was about a quarter of a tiny model's step); both round the same fp32 value to within an fp32 step.
// Not inlined: the decode step and the gelu_tanh operator (the prefill's, and the op-by-op step's)
// then run the same machine code, so they agree bit for bit (inlined, the compiler may fuse a multiply
// and an add in one caller and not in the other).
template <typename T>
__attribute__((noinline)) void gelu_tanh(T* x, int64_t count) {
  const Vec16 beta = set16(0.7978845608028654f);  // sqrt(2 / pi)
  const Vec16 kappa = set16(0.044715f), minus_two = set16(-2.0f), one = set16(1.0f);
  auto gelu = [&](Vec16 v) {
    const Vec16 u = beta * bloom_cpu::fmadd(kappa * v, v * v, v);
    return v / (one + bloom_cpu::exp16(minus_two * u));  // v / sigmoid's denominator
  };
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) bloom_cpu::store16(x + i, gelu(bloom_cpu::load16(x + i)));
  if (i < count) bloom_cpu::store_first(x + i, gelu(bloom_cpu::load_first(x + i, count - i)), count - i);
}

struct Shapes {
  int64_t batch, heads, head_dim, cache_len, window;  // batch: the cache's rows
};

// The tokens of one step: token t is `ids[t]`, in cache row `rows[t]` at slot `positions[t]`.
struct Tokens {
  int64_t count;
  const int64_t *ids, *rows, *positions;
};

// One block's attention for every (token, head), after its query_key_value product.
// qkv [T, H * 3 * D] (per head [q, k, v]); keys/values this layer's [B, H, cache_len, D];
// alibi [B * H, cache_len]; out [T, H * D]. Each token's key and value go to its slot first, all
// tokens in order (a later token of a prompt sees the earlier ones; a prompt token's write replaces
// a decode token's at the same slot); then each token sees its row's slots up to its own (the rest
// of the window is masked).
template <typename T>
void attend(const T* qkv, const Tokens& tokens, T* keys, T* values, const T* alibi, const Shapes& s, T* out) {
  const int64_t D = s.head_dim, H = s.heads;
  const float inv_norm = 1.0f / std::sqrt(float(D));
  auto head = [&](int64_t t, int64_t h) { return (tokens.rows[t] * H + h) * s.cache_len; };  // a head's first slot
  for (int64_t t = 0; t < tokens.count; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const T* q = qkv + (t * H + h) * 3 * D;
      const int64_t slot = (head(t, h) + tokens.positions[t]) * D;
      std::copy(q + D, q + 2 * D, keys + slot);
      std::copy(q + 2 * D, q + 3 * D, values + slot);
    }
  at::parallel_for(0, tokens.count * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(s.window), context((D + 15) / 16 * 16);  // whole vectors (attend_one)
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / H, h = th % H, first = head(t, h);
      bloom_cpu::attend_one<T>(qkv + th * 3 * D, keys + first * D, values + first * D, alibi + first,
                               std::min(tokens.positions[t] + 1, s.window), D, inv_norm, scratch.data(),
                               context.data(), out + th * D);
    }
  });
}

// The products of one step: the weights' own dtype (few_rows.h), or, with `scales`, quantized
// weights: int8 whose rows those scales multiply (int8_rows.h), or packed int4 whose groups they
// multiply (uint8 [N, K / 2], scales [N, K / G]; int4_rows.h); with `integer`, the integer
// products of either (the input rounded to int8 per block of 32: block_q8.h).
template <typename T>
struct Products {
  const std::vector<at::Tensor>& weights;
  const std::vector<at::Tensor>* scales;  // nullptr: float weights
  bool integer = false;

  void operator()(size_t i, const T* x, int64_t M, int64_t N, int64_t K, const T* bias, T* out) const {
    if (scales == nullptr) {
      linear_rows<T>(x, M, weights[i].data_ptr<T>(), N, K, bias, out);
    } else if (integer) {
      const at::Tensor& s = (*scales)[i];
      const auto* q = static_cast<const uint8_t*>(weights[i].data_ptr());
      if (weights[i].scalar_type() == at::kByte)
        bloom_cpu::block_q8_linear<bloom_cpu::Q8Weight::kInt4, T>(x, M, q, s.data_ptr<float>(), N, K, K / s.size(1),
                                                                  bias, out);
      else
        bloom_cpu::block_q8_linear<bloom_cpu::Q8Weight::kInt8, T>(x, M, q, s.data_ptr<float>(), N, K, K, bias, out);
    } else if (weights[i].scalar_type() == at::kByte) {
      const at::Tensor& s = (*scales)[i];
      bloom_cpu::int4_linear<T>(x, M, weights[i].data_ptr<uint8_t>(), s.data_ptr<float>(), N, K, K / s.size(1), bias,
                                out);
    } else {
      bloom_cpu::int8_linear<T>(x, M, weights[i].data_ptr<int8_t>(), (*scales)[i].data_ptr<float>(), N, K, bias, out);
    }
  }

  // Row `id` of the word embeddings into `out` [E].
  void embedding_row(int64_t id, int64_t E, T* out) const {
    if (scales == nullptr) {
      const T* row = weights[0].data_ptr<T>() + id * E;
      std::copy(row, row + E, out);
      return;
    }
    if (weights[0].scalar_type() == at::kByte) {  // int4
      const at::Tensor& s = (*scales)[0];
      const int64_t groups = s.size(1);
      bloom_cpu::dequantize_row<T>(weights[0].data_ptr<uint8_t>() + id * (E / 2), s.data_ptr<float>() + id * groups,
                                   E, E / groups, out);
      return;
    }
    const int8_t* row = weights[0].data_ptr<int8_t>() + id * E;
    const float scale = (*scales)[0].data_ptr<float>()[id];
    for (int64_t e = 0; e < E; ++e) out[e] = T(float(row[e]) * scale);
  }
};

template <typename T>
void step(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>* scales, const Tokens& tokens,
          const int64_t* keep, int64_t kept, at::Tensor& keys, at::Tensor& values, const T* alibi, const Shapes& s,
          float eps, bool residual_from_ln, T* logits, bool integer) {
  auto ptr = [&](size_t i) { return weights[i].data_ptr<T>(); };
  const Products<T> product{weights, scales, integer};
  const int64_t B = tokens.count, V = weights[0].size(0), E = weights[kGlobalWeights].size(0);  // a layer norm's width
  const int64_t layers = (int64_t(weights.size()) - kGlobalWeights) / kBlockWeights;
  const int64_t F = weights[kGlobalWeights + 8].size(0);  // the MLP's width (4 E)
  std::vector<T> h(B * E), x(B * E), attn(B * E), context(B * E), qkv(B * 3 * E), wide(B * F);

  for (int64_t b = 0; b < B; ++b) product.embedding_row(tokens.ids[b], E, x.data() + b * E);
  layer_norm<T>(x.data(), ptr(1), ptr(2), B, E, eps, h.data());

  const int64_t layer_cache = s.batch * s.heads * s.cache_len * s.head_dim;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const size_t w = kGlobalWeights + layer * kBlockWeights;
    layer_norm<T>(h.data(), ptr(w), ptr(w + 1), B, E, eps, x.data());
    product(w + 2, x.data(), B, 3 * E, E, ptr(w + 3), qkv.data());
    attend<T>(qkv.data(), tokens, keys.data_ptr<T>() + layer * layer_cache,
              values.data_ptr<T>() + layer * layer_cache, alibi, s, context.data());
    product(w + 4, context.data(), B, E, E, ptr(w + 5), attn.data());
    add_into<T>(residual_from_ln ? x.data() : h.data(), attn.data(), B * E);  // attn = residual + attention
    layer_norm<T>(attn.data(), ptr(w + 6), ptr(w + 7), B, E, eps, x.data());
    product(w + 8, x.data(), B, F, E, ptr(w + 9), wide.data());
    gelu_tanh<T>(wide.data(), B * F);
    product(w + 10, wide.data(), B, E, F, ptr(w + 11), h.data());
    add_into<T>(residual_from_ln ? x.data() : attn.data(), h.data(), B * E);  // h = residual + MLP
  }
  // The LM head for the kept tokens only (a prompt's piece needs the logits of its last token at most).
  for (int64_t r = 0; r < kept; ++r) std::copy(h.data() + keep[r] * E, h.data() + (keep[r] + 1) * E, attn.data() + r * E);
  layer_norm<T>(attn.data(), ptr(3), ptr(4), kept, E, eps, x.data());
  product(0, x.data(), kept, V, E, nullptr, logits);
}

// The quantized entries of a decode step's weight list (int8 or int4, with scales): the embeddings
// and the four linear weights of every block.
bool quantizable(size_t i) {
  if (i == 0) return true;
  if (i < size_t(kGlobalWeights)) return false;
  const size_t j = (i - kGlobalWeights) % kBlockWeights;
  return j == 2 || j == 4 || j == 8 || j == 10;
}

// `rows` [T] (the cache row of each token) and `keep` (the tokens whose logits are returned) are
// absent for a decode step: token b is row b's, and every token's logits are returned, but for the
// rows at slot 0. A generated token always follows at least one prompt token, so a row at slot 0
// generates nothing (a free row of the server's batch, or one whose prompt has not begun; see
// accelerate.py's idle_rows): when some rows are, the step computes the others alone and returns
// zeros for those, whose keys, values and logits nothing reads.
at::Tensor run_step(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>* scales,
                    const at::Tensor& tokens, const at::Tensor& positions, at::Tensor keys, at::Tensor values,
                    const at::Tensor& alibi, int64_t window, double eps, bool residual_from_ln,
                    const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& keep,
                    bool integer = false) {
  TORCH_CHECK(weights.size() > kGlobalWeights && (weights.size() - kGlobalWeights) % kBlockWeights == 0,
              "decode_step: 5 + 12 per block weights");
  TORCH_CHECK(keys.dim() == 5 && keys.is_contiguous() && values.is_contiguous() && alibi.is_contiguous(),
              "decode_step: contiguous keys/values [layers, B, H, K, D] and alibi");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong, "decode_step: int64 ids");
  const auto dtype = weights[1].scalar_type();  // a layer norm's: the activations' dtype
  for (size_t i = 0; i < weights.size(); ++i) {
    const bool quantized = scales != nullptr && quantizable(i);
    const at::Tensor& w = weights[i];
    const bool int4 = quantized && w.scalar_type() == at::kByte;
    TORCH_CHECK((quantized ? (int4 || w.scalar_type() == at::kChar) : w.scalar_type() == dtype) && w.is_contiguous(),
                "decode_step: contiguous weights of one dtype (int8 or packed int4 where quantized)");
    if (!quantized) continue;
    const at::Tensor& s = (*scales)[i];
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(0) == w.size(0) &&
                    (int4 ? s.dim() == 2 && (2 * w.size(1)) % s.size(1) == 0 &&
                                (2 * w.size(1) / s.size(1)) % bloom_cpu::kInt4Block == 0
                          : s.dim() == 1),
                "decode_step: fp32 scales, one per row of each int8 weight, one per group of 32k weights of each int4 "
                "weight");
  }
  TORCH_CHECK(keys.scalar_type() == dtype && values.scalar_type() == dtype && alibi.scalar_type() == dtype,
              "decode_step: cache and alibi in the weights' dtype");
  const Shapes s{keys.size(1), keys.size(2), keys.size(4), keys.size(3), window};
  const int64_t E = weights[kGlobalWeights].size(0), F = weights[kGlobalWeights + 8].size(0);
  const int64_t step_elements = scales != nullptr ? 16 : bloom_cpu::kStepBytes / int64_t(c10::elementSize(dtype));
  TORCH_CHECK(E % step_elements == 0 && F % step_elements == 0,
              "decode_step: the hidden size and the MLP's width must be multiples of 64 bytes (few_rows.h), "
              "16 elements with int8 weights");
  const int64_t count = tokens.numel();
  const bool mixed = rows.has_value() && rows->defined();
  if (!mixed && positions.dim() == 1 && positions.numel() == count && count > 0) {
    // A scan of the host positions first: the common step, no row idle, allocates nothing here.
    const at::Tensor given = positions.contiguous();
    const int64_t* slot = given.data_ptr<int64_t>();
    const int64_t idle = std::count(slot, slot + count, int64_t(0));
    if (idle > 0 && idle < count) {
      const at::Tensor live = given.ne(0).nonzero().view(-1);  // the rows that generate
      const at::Tensor some = run_step(weights, scales, tokens.reshape(-1).index_select(0, live),
                                       positions.index_select(0, live), keys, values, alibi, window, eps,
                                       residual_from_ln, live, at::arange(live.numel(), live.options()), integer);
      return at::zeros({count, some.size(1)}, some.options()).index_copy_(0, live, some);
    }
  }
  TORCH_CHECK(mixed == (keep.has_value() && keep->defined()), "decode_step: rows and keep go together");
  TORCH_CHECK(positions.numel() == count && window <= s.cache_len,
              "decode_step: one position per token, window within the cache");
  TORCH_CHECK(mixed || count == s.batch, "decode_step: one token per cache row");
  const at::Tensor ids = tokens.contiguous(), slots = positions.contiguous();
  const at::Tensor token_rows = mixed ? rows->contiguous() : at::arange(count, tokens.options());
  const at::Tensor kept = mixed ? keep->contiguous() : token_rows;
  TORCH_CHECK(token_rows.scalar_type() == at::kLong && token_rows.numel() == count && kept.scalar_type() == at::kLong &&
                  kept.numel() <= count,
              "decode_step: int64 rows, one per token, and int64 keep, at most one per token");
  const Tokens t{count, ids.data_ptr<int64_t>(), token_rows.data_ptr<int64_t>(), slots.data_ptr<int64_t>()};
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(t.ids[i] >= 0 && t.ids[i] < weights[0].size(0), "decode_step: token id out of the vocabulary");
    TORCH_CHECK(t.positions[i] >= 0 && t.positions[i] < s.cache_len, "decode_step: position outside the cache");
    TORCH_CHECK(t.rows[i] >= 0 && t.rows[i] < s.batch, "decode_step: row outside the cache");
  }
  const int64_t* keep_ids = kept.data_ptr<int64_t>();
  for (int64_t r = 0; r < kept.numel(); ++r)
    TORCH_CHECK(keep_ids[r] >= 0 && keep_ids[r] < count, "decode_step: a kept token out of the step's tokens");
  auto logits = at::empty({kept.numel(), weights[0].size(0)}, weights[1].options());
  bloom_cpu::with_element_type(dtype, "decode_step", [&](auto zero) {
    using T = decltype(zero);
    step<T>(weights, scales, t, keep_ids, kept.numel(), keys, values, alibi.data_ptr<T>(), s, float(eps),
            residual_from_ln, logits.data_ptr<T>(), integer);
  });
  return logits;
}

at::Tensor decode_step(const std::vector<at::Tensor>& weights, const at::Tensor& tokens, const at::Tensor& positions,
                       at::Tensor keys, at::Tensor values, const at::Tensor& alibi, int64_t window, double eps,
                       bool residual_from_ln, const std::optional<at::Tensor>& rows,
                       const std::optional<at::Tensor>& keep) {
  return run_step(weights, nullptr, tokens, positions, keys, values, alibi, window, eps, residual_from_ln, rows, keep);
}

// The same step over quantized weights: `scales[i]` holds the scales of `weights[i]` where that is
// int8 or int4 (the embeddings and the blocks' linear weights), and is ignored elsewhere. With
// `integer`, the products are integer products (--int8_activations).
at::Tensor decode_step_quantized(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                                 const at::Tensor& tokens, const at::Tensor& positions, at::Tensor keys,
                                 at::Tensor values, const at::Tensor& alibi, int64_t window, double eps,
                                 bool residual_from_ln, const std::optional<at::Tensor>& rows,
                                 const std::optional<at::Tensor>& keep, bool integer) {
  TORCH_CHECK(scales.size() == weights.size(), "decode_step_quantized: one scales entry per weight");
  return run_step(weights, &scales, tokens, positions, keys, values, alibi, window, eps, residual_from_ln, rows, keep,
                  integer);
}

// F.gelu(x, approximate="tanh") with the decode step's GELU, split over the threads: the prefill's
// GELU where no product fuses it, which ATen computes at a fraction of the speed.
at::Tensor gelu_tanh_op(const at::Tensor& input) {
  const at::Tensor x = input.contiguous();
  auto out = at::empty_like(x);
  const int64_t count = x.numel();
  bloom_cpu::with_element_type(x.scalar_type(), "gelu_tanh", [&](auto zero) {
    using T = decltype(zero);
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    constexpr int64_t kChunk = 4096;  // elements per task (a multiple of 16)
    at::parallel_for(0, (count + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t first = c * kChunk, n = std::min(kChunk, count - first);
        std::copy(src + first, src + first + n, dst + first);
        gelu_tanh<T>(dst + first, n);
      }
    });
  });
  return out;
}

}  // namespace

BLOOM_LIBRARY_FRAGMENT(BLOOM_OPS, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("decode_step(Tensor[] weights, Tensor tokens, Tensor positions, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor alibi, int window, float eps, bool residual_from_ln, Tensor? rows=None, Tensor? keep=None) -> Tensor");
  m.def("decode_step_quantized(Tensor[] weights, Tensor[] scales, Tensor tokens, Tensor positions, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor alibi, int window, float eps, bool residual_from_ln, Tensor? rows=None, "
        "Tensor? keep=None, bool integer=False) -> Tensor");
}

BLOOM_LIBRARY_IMPL(BLOOM_OPS, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh_op);
  m.impl("decode_step", &decode_step);
  m.impl("decode_step_quantized", &decode_step_quantized);
}
