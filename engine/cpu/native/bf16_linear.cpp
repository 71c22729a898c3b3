// Products by bfloat16 weights (engine/cpu/bf16_weights.py calls them): bfloat16 rows with AVX512_BF16, and
// float32 rows on every x86-64 build (AVX2 and FMA at least).
//
// Why: a decode step at a few rows streams every weight from memory once, so its speed is the speed weights are
// read at. oneDNN's packed bfloat16 product read a step's weights well below the machine's copy bandwidth, and a
// CPU without native bfloat16 products multiplies a bfloat16 checkpoint as float32, twice the bytes a step reads.
// This kernel reads the weight as one sequential stream per thread, in the order it multiplies it:
// `bf16_pack` lays the weight out once, in panels of 64 outputs (4 blocks of 16), each panel input pair by input
// pair: for pair g the 16 outputs of block j hold (w[o][2g], w[o][2g + 1]) side by side, 64 bytes, exactly the
// 32 bfloat16 that one VDPBF16PS multiplies by a broadcast pair of inputs into 16 float32 sums. A register tile of
// rows by units of outputs (a unit: one register of sums, 16 outputs on AVX-512, 8 on AVX2) takes each weight
// load once per row, so batches and prompt chunks run from the same copy: a panel (at most 4 x 16 x K x 2 bytes,
// 320 KB at K = 2560) stays in L2 while every row tile of a call passes over it. Each row's sums do not depend
// on the other rows.
//
// Two arithmetics over the same copy:
// - VDPBF16PS (AVX-512 builds on CPUs with AVX512_BF16, bfloat16 rows): a pair's two products added into a sum
//   at once;
// - float32 FMAs ("widen"; float32 rows always): each unit's bytes widen in registers to float32 weights (input
//   2g: the pair's low halves shifted up 16 bits; input 2g + 1: the high halves masked), each product exact and
//   rounded once as it is added. Sums run in input order, so the AVX2 and AVX-512 builds give the same bits.
//   Some CPUs run VDPBF16PS at half the rate of their float32 FMAs, where prompt chunks, bound by the
//   multiplies, run faster this way; at a few rows both are bound by reading the weights. engine/cpu/
//   bf16_weights.py times the two and keeps one for every batch size.
// Sums are float32; the bias is added in float32 and bfloat16 rows' results rounded once to bfloat16 (round to
// nearest even), as oneDNN does.
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
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>
#define LLM_WIDE_PRODUCT 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LLM_BF16_PRODUCT 1
// Every function of the products carries AVX512_BF16 as a target in this build (only bfloat16 rows' code uses
// its instructions, and only where the CPU has them), so the tiles inline into one another.
#define LLM_PRODUCT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#else
#define LLM_PRODUCT_TARGET
#endif
#endif

namespace {

constexpr int64_t kBlock = 16;       // outputs per block of the packing
constexpr int64_t kPanelBlocks = 4;  // blocks per panel
constexpr int64_t kPanel = kBlock * kPanelBlocks;

int64_t pairs_of(int64_t in_features) { return (in_features + 1) / 2; }

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "bf16_pack: a 2-D bfloat16 CPU weight is needed");
}

// The float32 value of a bfloat16 (its bits are the top half of the float's).
inline float widened(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

#if defined(LLM_WIDE_PRODUCT)

// One unit of outputs in this build's registers: the loads, FMAs and stores the tiles are written in.
#if defined(LLM_BF16_PRODUCT)
struct Unit {
  using F = __m512;
  static constexpr int64_t kWidth = 16;  // outputs (one block)
  // Tiles widening in registers or by VDPBF16PS, and tiles from a widened panel: 24 sums + 2 weights + a
  // broadcast, 27 of 32 registers.
  static constexpr int kMaxRows = 6, kMaxUnits = 4, kWideRows = 6, kWideUnits = 4;
  static constexpr int64_t kStagedTiles = 32;  // row tiles from which a panel is widened once for all of them
  static __mmask16 mask(int64_t lanes) { return static_cast<__mmask16>((1u << lanes) - 1); }
  LLM_PRODUCT_TARGET static F zero() { return _mm512_setzero_ps(); }
  LLM_PRODUCT_TARGET static F broadcast(float v) { return _mm512_set1_ps(v); }
  LLM_PRODUCT_TARGET static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  LLM_PRODUCT_TARGET static F add(F a, F b) { return _mm512_add_ps(a, b); }
  LLM_PRODUCT_TARGET static F load(const float* p) { return _mm512_loadu_ps(p); }
  LLM_PRODUCT_TARGET static F load_part(const float* p, int64_t lanes) { return _mm512_maskz_loadu_ps(mask(lanes), p); }
  LLM_PRODUCT_TARGET static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  LLM_PRODUCT_TARGET static void store_part(float* p, F v, int64_t lanes) { _mm512_mask_storeu_ps(p, mask(lanes), v); }
  // A unit's pair of bfloat16 weights at w as float32: the first inputs' and the second inputs'.
  LLM_PRODUCT_TARGET static void widen(const uint16_t* w, F& first, F& second) {
    const __m512i packed = _mm512_loadu_si512(w);
    first = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
    second = _mm512_castsi512_ps(_mm512_and_si512(packed, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};
#else
struct Unit {
  using F = __m256;
  static constexpr int64_t kWidth = 8;  // outputs (half a block)
  // 12 sums + 2 weights + a broadcast, 15 of 16 registers. A tile widening in registers spends two operations a
  // weight load: it takes more outputs and fewer rows, so one row's pass is a long stream. A tile from a widened
  // panel takes more rows, so each weight load serves more FMAs.
  static constexpr int kMaxRows = 3, kMaxUnits = 4, kWideRows = 6, kWideUnits = 2;
  static constexpr int64_t kStagedTiles = 16;
  static F zero() { return _mm256_setzero_ps(); }
  static F broadcast(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_part(const float* p, int64_t lanes) {
    float part[kWidth] = {};
    std::memcpy(part, p, lanes * sizeof(float));
    return _mm256_loadu_ps(part);
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store_part(float* p, F v, int64_t lanes) {
    float part[kWidth];
    _mm256_storeu_ps(part, v);
    std::memcpy(p, part, lanes * sizeof(float));
  }
  static void widen(const uint16_t* w, F& first, F& second) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    first = _mm256_castsi256_ps(_mm256_slli_epi32(packed, 16));
    second = _mm256_castsi256_ps(_mm256_and_si256(packed, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};
#endif
using F = Unit::F;
constexpr int64_t kWidth = Unit::kWidth;
constexpr int64_t kUnitElems = 2 * kWidth;  // bfloat16 of one unit at one input pair

// Where a tile's sums go: rows of `os` elements, the tile's first output, the layer's N outputs, its float32
// bias (or null).
template <typename Out>
struct Sink {
  Out* out;
  int64_t os, first_out, N;
  const float* bias;
};

// A span of weight bytes a tile's pass pulls toward L2 as it goes: a share of the next panel (see bf16_linear).
struct Ahead {
  const char* at = nullptr;   // next line to request
  const char* end = nullptr;  // end of this pass's share
  int64_t lines = 0;          // lines requested per input pair
};

#if defined(LLM_BF16_PRODUCT)
LLM_PRODUCT_TARGET inline void store_rounded(uint16_t* out, __m512 v, int64_t lanes) {
  _mm256_mask_storeu_epi16(out, Unit::mask(lanes), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// The tile's sums (+ bias) into its rows' outputs: float32 as they are, bfloat16 rounded once.
template <int R, int NU, typename Out>
LLM_PRODUCT_TARGET __attribute__((always_inline)) inline void store_sums(F (&acc)[R][NU], const Sink<Out>& s) {
  for (int u = 0; u < NU; ++u) {
    const int64_t o = s.first_out + u * kWidth;
    if (o >= s.N) break;  // a unit past the layer's outputs (the last block's second half on AVX2)
    const int64_t lanes = s.N - o < kWidth ? s.N - o : kWidth;
    const F b = s.bias ? Unit::load_part(s.bias + o, lanes) : Unit::zero();
    for (int r = 0; r < R; ++r) {
      const F v = Unit::add(acc[r][u], b);
      Out* dst = s.out + r * s.os + o;
      if constexpr (std::is_same_v<Out, float>) {
        if (lanes == kWidth) Unit::store(dst, v); else Unit::store_part(dst, v, lanes);
      } else {
#if defined(LLM_BF16_PRODUCT)
        store_rounded(dst, v, lanes);
#endif
      }
    }
  }
}

// Rows of float32 inputs xw (row stride xs, K inputs) by NU units of a panel's bfloat16 pairs, widened in
// registers: `w` is the first unit's bytes at pair 0, `step` the elements from one pair to the next.
template <int R, int NU, typename Out>
LLM_PRODUCT_TARGET void widening_tile(const float* xw, int64_t xs, int64_t K, const uint16_t* w, int64_t step,
                                      const Sink<Out>& s, Ahead next) {
  F acc[R][NU];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NU; ++u) acc[r][u] = Unit::zero();
  const int64_t ahead = 16 * step;  // prefetch distance: 16 pairs
  constexpr int64_t span = NU * kUnitElems * 2;  // the tile's bytes of one pair
  for (int64_t g = 0; g < K / 2; ++g, w += step) {
    for (int64_t b = 0; b < span; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + ahead) + b, _MM_HINT_T0);
    for (int64_t l = 0; l < next.lines && next.at < next.end; ++l, next.at += 64) _mm_prefetch(next.at, _MM_HINT_T1);
    for (int u = 0; u < NU; ++u) {
      F first, second;
      Unit::widen(w + u * kUnitElems, first, second);
      for (int r = 0; r < R; ++r) {
        acc[r][u] = Unit::fma(Unit::broadcast(xw[r * xs + 2 * g]), first, acc[r][u]);
        acc[r][u] = Unit::fma(Unit::broadcast(xw[r * xs + 2 * g + 1]), second, acc[r][u]);
      }
    }
  }
  if (K & 1) {  // the last input alone: its pair's second weight is a zero the packing added
    for (int u = 0; u < NU; ++u) {
      F first, second;
      Unit::widen(w + u * kUnitElems, first, second);
      for (int r = 0; r < R; ++r) acc[r][u] = Unit::fma(Unit::broadcast(xw[r * xs + K - 1]), first, acc[r][u]);
    }
  }
  store_sums<R, NU, Out>(acc, s);
}

// The same FMAs in the same order from a panel `widen_panel` made ([K][units][kWidth] float32; `wide` at the
// tile's first unit, `step` floats from one input to the next): no widening in the loop, one weight load per
// unit serving R rows.
template <int R, int NU, typename Out>
LLM_PRODUCT_TARGET void wide_tile(const float* xw, int64_t xs, int64_t K, const float* wide, int64_t step,
                                  const Sink<Out>& s) {
  F acc[R][NU];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NU; ++u) acc[r][u] = Unit::zero();
  for (int64_t k = 0; k < K; ++k, wide += step) {
    F wv[NU];
    for (int u = 0; u < NU; ++u) wv[u] = Unit::load(wide + u * kWidth);
    for (int r = 0; r < R; ++r) {
      const F b = Unit::broadcast(xw[r * xs + k]);
      for (int u = 0; u < NU; ++u) acc[r][u] = Unit::fma(b, wv[u], acc[r][u]);
    }
  }
  store_sums<R, NU, Out>(acc, s);
}

// A panel of `units` units widened to float32 once, [K rounded up to pairs][units][kWidth], for the wide tiles.
LLM_PRODUCT_TARGET void widen_panel(const uint16_t* panel, int64_t units, int64_t K2, float* wide) {
  for (int64_t g = 0; g < K2; ++g)
    for (int64_t u = 0; u < units; ++u) {
      F first, second;
      Unit::widen(panel + (g * units + u) * kUnitElems, first, second);
      Unit::store(wide + (2 * g * units + u) * kWidth, first);
      Unit::store(wide + ((2 * g + 1) * units + u) * kWidth, second);
    }
}

// f.template operator()<R, NU>() for a register tile of `rows` rows (1 to MaxRows) by `units` units (1 to
// Unit::kMaxUnits): every tile kind takes its shape through this one dispatch.
template <int MaxRows, typename Fn>
void with_tile_shape(int rows, int units, const Fn& f) {
  if constexpr (MaxRows > 1) {
    if (rows < MaxRows) return with_tile_shape<MaxRows - 1>(rows, units, f);
  }
  switch (units) {
    case 4: return f.template operator()<MaxRows, 4>();
    case 3: return f.template operator()<MaxRows, 3>();
    case 2: return f.template operator()<MaxRows, 2>();
    default: return f.template operator()<MaxRows, 1>();
  }
}

#endif  // LLM_WIDE_PRODUCT

#if defined(LLM_BF16_PRODUCT)

// acc[r][j] += VDPBF16PS of rows r's inputs 2g, 2g + 1 (`both`: else 2g alone, the last of an odd K) with block
// j's 64 bytes at w.
template <int R, int NB>
LLM_PRODUCT_TARGET __attribute__((always_inline)) inline void dot_pair(__m512 (&acc)[R][NB], const uint16_t* w,
                                                                       const uint16_t* x, int64_t xs, int64_t g,
                                                                       bool both) {
  __m512bh wv[NB];
  for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * 32);
  for (int r = 0; r < R; ++r) {
    int32_t inputs = static_cast<int32_t>(x[r * xs + 2 * g]);
    if (both) std::memcpy(&inputs, x + r * xs + 2 * g, 4);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(inputs);
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
  }
}

// VDPBF16PS: bfloat16 rows of x (row stride xs, K inputs) by a whole panel of NB blocks.
template <int R, int NB>
LLM_PRODUCT_TARGET void dot_tile(const uint16_t* x, int64_t xs, int64_t K, const uint16_t* panel,
                                 const Sink<uint16_t>& s, Ahead next) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w = panel;
  constexpr int64_t step = NB * 32;  // elements of one input pair across the panel's blocks
  constexpr int64_t ahead = 16 * step;  // prefetch distance: 16 pairs (4 KB for a full panel)
  for (int64_t g = 0; g < K / 2; ++g, w += step) {
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + j * 32), _MM_HINT_T0);
    for (int64_t l = 0; l < next.lines && next.at < next.end; ++l, next.at += 64) _mm_prefetch(next.at, _MM_HINT_T1);
    dot_pair<R, NB>(acc, w, x, xs, g, true);
  }
  // the last input alone: its pair's second weight is a zero the packing added, its input is zero too
  if (K & 1) dot_pair<R, NB>(acc, w, x, xs, K / 2, false);
  store_sums<R, NB, uint16_t>(acc, s);
}

// One thread's VDPBF16PS rate (GFLOP/s) over about `seconds`: 12 independent sums hide the instruction's latency.
LLM_PRODUCT_TARGET double peak_loop(double seconds) {
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

// Whether this build multiplies float32 rows by bfloat16 weights (every x86-64 build: the CPU variants that load
// all have AVX2 and FMA).
bool bf16_weights_supported() {
#if defined(LLM_WIDE_PRODUCT)
  return true;
#else
  return false;
#endif
}

// weight [N, K] (any strides) -> the panels described above, zero-padded to whole blocks and input pairs.
at::Tensor bf16_pack(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = pairs_of(K);
  const int64_t blocks = (N + kBlock - 1) / kBlock, panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  at::Tensor packed = at::zeros({blocks * kBlock * K2 * 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t nb = std::min(kPanelBlocks, blocks - p * kPanelBlocks);
      uint16_t* panel = dst + p * kPanel * K2 * 2;
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t i = 0; i < kBlock; ++i) {
          const int64_t o = (p * kPanelBlocks + j) * kBlock + i;
          if (o >= N) break;
          const uint16_t* row = src + o * K;
          for (int64_t k = 0; k < K; ++k) panel[((k / 2 * nb + j) * kBlock + i) * 2 + (k & 1)] = row[k];
        }
    }
  });
  return packed;
}

// x [M, K] (bfloat16, or float32) by the weight `bf16_pack` made of a [N, K] weight (+ bias [N]) -> [M, N] of
// x's type; `widen`: bfloat16 rows by float32 FMAs (float32 rows always are; see the top of this file).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool widen) {
#if defined(LLM_WIDE_PRODUCT)
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  x.is_contiguous(), "bf16_linear: x must be a contiguous 2-D bfloat16 or float32 tensor");
  const bool float_rows = x.scalar_type() == at::kFloat;
  TORCH_CHECK(float_rows || bf16_linear_supported(), "bf16_linear: bfloat16 rows need AVX512_BF16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, K2 = pairs_of(K);
  const int64_t blocks = (N + kBlock - 1) / kBlock, panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.numel() == blocks * kBlock * K2 * 2,
              "bf16_linear: the packed weight does not match x and out_features");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias size");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (float_rows) widen = true;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const uint16_t* xp = float_rows ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> x_wide(widen && !float_rows ? M * K : 0);  // bfloat16 rows as float32 once, for the FMAs
  for (int64_t i = 0; i < static_cast<int64_t>(x_wide.size()); ++i) x_wide[i] = widened(xp[i]);
  const float* xw = float_rows ? x.data_ptr<float>() : x_wide.data();
  void* op = out.data_ptr();
  // Float32 FMAs over many row tiles widen each panel once into a float32 copy the tiles share (`wide_tile`),
  // rather than in every tile's pass, where the two widening operations of each weight load take the FMAs' ports.
  // With few tiles the copy costs more than it saves, hence kStagedTiles. The sums are the same FMAs in the same
  // order, so a row's result does not depend on which path its batch took.
  const bool staged = widen && (M + Unit::kMaxRows - 1) / Unit::kMaxRows >= Unit::kStagedTiles;
  const int64_t tile_rows = staged ? Unit::kWideRows : Unit::kMaxRows;
  const int64_t pass_units = staged ? Unit::kWideUnits : Unit::kMaxUnits;
  // Row tiles of nearly equal size (8 rows: 4 + 4, not 6 + 2).
  const int64_t tiles = (M + tile_rows - 1) / tile_rows;
  const int64_t panel_bytes = kPanel * K2 * 2 * 2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide;  // this thread's widened panel, kept for its next call
    if (staged && static_cast<int64_t>(wide.size()) < kPanel * K2 * 2) wide.resize(kPanel * K2 * 2);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t nb = std::min(kPanelBlocks, blocks - p * kPanelBlocks);
      const int64_t units = nb * kBlock / kWidth;  // this panel's units, in passes of at most kMaxUnits
      const int64_t passes = (units + pass_units - 1) / pass_units;
      const uint16_t* panel = wp + p * kPanel * K2 * 2;
      // Each tile's pass over this panel also requests its share of the next panel's lines toward L2, spread over
      // its input pairs, so memory streams the next panel while this one's multiplies run. Without it a panel was
      // first waited for, then multiplied from L2, and a step at 8-32 rows took the sum of the two times instead of
      // the larger. (One tile alone is bound by memory already: asking ahead there only adds work.)
      const char* following = p + 1 < end && !staged ? reinterpret_cast<const char*>(panel) + panel_bytes : nullptr;
      const int64_t next_bytes = following == nullptr ? 0
          : (p + 1 == panels - 1 ? (blocks - (p + 1) * kPanelBlocks) * kBlock * K2 * 2 * 2 : panel_bytes);
      const int64_t share = tiles > 1 ? (next_bytes + tiles * passes - 1) / (tiles * passes) : 0;
      if (staged) widen_panel(panel, units, K2, wide.data());
      for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
        const int64_t r1 = M * (t + 1) / tiles;
        const int rows = static_cast<int>(r1 - r0);
        for (int64_t pass = 0; pass < passes; ++pass) {
          const int64_t u0 = pass * pass_units;
          const int nu = static_cast<int>(std::min(pass_units, units - u0));
          const int64_t first_out = p * kPanel + u0 * kWidth;
          Ahead next;
          if (share > 0) {
            const int64_t i = t * passes + pass;
            next.at = following + i * share;
            next.end = following + std::min(next_bytes, (i + 1) * share);
            next.lines = std::max<int64_t>(1, (share / 64 + K2 - 1) / K2);
          }
          if (staged) {
            with_tile_shape<Unit::kWideRows>(rows, nu, [&]<int R, int NU>() {
              if constexpr (NU <= Unit::kWideUnits) {
                const float* w = wide.data() + u0 * kWidth;
                if (float_rows)
                  wide_tile<R, NU>(xw + r0 * K, K, K, w, units * kWidth, Sink<float>{static_cast<float*>(op) + r0 * N,
                                                                                    N, first_out, N, bp});
#if defined(LLM_BF16_PRODUCT)
                else
                  wide_tile<R, NU>(xw + r0 * K, K, K, w, units * kWidth,
                                   Sink<uint16_t>{static_cast<uint16_t*>(op) + r0 * N, N, first_out, N, bp});
#endif
              }
            });
            continue;
          }
          with_tile_shape<Unit::kMaxRows>(rows, nu, [&]<int R, int NU>() {
            const uint16_t* w = panel + u0 * kUnitElems;
            if (float_rows) {
              widening_tile<R, NU>(xw + r0 * K, K, K, w, units * kUnitElems,
                                   Sink<float>{static_cast<float*>(op) + r0 * N, N, first_out, N, bp}, next);
              return;
            }
#if defined(LLM_BF16_PRODUCT)
            const Sink<uint16_t> s{static_cast<uint16_t*>(op) + r0 * N, N, first_out, N, bp};
            if (widen) widening_tile<R, NU>(xw + r0 * K, K, K, w, units * kUnitElems, s, next);
            else dot_tile<R, NU>(xp + r0 * K, K, K, panel, s, next);
#endif
          });
        }
        r0 = r1;
      }
    }
  });
  return out;
#else
  (void)x, (void)packed, (void)out_features, (void)bias, (void)widen;
  TORCH_CHECK(false, "bf16_linear: this build has no product of bfloat16 weights (it needs AVX2 and FMA)");
#endif
}
