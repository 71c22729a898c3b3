// The low-rank term of LoRA adapters added to a linear layer's output, each token row from its own adapter slot
// (engine/lora/layers.py calls it after the layer's base product).
//
// Why: the term is two thin products per row (rank x inputs, then outputs x rank). Through PyTorch a mixed batch
// took a dozen small operations per layer (a product over every slot, a mask, one product per projection of a
// fused layer), each a pass and a dispatch of its own, so a batch mixing adapters took far longer a step than
// the base. Here a call reads each resident adapter's matrices once (rows of the same slot reuse them from
// cache), computes only each row's own slot, skips the zero columns of a rank below the maximum or a projection
// the adapter leaves alone, and splits the work over torch's threads.
//
// Layout (layers.py): A is [slots x width, inputs], width = projections x rank, slot-major then projection;
// B is one matrix per projection, [slots x rank, its outputs] (B transposed and scaled), so the term of row t
// with slot s (1-based; 0: none) for projection j is  h = A[s, j] x_t  (rank sums), y[t, j's outputs] += h B_j[s].
// Sums are float32; a bfloat16 output is rounded once, to nearest even. The adapter's matrices are of the layer's
// type, or bfloat16 under a float32 layer whose own product is coarser than that (GGUF blocks with 16-bit integer
// activations): they are read once a call from memory, so half the bytes is most of a mixed step's cost.
// ATen's tensor and the few operators used, not <torch/extension.h>: that header (the whole C++ frontend and
// pybind11) costs each file most of its compile time, and only the files that bind to Python need it.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 64;      // output columns per work item of the second product
constexpr int kRowTile = 4;         // rows of one slot that share each load of an A row
constexpr int64_t kSmall = 1 << 17; // multiply-adds below which one thread does a call (a fork costs more)

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // round to nearest even

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// out[j] = A_row . x_j for R rows x_j that share each load of A_row.
template <typename W, typename X, int R>
void dots(const W* a, const X* const* x, int64_t n, float* out) {
#if defined(__AVX512F__)
  __m512 sums[R];
  for (int j = 0; j < R; ++j) sums[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 av = load16(a + i, m);
    for (int j = 0; j < R; ++j) sums[j] = _mm512_fmadd_ps(av, load16(x[j] + i, m), sums[j]);
  }
  for (int j = 0; j < R; ++j) out[j] = _mm512_reduce_add_ps(sums[j]);
#else
  for (int j = 0; j < R; ++j) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += to_float(a[i]) * to_float(x[j][i]);
    out[j] = sum;
  }
#endif
}

// out[0..n) += sum_k coef[k] * b[k * stride + 0..n), n <= kChunk: the sums stay in registers over the rank.
template <typename Y, typename W>
inline void add_rank_sum(Y* out, const float* coef, const W* b, int64_t stride, int64_t rank, int64_t n) {
#if defined(__AVX512F__)
  constexpr int kVectors = kChunk / 16;
  __m512 acc[kVectors];
  __mmask16 masks[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = n - v * 16;
    masks[v] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    acc[v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < rank; ++k) {
    if (coef[k] == 0.f) continue;  // a rank below the maximum, or a projection the adapter leaves alone
    const __m512 f = _mm512_set1_ps(coef[k]);
    const W* row = b + k * stride;
    for (int v = 0; v < kVectors; ++v) acc[v] = _mm512_fmadd_ps(f, load16(row + v * 16, masks[v]), acc[v]);
  }
  alignas(64) float sums[kChunk];
  for (int v = 0; v < kVectors; ++v) _mm512_store_ps(sums + v * 16, acc[v]);
#else
  float sums[kChunk] = {0.f};
  for (int64_t k = 0; k < rank; ++k) {
    if (coef[k] == 0.f) continue;
    for (int64_t c = 0; c < n; ++c) sums[c] += coef[k] * to_float(b[k * stride + c]);
  }
#endif
  for (int64_t c = 0; c < n; ++c) store(out + c, to_float(out[c]) + sums[c]);
}

struct Piece {  // one work item of the second product: columns [begin, end) of projection `proj`
  int64_t proj, begin, end;
};

template <typename T, typename W>  // T: the rows' (x, y) type; W: the adapter's (A, B)
void lora_add_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& bs,
                    const int64_t* slots, int64_t rank) {
  const int64_t rows = x.size(0), inputs = x.size(1), outputs = y.size(1);
  const int64_t projections = static_cast<int64_t>(bs.size()), width = projections * rank;
  const int64_t resident = a.size(0) / width;
  const T* xp = x.data_ptr<T>();
  const W* ap = a.data_ptr<W>();
  T* yp = y.data_ptr<T>();
  // The rows of each slot, slot by slot (a counting sort): rows of one slot share each load of its A rows.
  std::vector<int64_t> order, starts(resident + 2, 0);
  for (int64_t t = 0; t < rows; ++t) starts[slots[t] + 1]++;
  for (int64_t s = 1; s <= resident + 1; ++s) starts[s] += starts[s - 1];
  order.resize(rows);
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t t = 0; t < rows; ++t) order[next[slots[t]]++] = t;
  }
  std::vector<int64_t> used;  // slots with rows, 0 left out
  for (int64_t s = 1; s <= resident; ++s)
    if (starts[s + 1] > starts[s]) used.push_back(s);
  if (used.empty()) return;
  std::vector<Piece> pieces;
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (int64_t j = 0; j < projections; ++j) {
    offsets.push_back(offset);
    const int64_t size = bs[j].size(1);
    for (int64_t c = 0; c < size; c += kChunk) pieces.push_back({j, c, std::min(size, c + kChunk)});
    offset += size;
  }
  TORCH_CHECK(offset == outputs, "lora_add_: the projections' widths do not add up to the output's");
  std::vector<float> h(rows * width, 0.f);
  const int64_t adapted = rows - (starts[1] - starts[0]);
  const int64_t work = adapted * width * inputs + adapted * rank * outputs;
  const int threads = work < kSmall ? 1 : at::get_num_threads();
  const int64_t first_items = static_cast<int64_t>(used.size()) * width;
  const int64_t piece_count = static_cast<int64_t>(pieces.size());
  // One fork per call: the first product's items (a slot's A row against its rows), a barrier, then the second
  // product's (a chunk of output columns for every adapted row).
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < first_items; ++item) {
      const int64_t s = used[item / width], k = item % width;
      const W* arow = ap + ((s - 1) * width + k) * inputs;
      const int64_t* mine = order.data() + starts[s];
      const int64_t count = starts[s + 1] - starts[s];
      int64_t i = 0;
      float got[kRowTile];
      const T* xs[kRowTile];
      for (; i + kRowTile <= count; i += kRowTile) {
        for (int j = 0; j < kRowTile; ++j) xs[j] = xp + mine[i + j] * inputs;
        dots<W, T, kRowTile>(arow, xs, inputs, got);
        for (int j = 0; j < kRowTile; ++j) h[mine[i + j] * width + k] = got[j];
      }
      for (; i < count; ++i) {
        xs[0] = xp + mine[i] * inputs;
        dots<W, T, 1>(arow, xs, inputs, got);
        h[mine[i] * width + k] = got[0];
      }
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < piece_count; ++p) {
      const Piece piece = pieces[p];
      const int64_t columns = bs[piece.proj].size(1);
      const W* bp = bs[piece.proj].data_ptr<W>() + piece.begin;
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t s = slots[t];
        if (s == 0) continue;
        add_rank_sum(yp + t * outputs + offsets[piece.proj] + piece.begin, h.data() + t * width + piece.proj * rank,
                     bp + (s - 1) * rank * columns, columns, rank, piece.end - piece.begin);
      }
    }
  }
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const std::vector<at::Tensor>& bs,
               const at::Tensor& slots, int64_t rank) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && x.size(0) == y.size(0) && a.size(1) == x.size(1),
              "lora_add_: x [rows, inputs], y [rows, outputs] and A [slots x width, inputs] are needed");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous(), "lora_add_: contiguous tensors needed");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == a.scalar_type() || a.scalar_type() == at::kBFloat16) &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add_: float32 or bfloat16 rows, and an adapter of their type or bfloat16, are needed");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(), "lora_add_: one int64 slot per row is needed");
  const int64_t width = static_cast<int64_t>(bs.size()) * rank;
  TORCH_CHECK(rank > 0 && !bs.empty() && a.size(0) % width == 0, "lora_add_: A's rows are not slots x width");
  const int64_t resident = a.size(0) / width;
  for (const auto& b : bs) {
    TORCH_CHECK(b.dim() == 2 && b.is_contiguous() && b.scalar_type() == a.scalar_type() &&
                    b.size(0) == resident * rank, "lora_add_: each B must be [slots x rank, outputs] of A's type");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] <= resident, "lora_add_: a row's slot is out of range");
  }
  if (x.scalar_type() == at::kBFloat16) {
    lora_add_typed<at::BFloat16, at::BFloat16>(y, x, a, bs, sp, rank);
  } else if (a.scalar_type() == at::kBFloat16) {
    lora_add_typed<float, at::BFloat16>(y, x, a, bs, sp, rank);
  } else {
    lora_add_typed<float, float>(y, x, a, bs, sp, rank);
  }
}
