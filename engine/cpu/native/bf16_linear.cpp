// The product of a few bfloat16 rows by a bfloat16 weight with AVX512_BF16 (engine/cpu/bf16_weights.py calls it).
//
// Why: a decode step at a few rows streams every weight from memory once, so its speed is the speed weights are
// read at. oneDNN's packed bfloat16 product read a step's weights well below the machine's copy bandwidth.
// This kernel reads the weight as one sequential stream per thread, in the order it multiplies it:
// `bf16_pack` lays the weight out once, in panels of 64 outputs (4 blocks of 16), each panel input pair by input
// pair: for pair g the 16 outputs of block j hold (w[o][2g], w[o][2g + 1]) side by side, 64 bytes, exactly the
// 32 bfloat16 that one VDPBF16PS multiplies by a broadcast pair of inputs into 16 float32 sums. A register tile of
// up to 6 rows by 4 blocks (24 sums) takes each weight load 6 times, so batches and prompt chunks run from the
// same copy: a panel (at most 4 x 16 x K x 2 bytes, 320 KB at K = 2560) stays in L2 while every row tile of a
// call passes over it. Sums are float32 in input-pair order, the bias is added in float32 and the result rounded
// once to bfloat16 (round to nearest even), as oneDNN does. Each row's sums do not depend on the other rows.
//
// `widen`: the same copy multiplied with float32 FMAs instead. Each 64 bytes widen to two registers of float32
// weights (input 2g: the pair's low halves shifted up 16 bits; input 2g + 1: the high halves masked), each product
// exact and rounded once as it is added, where VDPBF16PS adds a pair's two products into a sum at once. Some CPUs
// run VDPBF16PS at half the rate of their float32 FMAs, where prompt chunks, bound by the multiplies, run faster
// this way; at a few rows both are bound by reading the weights. engine/cpu/bf16_weights.py times the two and
// keeps one for every batch size.
// ATen's tensor and the few operators used, not <torch/extension.h>: that header (the whole C++ frontend and
// pybind11) costs each file most of its compile time, and only the files that bind to Python need it.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>
#define LLM_BF16_PRODUCT 1
#endif

namespace {

constexpr int64_t kLanes = 16;       // outputs per block: one register of float32 sums
constexpr int64_t kPanelBlocks = 4;  // blocks per panel
constexpr int64_t kPanel = kLanes * kPanelBlocks;
constexpr int kMaxRows = 6;          // rows per register tile (6 x 4 sums + 4 weights + a broadcast: 29 registers)
constexpr int64_t kStagedTiles = 32;  // row tiles from which float32 FMAs widen a panel once for all of them

int64_t pairs_of(int64_t in_features) { return (in_features + 1) / 2; }

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "bf16_pack: a 2-D bfloat16 CPU weight is needed");
}

#if defined(LLM_BF16_PRODUCT)

// Rows r0..r0+R of x (row stride xs elements, K inputs) by one panel of NB blocks; sums out to `out` (row stride
// os, N outputs, block `first` of the panel is output first * 16), bias (float32 of N) or null.
// A span of weight bytes a tile's pass pulls toward L2 as it goes: a share of the next panel (see bf16_linear).
struct Ahead {
  const char* at = nullptr;   // next line to request
  const char* end = nullptr;  // end of this pass's share
  int64_t lines = 0;          // lines requested per input pair
};

// The float32 value of a bfloat16 (its bits are the top half of the float's).
inline float widened(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

// acc[r][j] += the pair's products of rows r with block j's 64 bytes at w, by VDPBF16PS or (Widen) float32 FMAs.
// `xw`: the rows' inputs as float32 (row stride xs; Widen only), `x` as bfloat16; `k` the pair's first input and
// `both` whether its second is an input too (not the zero the packing added after an odd last input).
template <int R, int NB, bool Widen>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
inline void pair_products(__m512 (&acc)[R][NB], const uint16_t* w, const uint16_t* x, const float* xw, int64_t xs,
                          int64_t k, bool both) {
  if constexpr (Widen) {
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int j = 0; j < NB; ++j) {
      const __m512i packed = _mm512_loadu_si512(w + j * 32);
      const __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
      const __m512 second = _mm512_castsi512_ps(_mm512_and_si512(packed, high));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xw[r * xs + k]), first, acc[r][j]);
        if (both) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xw[r * xs + k + 1]), second, acc[r][j]);
      }
    }
  } else {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair = static_cast<int32_t>(x[r * xs + k]);
      if (both) std::memcpy(&pair, x + r * xs + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
}

// The tile's sums (+ bias) rounded once to bfloat16 into its rows' outputs.
template <int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))
inline void store_sums(__m512 (&acc)[R][NB], int64_t first_out, int64_t N, const float* bias, uint16_t* out,
                       int64_t os) {
  for (int j = 0; j < NB; ++j) {
    const int64_t o = first_out + j * kLanes;
    const int64_t lanes = N - o < kLanes ? N - o : kLanes;
    const __mmask16 mask = lanes == kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + o) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(out + r * os + o, mask, rounded);
    }
  }
}

template <int R, int NB, bool Widen>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void panel_tile(const uint16_t* x, const float* xw, int64_t xs, int64_t K, const uint16_t* panel, int64_t first_out,
                int64_t N, const float* bias, uint16_t* out, int64_t os, Ahead next) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  const uint16_t* w = panel;
  constexpr int64_t step = NB * 32;  // elements of one input pair across the panel's blocks
  constexpr int64_t ahead = 16 * step;  // prefetch distance: 16 pairs (4 KB for a full panel)
  for (int64_t g = 0; g < full; ++g, w += step) {
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + j * 32), _MM_HINT_T0);
    for (int64_t l = 0; l < next.lines && next.at < next.end; ++l, next.at += 64) _mm_prefetch(next.at, _MM_HINT_T1);
    pair_products<R, NB, Widen>(acc, w, x, xw, xs, 2 * g, true);
  }
  // the last input alone: its pair's second weight is a zero the packing added, its input is zero too
  if (K & 1) pair_products<R, NB, Widen>(acc, w, x, xw, xs, K - 1, false);
  store_sums<R, NB>(acc, first_out, N, bias, out, os);
}

// The float32 panel `widen_panel` made ([K][NB][16]) by rows r0..r0+R of the float32 rows xw: each weight load
// serves R rows and each broadcast input NB blocks, 24 FMAs to 10 loads and nothing else in the loop.
template <int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void wide_tile(const float* xw, int64_t xs, int64_t K, const float* wide, int64_t first_out, int64_t N,
               const float* bias, uint16_t* out, int64_t os) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* w = wide;
  for (int64_t k = 0; k < K; ++k, w += NB * kLanes) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(xw[r * xs + k]);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(b, wv[j], acc[r][j]);
    }
  }
  store_sums<R, NB>(acc, first_out, N, bias, out, os);
}

// A panel of nb blocks widened to float32 once, [K rounded up to pairs][nb][16], for the wide tiles.
__attribute__((target("avx512f,avx512bw")))
void widen_panel(const uint16_t* panel, int nb, int64_t K2, float* wide) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t g = 0; g < K2; ++g)
    for (int j = 0; j < nb; ++j) {
      const __m512i packed = _mm512_loadu_si512(panel + (g * nb + j) * 32);
      _mm512_storeu_ps(wide + (2 * g * nb + j) * kLanes, _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16)));
      _mm512_storeu_ps(wide + ((2 * g + 1) * nb + j) * kLanes, _mm512_castsi512_ps(_mm512_and_si512(packed, high)));
    }
}

// f.template operator()<R, NB>() for a register tile of `rows` rows (1 to kMaxRows) by `nb` blocks (1 to
// kPanelBlocks): both tile kinds take their shape through this one dispatch.
template <int R = kMaxRows, typename F>
void with_tile_shape(int rows, int nb, const F& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_tile_shape<R - 1>(rows, nb, f);
  }
  switch (nb) {
    case 4: return f.template operator()<R, 4>();
    case 3: return f.template operator()<R, 3>();
    case 2: return f.template operator()<R, 2>();
    default: return f.template operator()<R, 1>();
  }
}

// One thread's VDPBF16PS rate (GFLOP/s) over about `seconds`: 12 independent sums hide the instruction's latency.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
double peak_loop(double seconds) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  constexpr int64_t kRound = 1 << 16;  // iterations between clock reads
  int64_t rounds = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0.0;
  do {
    for (int64_t i = 0; i < kRound; ++i) {
      for (auto& x : acc) x = _mm512_dpbf16_ps(x, a, b);
      __asm__ volatile("" : "+v"(a));  // keeps the compiler from folding the loop
    }
    ++rounds;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  float sink = 0.f;
  for (auto& x : acc) sink += _mm512_reduce_add_ps(x);
  __asm__ volatile("" : : "x"(sink));
  return rounds * kRound * 12 * 64.0 / elapsed / 1e9;
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

#endif

}  // namespace

// This machine's arithmetic limit for the product: every thread multiplies with VDPBF16PS alone for about
// `seconds` (12 independent sums, no loads), and the rate of all of them together, in GFLOP/s (64 a VDPBF16PS).
// bench/throughput.py reports prefill against it, since torch.mm's bfloat16 rate understates the instruction's.
double bf16_peak_gflops(double seconds) {
#if defined(LLM_BF16_PRODUCT)
  if (!cpu_has_bf16()) return 0.0;
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rates[t] = peak_loop(seconds);
  });
  double total = 0.0;
  for (double r : rates) total += r;
  return total;
#else
  (void)seconds;
  return 0.0;
#endif
}

bool bf16_linear_supported() {
#if defined(LLM_BF16_PRODUCT)
  return cpu_has_bf16();
#else
  return false;
#endif
}

// weight [N, K] (any strides) -> the panels described above, zero-padded to whole blocks and input pairs.
at::Tensor bf16_pack(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = pairs_of(K);
  const int64_t blocks = (N + kLanes - 1) / kLanes, panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  at::Tensor packed = at::zeros({blocks * kLanes * K2 * 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t nb = std::min(kPanelBlocks, blocks - p * kPanelBlocks);
      uint16_t* panel = dst + p * kPanel * K2 * 2;
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t i = 0; i < kLanes; ++i) {
          const int64_t o = (p * kPanelBlocks + j) * kLanes + i;
          if (o >= N) break;
          const uint16_t* row = src + o * K;
          for (int64_t k = 0; k < K; ++k) panel[((k / 2 * nb + j) * kLanes + i) * 2 + (k & 1)] = row[k];
        }
    }
  });
  return packed;
}

// x [M, K] bfloat16 by the weight `bf16_pack` made of a [N, K] weight (+ bias [N]) -> [M, N] bfloat16; `widen`:
// by float32 FMAs (see the top of this file).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool widen) {
#if defined(LLM_BF16_PRODUCT)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear: x must be a contiguous 2-D bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, K2 = pairs_of(K);
  const int64_t blocks = (N + kLanes - 1) / kLanes, panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.numel() == blocks * kLanes * K2 * 2,
              "bf16_linear: the packed weight does not match x and out_features");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias size");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  std::vector<float> x_wide(widen ? M * K : 0);  // the rows as float32 once, for the FMAs' broadcasts
  for (int64_t i = 0; i < static_cast<int64_t>(x_wide.size()); ++i) x_wide[i] = widened(xp[i]);
  const float* xw = x_wide.data();
  // Row tiles of nearly equal size (8 rows: 4 + 4, not 6 + 2).
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t panel_bytes = kPanel * K2 * 2 * 2;
  // Float32 FMAs over many row tiles widen each panel once into a float32 copy the tiles share (`wide_tile`),
  // rather than in every tile's pass, where the two widening operations of each weight load take the FMAs' ports.
  // With few tiles the copy costs more than it saves, hence kStagedTiles. The sums are the same FMAs in the same
  // order, so a row's result does not depend on which path its batch took.
  const bool staged = widen && tiles >= kStagedTiles;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide;  // this thread's widened panel, kept for its next call
    if (staged && static_cast<int64_t>(wide.size()) < kPanel * K2 * 2) wide.resize(kPanel * K2 * 2);
    for (int64_t p = begin; p < end; ++p) {
      const int nb = static_cast<int>(std::min(kPanelBlocks, blocks - p * kPanelBlocks));
      const uint16_t* panel = wp + p * kPanel * K2 * 2;
      if (staged) {
        widen_panel(panel, nb, K2, wide.data());
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
          const int64_t r1 = M * (t + 1) / tiles;
          with_tile_shape(static_cast<int>(r1 - r0), nb, [&]<int R, int NB>() {
            wide_tile<R, NB>(xw + r0 * K, K, K, wide.data(), p * kPanel, N, bp, op + r0 * N, N);
          });
          r0 = r1;
        }
        continue;
      }
      // Each tile's pass over this panel also requests its share of the next panel's lines toward L2, spread over
      // its input pairs, so memory streams the next panel while this one's multiplies run. Without it a panel was
      // first waited for, then multiplied from L2, and a step at 8-32 rows took the sum of the two times instead of
      // the larger.
      const char* following = p + 1 < end ? reinterpret_cast<const char*>(panel) + panel_bytes : nullptr;
      const int64_t next_bytes = following == nullptr ? 0
          : (p + 1 == panels - 1 ? (blocks - (p + 1) * kPanelBlocks) * kLanes * K2 * 2 * 2 : panel_bytes);
      // (One tile alone is bound by memory already: asking ahead there only adds work.)
      const int64_t share = tiles > 1 ? (next_bytes + tiles - 1) / tiles : 0;
      int64_t r0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r1 = M * (t + 1) / tiles;
        Ahead next;
        if (share > 0) {
          next.at = following + t * share;
          next.end = following + std::min(next_bytes, (t + 1) * share);
          next.lines = std::max<int64_t>(1, (share / 64 + K2 - 1) / K2);
        }
        with_tile_shape(static_cast<int>(r1 - r0), nb, [&]<int R, int NB>() {
          if (widen)
            panel_tile<R, NB, true>(xp + r0 * K, xw + r0 * K, K, K, panel, p * kPanel, N, bp, op + r0 * N, N, next);
          else
            panel_tile<R, NB, false>(xp + r0 * K, nullptr, K, K, panel, p * kPanel, N, bp, op + r0 * N, N, next);
        });
        r0 = r1;
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX512_BF16 product");
#endif
}
