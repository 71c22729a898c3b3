// CPU kernels for a decode step (engine/native_kernels.py builds and checks them; engine/attention.py and
// engine/compact_decoder.py call them).
//
// Why: at a few rows per step each of a decoder layer's ~25 small tensor operations has a fixed cost as large as
// its work, and the attention copies every row's keys and values out of the paged cache before attending. These
// kernels do the same arithmetic in fewer passes: an RMS norm (with the residual add before it), the SiLU-gated
// product, the rotary embedding together with the cache write, and decode attention read straight from the
// cache's blocks.
// Reductions accumulate in float32; values are rounded to the tensor's type where PyTorch's own operations
// round them, so results equal the PyTorch path up to summation order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowGrain = 16;  // rows per thread below which a row-wise kernel stays on one thread

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// exp(x) in float32 without a libm call, so that loops over it vectorise (std::exp and std::floor do not without
// -ffast-math): Cephes' range reduction to x = n ln2 + r and its degree-6 polynomial for e^r, then 2^n put into
// the exponent bits; within about 2 ulp of std::exp. Inputs are clamped to where the result is a normal float.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.3f ? 88.3f : x);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded to an integer by 1.5 * 2^23
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// out = w * (x / sqrt(mean(x^2) + eps)), the normalised value rounded to T before the weight (as transformers'
// RMS norms do).
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    float v = f32(x[i]);
    ss += v * v;
  }
  float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = round_to<T>(f32(w[i]) * f32(round_to<T>(f32(x[i]) * inv)));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "rms norm: weight must be [hidden] of x's type");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
  int64_t h = x.size(-1), n = x.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// delta += residual, in place (delta becomes the new residual stream); returns rms_norm(delta).
at::Tensor add_rms_norm_(at::Tensor& delta, const at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(delta, w);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == delta.sizes() &&
                  residual.scalar_type() == delta.scalar_type(),
              "add_rms_norm_: residual must match delta");
  auto out = at::empty_like(delta);
  int64_t h = delta.size(-1), n = delta.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* d = dp + r * h;
        const scalar_t* res = rp + r * h;
        for (int64_t i = 0; i < h; ++i) d[i] = round_to<scalar_t>(f32(res[i]) + f32(d[i]));
        norm_row(d, wp, op + r * h, h, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// gate_up [..., 2 * inter] (gate first) -> silu(gate) * up [..., inter]
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && gate_up.size(-1) == 2 * inter,
              "silu_mul: gate_up must be a contiguous CPU tensor [..., 2 * inter]");
  int64_t n = gate_up.numel() / (2 * inter);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, std::max<int64_t>(1, 8192 / inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        _Pragma("omp simd")  // _Pragma: a #pragma cannot sit inside the dispatch macro
        for (int64_t i = 0; i < inter; ++i) {
          float a = f32(g[i]);
          o[i] = round_to<scalar_t>(f32(round_to<scalar_t>(a / (1.f + fast_exp(-a)))) * f32(u[i]));
        }
      }
    });
  });
  return out;
}

// One token per row of logits [rows, vocab] (float32, rows `stride` apart), drawn from softmax(logits * scale)
// with the row's uniform number in [0, 1): where it falls when the weights exp((x - top) * scale) lie end to end
// (engine/sampling/sampler.py's draw, for rows with no top-k, top-p or min-p). One pass for the largest logit, one
// for the weights' sums per span of 256 (their running sums in double), then the walk within the span the target
// falls in. Through PyTorch the same takes about a dozen passes over the logits. -inf (and NaN) logits weigh 0 and
// are never drawn; +inf ones are taken as float32's largest, as the PyTorch path clamps them.
at::Tensor draw_tokens(const at::Tensor& logits, const at::Tensor& scale, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1,
              "draw_tokens: logits must be a CPU float32 [rows, vocab] tensor with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == rows &&
                  uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "draw_tokens: scale (float32) and uniforms (float64) must hold one value a row");
  TORCH_CHECK(vocab > 0, "draw_tokens: an empty vocabulary");
  constexpr int64_t kSpan = 256;
  const int64_t spans = (vocab + kSpan - 1) / kSpan;
  auto out = at::empty({rows}, at::kLong);
  const float* lp = logits.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  static constexpr float kLargest = std::numeric_limits<float>::max();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> ends(spans);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * stride;
      const float s = sp[r];
      float top = -kLargest;
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < vocab; ++i) top = std::max(top, std::min(x[i], kLargest));
      // Computed the same way in both passes (the exp always, then the select), so that the loop vectorises.
      auto weight = [top, s](float v) {
        const float e = fast_exp((std::min(v, kLargest) - top) * s);
        return v > -std::numeric_limits<float>::infinity() ? e : 0.f;
      };
      double total = 0.0;
      for (int64_t k = 0; k < spans; ++k) {
        const int64_t i0 = k * kSpan, n = std::min(vocab - i0, kSpan);
        const float* xs = x + i0;
        float part = 0.f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = 0; i < n; ++i) part += weight(xs[i]);
        ends[k] = total += part;
      }
      const double target = up[r] * total;
      // The first span whose end passes the target (a span of weight 0 ends where the one before it does).
      int64_t k = std::upper_bound(ends.begin(), ends.end(), target) - ends.begin();
      if (k == spans) k = spans - 1;
      double run = k > 0 ? ends[k - 1] : 0.0;
      int64_t pick = -1, last = -1;
      for (int64_t i = k * kSpan, i1 = std::min(vocab, i + kSpan); i < i1; ++i) {
        const float w = weight(x[i]);
        if (w > 0.f) {
          last = i;
          run += w;
          if (run > target) {
            pick = i;
            break;
          }
        }
      }
      if (pick < 0) pick = last;  // rounding carried the target past the span's last token of weight
      if (pick < 0) {  // no weight in the span at all (every logit -inf or NaN): the first largest logit
        pick = 0;
        for (int64_t i = 0; i < vocab; ++i)
          if (x[i] > x[pick]) pick = i;
      }
      op[r] = pick;
    }
  });
  return out;
}

// The KV cache may hold 16-bit keys and values under a float32 model (KV_CACHE_DTYPE; half the bytes that decode
// attention reads): pools of the activations' own type, or float16 / bfloat16 pools under float32.
bool pools_pair_with(const at::Tensor& activations, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  const at::ScalarType type = k_pool.scalar_type();
  return v_pool.scalar_type() == type &&
         (type == activations.scalar_type() ||
          (activations.scalar_type() == at::kFloat && (type == at::kHalf || type == at::kBFloat16)));
}

// n values to a pool of type `type` at dst: copied where it is T, else rounded to it. Float16 saturates at its
// largest finite value (+-65504) instead of turning into infinity, so one outlying key cannot poison a softmax.
template <typename T>
inline void store_as(const T* src, int64_t n, at::ScalarType type, char* dst) {
  if (type == c10::CppTypeToScalarType<T>::value) {
    std::copy(src, src + n, reinterpret_cast<T*>(dst));
  } else if (type == at::kHalf) {
    c10::Half* out = reinterpret_cast<c10::Half*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = c10::Half(std::clamp(f32(src[i]), -65504.f, 65504.f));
  } else {
    c10::BFloat16* out = reinterpret_cast<c10::BFloat16*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = c10::BFloat16(f32(src[i]));
  }
}

// qkv [tokens, heads + 2 * kv_heads, dim], contiguous: rotates the query and key heads in place by the rotary
// embedding (x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb) when cos and sin ([tokens,
// dim]) are given, then copies each token's keys and values to its slot of the pools ([slots, kv_heads, dim]).
void rope_and_cache_(at::Tensor& qkv, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                     int64_t heads, int64_t kv_heads, at::Tensor& k_pool, at::Tensor& v_pool,
                     const at::Tensor& slots) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous() &&
                  qkv.size(1) == heads + 2 * kv_heads && qkv.size(2) % 2 == 0,
              "rope_and_cache_: qkv must be a contiguous CPU tensor [tokens, heads + 2 * kv_heads, even dim]");
  int64_t tokens = qkv.size(0), dim = qkv.size(2), half = dim / 2, width = heads + 2 * kv_heads;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && pools_pair_with(qkv, k_pool, v_pool) &&
                  k_pool.numel() == v_pool.numel() && k_pool.numel() % (kv_heads * dim) == 0,
              "rope_and_cache_: pools must be contiguous, of qkv's type (or 16-bit under float32), with "
              "kv_heads * dim per slot");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "rope_and_cache_: slots must be int64 [tokens]");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "rope_and_cache_: cos and sin go together");
  const bool rotate = cos.has_value();
  if (rotate) {
    TORCH_CHECK(cos->is_contiguous() && sin->is_contiguous() && cos->numel() == tokens * dim &&
                    sin->numel() == tokens * dim && cos->scalar_type() == qkv.scalar_type() &&
                    sin->scalar_type() == qkv.scalar_type(),
                "rope_and_cache_: cos and sin must be contiguous [tokens, dim] of qkv's type");
  }
  const int64_t pool_slots = k_pool.numel() / (kv_heads * dim);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < pool_slots, "rope_and_cache_: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache_", [&] {
    using T = scalar_t;
    T* qp = qkv.data_ptr<T>();
    const T* cp = rotate ? cos->data_ptr<T>() : nullptr;
    const T* snp = rotate ? sin->data_ptr<T>() : nullptr;
    const at::ScalarType pool_type = k_pool.scalar_type();
    char* kp = static_cast<char*>(k_pool.data_ptr());
    char* vp = static_cast<char*>(v_pool.data_ptr());
    const int64_t slot_bytes = kv_heads * dim * k_pool.element_size();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        T* row = qp + t * width * dim;
        if (rotate) {
          const T* c = cp + t * dim;
          const T* s = snp + t * dim;
          for (int64_t h = 0; h < heads + kv_heads; ++h) {
            T* x = row + h * dim;
            _Pragma("omp simd")
            for (int64_t j = 0; j < half; ++j) {
              float a = f32(x[j]), b = f32(x[j + half]);
              float lo = f32(round_to<T>(a * f32(c[j]))) + f32(round_to<T>(-b * f32(s[j])));
              float hi = f32(round_to<T>(b * f32(c[j + half]))) + f32(round_to<T>(a * f32(s[j + half])));
              x[j] = round_to<T>(lo);
              x[j + half] = round_to<T>(hi);
            }
          }
        }
        store_as(row + heads * dim, kv_heads * dim, pool_type, kp + sp[t] * slot_bytes);
        store_as(row + (heads + kv_heads) * dim, kv_heads * dim, pool_type, vp + sp[t] * slot_bytes);
      }
    });
  });
}

#if defined(__AVX512F__)
// 16 values of T widened to float32 lanes (float, bfloat16 and half; double keeps the plain loops).
template <typename T>
constexpr bool kWidens = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}
#endif

// q . k over dim. GCC ends an `omp simd` reduction by adding its lanes one after another (16 dependent adds),
// which made decode attention's dot products several times slower than their multiplies; with AVX-512 and the
// head size fixed (D, a multiple of 16) the sum stays in one register and ends in a shuffle tree.
template <typename T, int D>
inline float dot(const float* q, const T* k, int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (kWidens<T> && D > 0 && D % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
    for (int j = 16; j < D; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(k + j), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < dim; ++j) s += q[j] * f32(k[j]);
  return s;
}

// acc[0:value_dim] += sum over i < count of w[i] * v_i, where v_i = v + i * stride; with AVX-512 and a fixed head
// size the sums stay in registers for all count values.
template <typename T, int D>
inline void add_weighted(float* acc, const float* w, const T* v, int64_t count, int64_t stride, int64_t value_dim) {
#if defined(__AVX512F__)
  if constexpr (kWidens<T> && D > 0 && D % 16 == 0) {
    __m512 sums[D / 16];
    for (int c = 0; c < D / 16; ++c) sums[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t i = 0; i < count; ++i, v += stride) {
      const __m512 weight = _mm512_set1_ps(w[i]);
      for (int c = 0; c < D / 16; ++c) sums[c] = _mm512_fmadd_ps(weight, load16(v + 16 * c), sums[c]);
    }
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + 16 * c, sums[c]);
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i, v += stride) {
    const float weight = w[i];
#pragma omp simd
    for (int64_t j = 0; j < value_dim; ++j) acc[j] += weight * f32(v[j]);
  }
}

#if defined(__AVX512F__)
// Sixteen 16-lane vectors to one vector of their sums, in 15 shuffles and 15 adds (a horizontal sum of each would
// take about 8 dependent steps apiece). Lane l gets the sum of v[(l % 4) * 4 + l / 4].
inline __m512 sum_each(const __m512* v) {
  __m512 eight[8], four[4], two[2];
  for (int i = 0; i < 8; ++i)
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    four[i] = _mm512_add_ps(_mm512_shuffle_f32x4(eight[2 * i], eight[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(eight[2 * i], eight[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    two[i] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * i], four[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(four[2 * i], four[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88), _mm512_shuffle_ps(two[0], two[1], 0xDD));
}

// out[i] = q . k_i for the n <= 16 keys k_i = k + i * stride: sixteen independent product chains, then one
// sum_each for all of them.
template <typename T, int D>
inline void dots16(const float* q, const T* k, int64_t stride, int64_t n, float* out) {
  __m512 qv[D / 16], acc[16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int i = 0; i < 16; ++i) {
    const int slot = (i % 4) * 4 + i / 4;  // where sum_each puts key i's sum in lane i
    if (i < n) {
      const T* ki = k + i * stride;
      __m512 a = _mm512_mul_ps(qv[0], load16(ki));
      for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], load16(ki + 16 * c), a);
      acc[slot] = a;
    } else {
      acc[slot] = _mm512_setzero_ps();
    }
  }
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), sum_each(acc));
}

// acc[g][0:D] += sum over i < count of w[g * w_stride + i] * v_i for G query heads, each value read (and widened)
// once for all of them.
template <typename T, int D, int G>
inline void add_weighted_heads(float* acc, const float* w, int64_t w_stride, const T* v, int64_t count,
                               int64_t stride) {
  constexpr int C = D / 16;
  __m512 sums[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sums[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t i = 0; i < count; ++i, v += stride) {
    __m512 vi[C];
    for (int c = 0; c < C; ++c) vi[c] = load16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(w[g * w_stride + i]);
      for (int c = 0; c < C; ++c) sums[g][c] = _mm512_fmadd_ps(weight, vi[c], sums[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, sums[g][c]);
}

// add_weighted_heads for any number of heads, in register-sized runs (4 heads of 64, 2 of 128).
template <typename T, int D>
inline void add_weighted_all(float* acc, const float* w, int64_t w_stride, const T* v, int64_t count,
                             int64_t stride, int64_t heads) {
  constexpr int most = D == 64 ? 4 : 2;
  int64_t g = 0;
  for (; g + most <= heads; g += most)
    add_weighted_heads<T, D, most>(acc + g * D, w + g * w_stride, w_stride, v, count, stride);
  switch (heads - g) {
    case 3: add_weighted_heads<T, D, 3>(acc + g * D, w + g * w_stride, w_stride, v, count, stride); break;
    case 2: add_weighted_heads<T, D, 2>(acc + g * D, w + g * w_stride, w_stride, v, count, stride); break;
    case 1: add_weighted_heads<T, D, 1>(acc + g * D, w + g * w_stride, w_stride, v, count, stride); break;
    default: break;
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// The AVX2 (x86-64-v3) forms of the vector path above, on 8-lane registers. Every sum is the AVX-512 form's, bit
// for bit: a head's 16 lanes are two 8-lane registers (lanes 0-7 and 8-15) with the same multiply-add chains, and
// they end in the same tree as _mm512_reduce_add_ps and sum_each (the two halves, then the two quarters, then
// lanes 0 + 2 and 1 + 3, then those two), so the image's attention does not depend on the CPU it got.
template <typename T>
constexpr bool kWidens = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// The sum of 16 lanes held as lo (0-7) and hi (8-15), in _mm512_reduce_add_ps's order.
inline float sum16(__m256 lo, __m256 hi) {
  const __m256 u = _mm256_add_ps(hi, lo);
  const __m128 s = _mm_add_ps(_mm256_extractf128_ps(u, 1), _mm256_castps256_ps128(u));
  const __m128 t = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 1, 1, 1)));
}

// q . k as the AVX-512 form's 16 lanes: lo and hi run the chains of lanes 0-7 and 8-15.
template <typename T, int D>
inline void dot_halves(const float* q, const T* k, __m256& lo, __m256& hi) {
  lo = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), load8(k + 8));
  for (int j = 16; j < D; j += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), load8(k + j + 8), hi);
  }
}

// out[i] = q . k_i for the n <= 8 keys k_i = k + i * stride. Each key's two halves are added, then the three
// levels of sum_each run on pairs of keys at once; key i goes in at position `at` so that it comes out in lane i.
template <typename T, int D>
inline void dots8(const float* q, const T* k, int64_t stride, int64_t n, float* out) {
  __m256 u[8];
  for (int i = 0; i < 8; ++i) {
    const int at = i < 4 ? 2 * i : 2 * (i - 4) + 1;
    if (i < n) {
      __m256 lo, hi;
      dot_halves<T, D>(q, k + i * stride, lo, hi);
      u[at] = _mm256_add_ps(hi, lo);
    } else {
      u[at] = _mm256_setzero_ps();
    }
  }
  __m256 s[4], t[2];
  for (int i = 0; i < 4; ++i)  // [quarter sums of key 2i | of key 2i + 1]
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x31),
                         _mm256_permute2f128_ps(u[2 * i], u[2 * i + 1], 0x20));
  for (int i = 0; i < 2; ++i)  // lanes 0 + 2 and 1 + 3 of each key's quarter
    t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  std::copy_n(lanes, n, out);
}

// add_weighted_all's AVX2 form: acc[g][0:D] += sum over i < count of w[g * w_stride + i] * v_i, a lane's terms in
// the same order, G heads and a run of C 8-lane chunks at a time (what sixteen registers hold).
template <typename T, int D, int G, int C>
inline void add_weighted_run(float* acc, const float* w, int64_t w_stride, const T* v, int64_t count,
                             int64_t stride, int c0) {
  __m256 sums[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sums[g][c] = _mm256_loadu_ps(acc + g * D + 8 * (c0 + c));
  for (int64_t i = 0; i < count; ++i, v += stride) {
    __m256 weight[G];
    for (int g = 0; g < G; ++g) weight[g] = _mm256_set1_ps(w[g * w_stride + i]);
    for (int c = 0; c < C; ++c) {
      const __m256 vi = load8(v + 8 * (c0 + c));
      for (int g = 0; g < G; ++g) sums[g][c] = _mm256_fmadd_ps(weight[g], vi, sums[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * D + 8 * (c0 + c), sums[g][c]);
}

template <typename T, int D>
inline void add_weighted_all(float* acc, const float* w, int64_t w_stride, const T* v, int64_t count,
                             int64_t stride, int64_t heads) {
  int64_t g = 0;
  for (; g + 2 <= heads; g += 2)
    for (int c0 = 0; c0 < D / 8; c0 += 4)
      add_weighted_run<T, D, 2, 4>(acc + g * D, w + g * w_stride, w_stride, v, count, stride, c0);
  if (g < heads)
    for (int c0 = 0; c0 < D / 8; c0 += 4)
      add_weighted_run<T, D, 1, 4>(acc + g * D, w + g * w_stride, w_stride, v, count, stride, c0);
}
#endif

// The sum of x[0:n] as 16 lanes (x[i] in lane i % 16) ended in _mm512_reduce_add_ps's tree, in both vector builds
// alike (an `omp simd` reduction's order follows the vector width, so each build would round the softmax's
// total its own way).
inline float lane_sum(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  if (i < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - i)) - 1), x + i));
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(x + i));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(x + i + 8));
  }
  if (i < n) {
    alignas(32) float tail[16] = {};
    std::copy_n(x + i, n - i, tail);
    lo = _mm256_add_ps(lo, _mm256_load_ps(tail));
    hi = _mm256_add_ps(hi, _mm256_load_ps(tail + 8));
  }
  return sum16(lo, hi);
#else
  float sum = 0.f;
  _Pragma("omp simd reduction(+ : sum)")
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  return sum;
#endif
}

// One (row, key heads [kh0, kh1)) share of decode attention over keys [p0, p1) of a row: each key head's group of
// query heads (scaled, float32, q [(kh - kh0) * group + g][dim]) against each key, then the softmax's running
// terms of each query head: top the largest score, total the sum of exp(score - top), acc the sum of
// exp(score - top) * value, at index (kh - kh0) * group + g. The walk goes a block at a time and takes every key
// head of the range in a block before the next block, so a task reads its heads' part of a block as one span
// (all of it when it has every head). Taking one key head through all blocks at a time read 128 of every 640
// bytes of a block (5 key heads of 64) per pass, so memory delivered lines a pass mostly skipped; asking for blocks
// ahead does not help this order either (docs/experiments.md). Each
// head's arithmetic, and so its rounding, does not depend on the range it shares a task with. D > 0
// fixes the head size at compile time (the common 64 and 128), so the compiler keeps a head's sums in registers;
// D = 0 takes it from dim. An empty range leaves top = -inf, total = 0 and acc = 0.
template <typename T, int D>
void attend_range(const float* q, const T* kp, const T* vp, const int64_t* row_blocks, int64_t p0, int64_t p1,
                  int64_t block_size, int64_t kv_heads, int64_t kh0, int64_t kh1, int64_t group, int64_t dim_,
                  int64_t value_dim_, std::vector<float>& scores, float* top, float* total, float* acc) {
  const int64_t dim = D > 0 ? D : dim_, value_dim = D > 0 ? D : value_dim_;
  const int64_t n = p1 - p0, key_stride = kv_heads * dim, value_stride = kv_heads * value_dim;
  const int64_t heads = (kh1 - kh0) * group;  // query heads of the range
  std::fill(acc, acc + heads * value_dim, 0.f);
  for (int64_t h = 0; h < heads; ++h) top[h] = -INFINITY, total[h] = 0.f;
  if (n <= 0) return;
  scores.resize(heads * n);
  auto block_at = [&](const T* pool, int64_t p, int64_t width) {
    return pool + ((row_blocks[p / block_size] * block_size + p % block_size) * kv_heads + kh0) * width;
  };
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr bool kVector = kWidens<T> && (D == 64 || D == 128);
#else
  constexpr bool kVector = false;
#endif
  for (int64_t p = p0; p < p1;) {
    const int64_t take = std::min(block_size - p % block_size, p1 - p);
    const T* kb = block_at(kp, p, dim);
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + (kh * group + g) * dim;
        float* sg = scores.data() + (kh * group + g) * n + (p - p0);
        if constexpr (kVector) {
#if defined(__AVX512F__)
          for (int64_t i = 0; i < take; i += 16)
            dots16<T, D>(qg, kb + kh * dim + i * key_stride, key_stride, std::min<int64_t>(16, take - i), sg + i);
#elif defined(__AVX2__)
          for (int64_t i = 0; i < take; i += 8)
            dots8<T, D>(qg, kb + kh * dim + i * key_stride, key_stride, std::min<int64_t>(8, take - i), sg + i);
#endif
          continue;
        }
        for (int64_t i = 0; i < take; ++i) sg[i] = dot<T, D>(qg, kb + kh * dim + i * key_stride, dim);
      }
    }
    p += take;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores.data() + h * n;
    float t = -INFINITY;
    _Pragma("omp simd reduction(max : t)")
    for (int64_t i = 0; i < n; ++i) t = std::max(t, sh[i]);
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) sh[i] = fast_exp(sh[i] - t);
    top[h] = t, total[h] = lane_sum(sh, n);
  }
  for (int64_t p = p0; p < p1;) {
    const int64_t take = std::min(block_size - p % block_size, p1 - p);
    const T* vb = block_at(vp, p, value_dim);
    if constexpr (kVector) {
#if defined(__AVX512F__) || defined(__AVX2__)
      for (int64_t kh = 0; kh < kh1 - kh0; ++kh)
        add_weighted_all<T, D>(acc + kh * group * value_dim, scores.data() + kh * group * n + (p - p0), n,
                               vb + kh * value_dim, take, value_stride, group);
#endif
      p += take;
      continue;
    }
    for (int64_t h = 0; h < heads; ++h)
      add_weighted<T, D>(acc + h * value_dim, scores.data() + h * n + (p - p0), vb + (h / group) * value_dim, take,
                         value_stride, value_dim);
    p += take;
  }
}

// Decode attention read straight from the paged cache: each row's one query over its keys [start, length),
// start = length - window for a sliding window (0 without). query [rows, heads, dim] and out [rows, heads,
// value_dim] may have any row and head strides (views of a step's packed tensors); pools [blocks, block_size,
// kv_heads, dim]; blocks [rows * width] each row's block ids; lengths [rows]. Query head h reads key head
// h / (heads / kv_heads), as repeat_kv and SDPA's enable_gqa pair them.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& blocks, const at::Tensor& lengths, int64_t window, double scale,
                            at::Tensor& out) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1 && out.dim() == 3 &&
                  out.stride(2) == 1, "paged_decode_attention: query and out must be CPU [rows, heads, dim] "
                  "with a contiguous last dimension");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.size(0) == v_pool.size(0) && k_pool.size(1) == v_pool.size(1) &&
                  k_pool.size(2) == v_pool.size(2) && k_pool.size(3) == query.size(2),
              "paged_decode_attention: pools must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(pools_pair_with(query, k_pool, v_pool) && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: one dtype throughout (or 16-bit pools under float32)");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), value_dim = v_pool.size(3);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && out.size(0) == rows && out.size(1) == heads &&
                  out.size(2) == value_dim, "paged_decode_attention: shapes disagree");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && blocks.is_contiguous() &&
                  lengths.is_contiguous() && lengths.numel() == rows && rows > 0 && blocks.numel() % rows == 0,
              "paged_decode_attention: blocks and lengths must be int64 [rows * width] and [rows]");
  const int64_t width = blocks.numel() / rows, group = heads / kv_heads, pool_blocks = k_pool.size(0);
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lp[r] > 0 && lp[r] <= width * block_size, "paged_decode_attention: a row's length exceeds its blocks");
    longest = std::max(longest, window > 0 ? std::min(lp[r], window) : lp[r]);
  }
  for (int64_t i = 0; i < blocks.numel(); ++i) TORCH_CHECK(bp[i] >= 0 && bp[i] < pool_blocks, "paged_decode_attention: block id out of range");
  // Few rows over long contexts leave threads idle with one task per (row, key head): split each row's keys into
  // parts whose softmax terms are merged afterwards (as flash-decoding does), at least kMinSplitKeys keys a part.
  // A row's parts follow from its own length alone (as many as it would take decoding alone), never from the
  // other rows: the split changes the rounding, and a row must attend the same alone or in any batch.
  constexpr int64_t kMinSplitKeys = 256;
  const int64_t wanted = 4 * at::get_num_threads(), pairs = rows * kv_heads;
  const int64_t most_parts = (wanted + kv_heads - 1) / kv_heads;
  std::vector<int64_t> row_parts(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = window > 0 ? std::min(lp[r], window) : lp[r];
    row_parts[r] = std::max<int64_t>(1, std::min(most_parts, n / kMinSplitKeys));
  }
  const int64_t parts = std::min(most_parts, std::max<int64_t>(1, longest / kMinSplitKeys));  // tasks per pair
  // A task takes a span of a row's key heads over one part of its keys: all of them when the rows' parts keep
  // every thread busy, so it reads its blocks whole, else fewer (the split does not change any head's arithmetic).
  const int64_t threads = at::get_num_threads();
  const int64_t spans = std::min(kv_heads, std::max<int64_t>(1, (2 * threads + rows * parts - 1) / (rows * parts)));
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  // Each part's terms: top and total [pairs * parts, group], acc [pairs * parts, group, value_dim]. With one part a
  // row (short contexts: every step of a few streams) each task finishes its own heads instead, and the merge's
  // parallel region and these buffers are not needed.
  const bool split = parts > 1;
  const int64_t terms = split ? pairs * parts * group : 0;
  std::vector<float> tops(terms), totals(terms), accs(terms * value_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    using T = scalar_t;
    const T* qp = query.data_ptr<T>();
    T* op = out.data_ptr<T>();
    // Walks the pools as their own type P (T, or 16-bit under float32 queries: engine KV_CACHE_DTYPE).
    auto attend_all = [&](const auto* kp, const auto* vp) {
      using P = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      // The head sizes with a compiled-in size (see attend_range), else the one that reads it from dim.
      const auto attend = dim == 64 && value_dim == 64     ? &attend_range<P, 64>
                          : dim == 128 && value_dim == 128 ? &attend_range<P, 128>
                                                           : &attend_range<P, 0>;
      // One task per (row, part, span of key heads): the query heads of a key head share every key and value read.
      at::parallel_for(0, rows * parts * spans, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(heads * dim), scores, top(heads), total(heads), acc(heads * value_dim);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / (parts * spans), part = task / spans % parts, span = task % spans;
          const int64_t kh0 = kv_heads * span / spans, kh1 = kv_heads * (span + 1) / spans;
          const int64_t length = lp[r], start = window > 0 ? std::max<int64_t>(0, length - window) : 0;
          const int64_t own = row_parts[r];  // parts past the row's own are left empty
          const int64_t n = part < own ? length - start : 0;
          const int64_t p0 = start + n * part / own, p1 = start + n * (part + 1) / own;
          const int64_t h0 = kh0 * group, count = (kh1 - kh0) * group;
          for (int64_t h = 0; h < count; ++h) {
            const T* src = qp + r * q_row + (h0 + h) * q_head;
            for (int64_t j = 0; j < dim; ++j) q[h * dim + j] = f32(src[j]) * static_cast<float>(scale);
          }
          attend(q.data(), kp, vp, bp + r * width, p0, p1, block_size, kv_heads, kh0, kh1, group, dim, value_dim,
                 scores, top.data(), total.data(), acc.data());
          if (!split) {  // the row's one part: normalised into out as the merge computes it, bit for bit
            for (int64_t h = 0; h < count; ++h) {
              const float inv = 1.f / (0.f + total[h]);
              T* dst = op + r * o_row + (h0 + h) * o_head;
              for (int64_t j = 0; j < value_dim; ++j) dst[j] = round_to<T>((0.f + acc[h * value_dim + j]) * inv);
            }
            continue;
          }
          for (int64_t kh = kh0; kh < kh1; ++kh) {  // into the (row, key head, part) slots the merge reads
            const int64_t at = (r * kv_heads + kh) * parts + part, from = (kh - kh0) * group;
            std::copy_n(top.data() + from, group, tops.data() + at * group);
            std::copy_n(total.data() + from, group, totals.data() + at * group);
            std::copy_n(acc.data() + from * value_dim, group * value_dim, accs.data() + at * group * value_dim);
          }
        }
      });
    };
    if (k_pool.scalar_type() == query.scalar_type()) {
      attend_all(k_pool.data_ptr<T>(), v_pool.data_ptr<T>());
    } else if (k_pool.scalar_type() == at::kHalf) {
      attend_all(k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>());
    } else {
      attend_all(k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>());
    }
    // Merge each (row, key head)'s parts: rescale every part's terms to the largest top, then normalise.
    if (!split) return;
    at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> merged(value_dim);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t r = pair / kv_heads, kh = pair % kv_heads;
        for (int64_t g = 0; g < group; ++g) {
          float top = -INFINITY, total = 0.f;
          const int64_t own = row_parts[r];
          for (int64_t part = 0; part < own; ++part) top = std::max(top, tops[(pair * parts + part) * group + g]);
          std::fill(merged.begin(), merged.end(), 0.f);
          for (int64_t part = 0; part < own; ++part) {
            const int64_t at = (pair * parts + part) * group + g;
            if (totals[at] == 0.f) continue;  // an empty part
            const float factor = own == 1 ? 1.f : fast_exp(tops[at] - top);
            total += totals[at] * factor;
            const float* a = accs.data() + at * value_dim;
            _Pragma("omp simd")
            for (int64_t j = 0; j < value_dim; ++j) merged[j] += a[j] * factor;
          }
          const float inv = 1.f / total;
          T* dst = op + r * o_row + (kh * group + g) * o_head;
          for (int64_t j = 0; j < value_dim; ++j) dst[j] = round_to<T>(merged[j] * inv);
        }
      }
    });
  });
}

// engine/cpu/native/quantized_linear.cpp
bool blocks_supported();
bool word_blocks_supported();
bool quad_blocks_supported();
std::tuple<int64_t, at::Tensor> pack_blocks(const at::Tensor& weight, bool words, bool quads);
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);
at::Tensor blocks_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& formats, const std::vector<int64_t>& outs,
                               const c10::optional<at::Tensor>& bias);
std::tuple<int64_t, at::Tensor> pack_scaled(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minimum,
                                            int64_t bits, bool half, bool quads, bool centered);
std::tuple<int64_t, at::Tensor> pack_coded(const at::Tensor& q, const at::Tensor& scale, const std::string& table);
std::tuple<int64_t, at::Tensor> pack_super(const at::Tensor& q, const at::Tensor& big_d, const at::Tensor& s,
                                           const at::Tensor& big_m, const at::Tensor& t, int64_t bits, bool quads);
std::tuple<int64_t, at::Tensor> pack_six_bit(const at::Tensor& q, const at::Tensor& big_d, const at::Tensor& s,
                                             bool quads);
std::tuple<int64_t, at::Tensor> pack_zero_points(const at::Tensor& q, const at::Tensor& d, const at::Tensor& z,
                                                 bool quads);
std::tuple<int64_t, at::Tensor> pack_groups(const at::Tensor& q, const at::Tensor& d, const at::Tensor& z,
                                            bool quads);
std::tuple<int64_t, at::Tensor> pack_eight_by_128(const at::Tensor& q, const at::Tensor& d, bool quads);
// engine/cpu/native/prefill_attention.cpp
bool prefill_attention_supported();
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                             const at::Tensor& blocks, int64_t start, int64_t window, double scale, at::Tensor& out,
                             bool bf16_products);
// engine/cpu/native/bf16_linear.cpp
bool bf16_linear_supported();
bool bf16_weights_supported();
double bf16_peak_gflops(double seconds);
at::Tensor bf16_pack(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool widen);

// engine/cpu/native/lora_linear.cpp
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& bs,
               const at::Tensor& slots, int64_t rank);
// engine/cpu/native/decode_stack.cpp
void register_decode_stack(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every computing call lets other Python threads run while it works: the server's event loop (streams, /health,
  // the platform's job requests) runs beside the engine's thread, and a prompt chunk's product can take a second.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil, "RMS norm of the last dimension");
  m.def("add_rms_norm_", &add_rms_norm_, nogil, "delta += residual in place; the RMS norm of the sum");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of a fused gate-and-up product");
  m.def("draw_tokens", &draw_tokens, nogil,
        "one token a row drawn from softmax(logits * scale) with the row's uniform number");
  m.def("rope_and_cache_", &rope_and_cache_, nogil, "rotary embedding in place, then the keys and values to the cache");
  m.def("paged_decode_attention", &paged_decode_attention, nogil, "decode attention over the paged cache's blocks");
  m.def("prefill_attention_supported", &prefill_attention_supported, "whether this build has prefill attention");
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil,
        "a prompt chunk's causal attention over the paged cache",
        py::arg("query"), py::arg("k_pool"), py::arg("v_pool"), py::arg("blocks"), py::arg("start"), py::arg("window"),
        py::arg("scale"), py::arg("out"), py::arg("bf16_products") = true);
  m.def("blocks_supported", &blocks_supported, "whether this build has the block product");
  m.def("word_blocks_supported", &word_blocks_supported, "whether this build has the product for 16-bit activations");
  m.def("quad_blocks_supported", &quad_blocks_supported, "whether this build has the product for 8-bit activations");
  m.def("pack_blocks", &pack_blocks, nogil,
        "(format, blocks): a float32 weight's exact Q4_1 or Q8_0 blocks, or (0, empty)",
        py::arg("weight"), py::arg("words") = false, py::arg("quads") = false);
  m.def("blocks_linear", &blocks_linear, nogil,
        "x times a weight packed by pack_blocks or pack_scaled (+ bias), in x's dtype",
        py::arg("x"), py::arg("packed"), py::arg("format"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("blocks_linear_parts", &blocks_linear_parts, nogil,
        "x times several packed weights, their outputs side by side "
        "(+ bias), in x's dtype", py::arg("x"), py::arg("packed"), py::arg("formats"), py::arg("outs"),
        py::arg("bias") = py::none());
  m.def("pack_scaled", &pack_scaled, nogil,
        "(format, blocks): a quantized checkpoint's w = scale * q + minimum per 32 inputs",
        py::arg("q"), py::arg("scale"), py::arg("minimum"), py::arg("bits"), py::arg("half") = false,
        py::arg("quads") = false, py::arg("centered") = false);
  m.def("pack_coded", &pack_coded, nogil,
        "(format, blocks): 4-bit codes of bitsandbytes' nf4 or fp4 table times a scale "
        "per 32 inputs", py::arg("q"), py::arg("scale"), py::arg("table"));
  m.def("pack_super", &pack_super, nogil, "(format, blocks): GGUF Q4_K / Q5_K blocks with their two-level scales "
        "(w = D s q - M t)", py::arg("q"), py::arg("big_d"), py::arg("s"), py::arg("big_m"), py::arg("t"),
        py::arg("bits"), py::arg("quads") = false);
  m.def("pack_six_bit", &pack_six_bit, nogil, "(27, blocks): GGUF Q6_K blocks as the file holds them (w = D s q per 16 "
        "inputs); (30, blocks) with `quads`", py::arg("q"), py::arg("big_d"), py::arg("s"), py::arg("quads") = false);
  m.def("pack_zero_points", &pack_zero_points, nogil,
        "(28, blocks): 4-bit q with a zero point per 32 inputs (w = d (q - "
        "z))", py::arg("q"), py::arg("d"), py::arg("z"), py::arg("quads") = false);
  m.def("pack_groups", &pack_groups, nogil,
        "(31-34, blocks): 4-bit q with a scale (and zero point, where z is not empty) per 64 or 128 inputs",
        py::arg("q"), py::arg("d"), py::arg("z"), py::arg("quads") = false);
  m.def("pack_eight_by_128", &pack_eight_by_128, nogil,
        "(43, blocks): 8-bit q with a float32 scale per 128 inputs (w = d q); (44, blocks) with `quads`",
        py::arg("q"), py::arg("d"), py::arg("quads") = false);
  m.def("bf16_linear_supported", &bf16_linear_supported, "whether this build and CPU have the AVX512_BF16 product");
  m.def("bf16_weights_supported", &bf16_weights_supported,
        "whether this build multiplies float32 rows by bfloat16 weights (bf16_linear)");
  m.def("bf16_peak_gflops", &bf16_peak_gflops, nogil, "VDPBF16PS's rate on every thread for about `seconds` (0: none)",
        py::arg("seconds") = 0.2);
  m.def("bf16_pack", &bf16_pack, nogil, "a bfloat16 weight laid out for bf16_linear");
  m.def("bf16_linear", &bf16_linear, nogil, "bfloat16 or float32 rows times a weight packed by bf16_pack (+ bias), in "
        "the rows' type; `widen`: bfloat16 rows by float32 FMAs instead of VDPBF16PS", py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("widen") = false);
  m.def("lora_add_", &lora_add_, nogil, "y += each row's LoRA term from its adapter slot (slot 0: none)");
  register_decode_stack(m);
}
