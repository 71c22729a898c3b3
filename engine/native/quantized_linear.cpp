// Linear layers whose float32 weights are exactly the values of GGUF Q4_1 or Q8_0 blocks
// (engine/quantized_weights.py finds them and calls these): the product runs from the blocks, 6 or 9 bits a
// weight instead of 32.
//
// Why: a decode step of a small model at a few rows streams every weight from memory, so float32 weights that
// a 4- or 8-bit file expanded cost several times the bytes they carry. A block holds 32 consecutive weights of
// one output: Q4_1 as w = d * q + m with q in 0..15, Q8_0 as w = d * q with q in -127..127, the scale d and the
// minimum m half-precision numbers. `pack_blocks` recovers d, m and q from the float32 weights and keeps them
// only where every weight equals fl(fl(q * d) + m) (Q4_1) or fl(q * d) (Q8_0) bit for bit, so the product
// multiplies by exactly the model's weights; only the order of the sums differs from a float32 product.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel: one 16-lane register
constexpr int64_t kBlock = 32;  // weights per block, along the input dimension

// The two block formats, as the product stores them: per (panel of 16 outputs, block of 32 inputs) the 16
// scales as float32, Q4_1's 16 minimums as float32, then for each of the 32 inputs the 16 outputs' q: Q4_1 in
// 8 bytes (output i in the low nibble of byte i, output i + 8 in the high one), Q8_0 in 16 signed bytes.
enum Format : int64_t { kNone = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t header_bytes(Format f) { return (f == kQ4_1 ? 2 : 1) * kPanel * 4; }
constexpr int64_t input_bytes(Format f) { return f == kQ4_1 ? kPanel / 2 : kPanel; }
constexpr int64_t block_bytes(Format f) { return header_bytes(f) + kBlock * input_bytes(f); }

float half_value(uint16_t bits) { return static_cast<float>(at::Half(bits, at::Half::from_bits())); }

// One output's block of 32 weights -> its scale, minimum and q, or false where no half-precision scale (the one
// nearest the format's choice or a neighbour) and minimum give back every weight exactly.
template <Format F>
bool recover_block(const float* w, float& scale, float& minimum, int8_t* q) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kBlock; ++i) lo = std::min(lo, w[i]), hi = std::max(hi, w[i]);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  // Q4_1 maps the block's minimum to q = 0 and its range to 15 steps; Q8_0 its largest magnitude to 127 steps.
  const float m = F == kQ4_1 ? lo : 0.f;
  if (static_cast<float>(at::Half(m)) != m) return false;
  const uint16_t bits = at::Half(F == kQ4_1 ? (hi - lo) / 15.0f : std::max(-lo, hi) / 127.0f).x;
  const uint16_t candidates[3] = {bits, static_cast<uint16_t>(bits + 1), static_cast<uint16_t>(bits ? bits - 1 : 0)};
  const float q_min = F == kQ4_1 ? 0.f : -127.f, q_max = F == kQ4_1 ? 15.f : 127.f;
  for (uint16_t c : candidates) {
    const float d = half_value(c);
    if (!std::isfinite(d) || d < 0.f) continue;
    bool exact = true;
    for (int i = 0; i < kBlock && exact; ++i) {
      const float qi = d == 0.f ? 0.f : std::nearbyint((w[i] - m) / d);
      if (qi < q_min || qi > q_max) {
        exact = false;
        break;
      }
      volatile float scaled = qi * d;  // rounded on its own, as the expansion to float32 did
      exact = (F == kQ4_1 ? scaled + m : scaled) == w[i];
      q[i] = static_cast<int8_t>(qi);
    }
    if (exact) {
      scale = d, minimum = m;
      return true;
    }
  }
  return false;
}

template <Format F>
bool pack_panel(const float* w, int64_t k, uint8_t* out) {
  int8_t q[kPanel][kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    uint8_t* dst = out + b * block_bytes(F);
    float scales[kPanel], minimums[kPanel];
    for (int64_t i = 0; i < kPanel; ++i)
      if (!recover_block<F>(w + i * k + b * kBlock, scales[i], minimums[i], q[i])) return false;
    std::memcpy(dst, scales, sizeof scales);
    if (F == kQ4_1) std::memcpy(dst + sizeof scales, minimums, sizeof minimums);
    uint8_t* qs = dst + header_bytes(F);
    for (int64_t j = 0; j < kBlock; ++j) {
      if (F == kQ4_1) {
        for (int64_t i = 0; i < kPanel / 2; ++i)
          qs[j * kPanel / 2 + i] = static_cast<uint8_t>(q[i][j] | (q[i + kPanel / 2][j] << 4));
      } else {
        for (int64_t i = 0; i < kPanel; ++i) qs[j * kPanel + i] = static_cast<uint8_t>(q[i][j]);
      }
    }
  }
  return true;
}

}  // namespace

bool blocks_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

// The 16 weights of input j in a panel's block: fl(fl(q * d) + m) for Q4_1, fl(q * d) for Q8_0.
template <Format F>
inline __m512 weights_at(const uint8_t* block, int64_t j) {
  const float* header = reinterpret_cast<const float*>(block);
  const uint8_t* qs = block + header_bytes(F) + j * input_bytes(F);
  __m512 q;
  if constexpr (F == kQ4_1) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high)));
    return _mm512_add_ps(_mm512_mul_ps(q, _mm512_loadu_ps(header)), _mm512_loadu_ps(header + kPanel));
  } else {
    q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    return _mm512_mul_ps(q, _mm512_loadu_ps(header));
  }
}

// A panel's weights expanded to float32, [k, stride] from column 0.
template <Format F>
void expand_panel(const uint8_t* panel, int64_t k, float* w, int64_t stride) {
  for (int64_t b = 0; b < k / kBlock; ++b)
    for (int64_t j = 0; j < kBlock; ++j)
      _mm512_storeu_ps(w + (b * kBlock + j) * stride, weights_at<F>(panel + b * block_bytes(F), j));
}

// Both products below sum each output's terms in input order, one fused multiply-add per weight, so a row's
// result does not depend on how many rows share the call: a prompt embeds the same alone or in a batch. (Scaling
// once per block for few rows, d * sum(x q) + m * sum(x), ran 1.06x faster at 1 row but broke that.)

// R rows (R <= 16) times one panel, expanding its weights in registers as they stream in: for few rows, where
// the product is bound by reading the weights.
template <Format F, int R>
void rows_by_panel(const float* x, int64_t k, const uint8_t* panel, float* out, int64_t n) {
  __m512 sums[R];
  for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* block = panel + b * block_bytes(F);
    const float* xb = x + b * kBlock;
    for (int64_t j = 0; j < kBlock; ++j) {
      const __m512 w = weights_at<F>(block, j);
      for (int r = 0; r < R; ++r) sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * k + j]), w, sums[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * n, sums[r]);
}

// R rows (R <= 12) times P panels (1 or 2) already expanded to float32 ([k, P * 16]): for more rows, where each
// expanded weight serves every row and the product is bound by the multiplies.
template <int R, int P>
void rows_by_expanded(const float* x, int64_t k, const float* w, float* out, int64_t n) {
  __m512 sums[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) sums[p][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    __m512 wj[P];
    for (int p = 0; p < P; ++p) wj[p] = _mm512_loadu_ps(w + j * P * kPanel + p * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + j]);
      for (int p = 0; p < P; ++p) sums[p][r] = _mm512_fmadd_ps(xv, wj[p], sums[p][r]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * n + p * kPanel, sums[p][r]);
}

constexpr int kStreamRows = 16, kExpandedRows = 12;
using StreamFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t);
using ExpandedFn = void (*)(const float*, int64_t, const float*, float*, int64_t);

template <Format F, int... I>
constexpr std::array<StreamFn, sizeof...(I)> stream_table(std::integer_sequence<int, I...>) {
  return {&rows_by_panel<F, I + 1>...};
}
template <int P, int... I>
constexpr std::array<ExpandedFn, sizeof...(I)> expanded_table(std::integer_sequence<int, I...>) {
  return {&rows_by_expanded<I + 1, P>...};
}
const auto kStreamQ4 = stream_table<kQ4_1>(std::make_integer_sequence<int, kStreamRows>{});
const auto kStreamQ8 = stream_table<kQ8_0>(std::make_integer_sequence<int, kStreamRows>{});
const auto kExpanded1 = expanded_table<1>(std::make_integer_sequence<int, kExpandedRows>{});
const auto kExpanded2 = expanded_table<2>(std::make_integer_sequence<int, kExpandedRows>{});

template <Format F>
void product(const float* x, int64_t rows, int64_t k, const uint8_t* packed, float* out, int64_t n) {
  const int64_t panels = n / kPanel, panel_bytes = (k / kBlock) * block_bytes(F);
  if (rows <= kStreamRows) {
    const auto& stream = F == kQ4_1 ? kStreamQ4 : kStreamQ8;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) stream[rows - 1](x, k, packed + p * panel_bytes, out + p * kPanel, n);
    });
    return;
  }
  // Pairs of panels: each expanded once into a buffer that stays in cache, then multiplied by every row.
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(k * 2 * kPanel);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t first = 2 * pair, width = std::min<int64_t>(2, panels - first);
      for (int64_t p = 0; p < width; ++p)
        expand_panel<F>(packed + (first + p) * panel_bytes, k, w.data() + p * kPanel, width * kPanel);
      // Row tiles of even sizes (17 rows: 9 + 8, not 12 + 5): a small last tile leaves multiply units idle.
      const int64_t tiles = (rows + kExpandedRows - 1) / kExpandedRows, tile = (rows + tiles - 1) / tiles;
      for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t r = std::min<int64_t>(tile, rows - r0);
        (width == 2 ? kExpanded2 : kExpanded1)[r - 1](x + r0 * k, k, w.data(), out + r0 * n + first * kPanel, n);
      }
    }
  });
}

}  // namespace
#endif

namespace {

template <Format F>
at::Tensor pack_as(const float* w, int64_t n, int64_t k) {
  const int64_t panels = n / kPanel, panel_bytes = (k / kBlock) * block_bytes(F);
  auto packed = at::empty({panels, panel_bytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    std::vector<float> expanded(k * kPanel);
#endif
    for (int64_t p = begin; p < end && exact.load(std::memory_order_relaxed); ++p) {
      if (!pack_panel<F>(w + p * kPanel * k, k, out + p * panel_bytes)) {
        exact = false;
        return;
      }
#if defined(__AVX512F__)
      // The product expands the blocks with its own arithmetic: check that it gives back every weight bit for
      // bit (a compiler that fused q * d + m into one rounding would not).
      expand_panel<F>(out + p * panel_bytes, k, expanded.data(), kPanel);
      for (int64_t i = 0; i < kPanel; ++i)
        for (int64_t j = 0; j < k; ++j)
          if (expanded[j * kPanel + i] != w[(p * kPanel + i) * k + j]) exact = false;
#endif
    }
  });
  return exact ? packed : at::Tensor();
}

}  // namespace

// weight float32 [out, in] (any strides) -> (format, blocks): 1 and the Q4_1 blocks, 2 and the Q8_0 blocks, in
// the product's layout ([out / 16, bytes per panel]), or 0 and an empty tensor where the weight is exactly
// neither, its shape does not divide into panels and blocks, or this build has no product.
std::tuple<int64_t, at::Tensor> pack_blocks(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_blocks: weight must be a float32 CPU matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (!blocks_supported() || n % kPanel || k % kBlock || n == 0 || k == 0) return {kNone, at::empty({0}, at::kByte)};
  // The first block decides for weights of any other origin, before a copy of the whole matrix.
  const at::Tensor first = weight[0].narrow(0, 0, kBlock).contiguous();
  float scale, minimum;
  int8_t q[kBlock];
  if (!recover_block<kQ4_1>(first.data_ptr<float>(), scale, minimum, q) &&
      !recover_block<kQ8_0>(first.data_ptr<float>(), scale, minimum, q))
    return {kNone, at::empty({0}, at::kByte)};
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = pack_as<kQ4_1>(w.data_ptr<float>(), n, k);
  if (packed.defined()) return {kQ4_1, packed};
  packed = pack_as<kQ8_0>(w.data_ptr<float>(), n, k);
  if (packed.defined()) return {kQ8_0, packed};
  return {kNone, at::empty({0}, at::kByte)};
}

// x float32 [rows, in] (contiguous) times the weight `pack_blocks` packed as `format`, [out, in] -> [rows, out].
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features) {
  TORCH_CHECK(blocks_supported(), "blocks_linear: this build has no block product (it needs AVX-512)");
  TORCH_CHECK(format == kQ4_1 || format == kQ8_0, "blocks_linear: unknown format");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "blocks_linear: x must be a contiguous float32 CPU matrix [rows, in]");
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  const int64_t bytes = block_bytes(static_cast<Format>(format));
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 && k % kBlock == 0 &&
                  n % kPanel == 0 && packed.size(0) == n / kPanel && packed.size(1) == (k / kBlock) * bytes,
              "blocks_linear: packed weight does not match x, format and out_features");
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX512F__)
  if (rows > 0) {
    if (format == kQ4_1)
      product<kQ4_1>(x.data_ptr<float>(), rows, k, packed.data_ptr<uint8_t>(), out.data_ptr<float>(), n);
    else
      product<kQ8_0>(x.data_ptr<float>(), rows, k, packed.data_ptr<uint8_t>(), out.data_ptr<float>(), n);
  }
#endif
  return out;
}
