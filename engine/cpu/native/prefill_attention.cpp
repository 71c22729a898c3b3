// Prefill attention read from the paged cache: one sequence's chunk of new tokens, each attending causally (and
// within a sliding window, where the layer has one) over the sequence's keys, the chunk's own included
// (engine/attention.py calls it; engine/native_kernels.py builds and checks it).
//
// Why: PyTorch's CPU flash attention runs a prompt chunk well below the machine's arithmetic rate, and a chunk
// that continues a sequence needs an explicit mask, so it also computes every masked score; attention is a large
// share of a long prompt's prefill. Here each task takes a tile of query tokens of one key
// head (the query heads sharing that key head ride along as extra rows), walks only the keys its tokens reach,
// and multiplies in register tiles: scores as rows x 64 keys against the keys transposed once per call, values
// as rows x head size. The softmax is the online one (running maximum and sum per row), in float32.
// ATen's tensor and the few operators used, not <torch/extension.h>: that header (the whole C++ frontend and
// pybind11) costs each file most of its compile time, and only the files that bind to Python need it.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

bool bf16_linear_supported();  // bf16_linear.cpp: this build and CPU have AVX512_BF16

namespace {

#if defined(__AVX512F__)
constexpr int64_t kKeyTile = 64;    // keys per tile: four 16-lane vectors of scores per row
constexpr int64_t kTokenTile = 16;  // query tokens per task

// exp(x) for 16 lanes: Cephes' reduction x = n ln2 + r, its degree-6 polynomial for e^r, then scaled by 2^n
// (the vector form of decode_kernels.cpp's fast_exp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// s[r][0:64] = q[r] . keys 0..63 for R rows: q [R][D] (scaled), kt the keys transposed ([D][ldk], key j of the
// tile at kt[d * ldk + j]).
template <int R, int D>
inline void score_rows(const float* q, const float* kt, int64_t ldk, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const float* k = kt + d * ldk;
    const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                 k3 = _mm512_loadu_ps(k + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r * D + d]);
      acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyTile + 16 * c, acc[r][c]);
}

// o[r] += sum over j < n of p[r][j] * v[j] for R rows: p [R][64], v [n][DV], o [R][DV].
template <int R, int DV>
inline void value_rows(const float* p, const float* v, int64_t n, float* o) {
  constexpr int C = DV / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * DV + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[C];
    for (int c = 0; c < C; ++c) vj[c] = _mm512_loadu_ps(v + j * DV + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(p[r * kKeyTile + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(b, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * DV + 16 * c, acc[r][c]);
}

// The bfloat16 forms, for a bfloat16 model (bfloat16 cache, queries that are bfloat16 values): VDPBF16PS takes
// two products a lane, twice float32's multiply-adds an instruction. Scores: q [R][D / 2] pairs of the unscaled
// query, kt [D / 2][ldk][2] (key j's dims 2e and 2e + 1 side by side), sums scaled once at the end. Values: the
// weights rounded to bfloat16 pairs along the keys (as the reference model's bfloat16 attention rounds them), v
// [ldk / 2][DV][2] (keys 2i and 2i + 1 of each dim side by side), sums in float32.
template <int R, int D>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))
void score_rows_bf16(const uint32_t* q, const uint16_t* kt, int64_t ldk, float scale, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int e = 0; e < D / 2; ++e) {
    const uint16_t* k = kt + e * ldk * 2;
    __m512bh kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[r * (D / 2) + e]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], b, kv[c]);
    }
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyTile + 16 * c, _mm512_mul_ps(acc[r][c], f));
}

template <int R, int DV>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))
void value_rows_bf16(const float* p, const uint16_t* v, int64_t n, float* o) {
  constexpr int C = DV / 16;
  uint32_t pairs[R][kKeyTile / 2];  // each row's weights as bfloat16 pairs (past n they are 0)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + r * kKeyTile + 32 * c + 16),
                                             _mm512_loadu_ps(p + r * kKeyTile + 32 * c));
      _mm512_storeu_si512(pairs[r] + 16 * c, (__m512i)w);
    }
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * DV + 16 * c);
  for (int64_t i = 0; i < (n + 1) / 2; ++i) {
    __m512bh vi[C];
    for (int c = 0; c < C; ++c) vi[c] = (__m512bh)_mm512_loadu_si512(v + i * DV * 2 + 32 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[r][i]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], b, vi[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * DV + 16 * c, acc[r][c]);
}

// tile.template operator()<N>(r) over rows [r, rows) in register tiles of N = R rows, the remainder through
// smaller tiles.
template <int R, typename Tile>
inline void in_row_tiles(int64_t r, int64_t rows, const Tile& tile) {
  for (; r + R <= rows; r += R) tile.template operator()<R>(r);
  if constexpr (R > 1) {
    if (r < rows) in_row_tiles<R - 1>(r, rows, tile);
  }
}

// One key head's share of the chunk: tokens [t0, t1) of the chunk with their `group` query heads as rows (row
// (i - t0) * group + g), against the keys gathered for this head (kt transposed, v [keys][DV]; gathered key 0
// sits at position `base`). Token i sits at position start + i and reads positions (pos - window, pos].
// B16: q is bfloat16 pairs (unscaled, `scale` applied to the scores), kt and v the bfloat16 layouts above;
// else q is float32 (scaled), kt [D][ldk] and v [keys][D] float32.
template <int D, bool B16>
void attend_tile(const void* q_rows, float scale, int64_t t0, int64_t t1, int64_t group, int64_t start,
                 int64_t window, int64_t base, const void* kt_any, int64_t ldk, const void* v_any, float* top,
                 float* total, float* o, float* s) {
  const int64_t rows = (t1 - t0) * group;
  std::fill(top, top + rows, -INFINITY);
  std::fill(total, total + rows, 0.f);
  std::fill(o, o + rows * D, 0.f);
  const int64_t first_pos = window > 0 ? std::max<int64_t>(base, start + t0 + 1 - window) : base;
  const int64_t end_pos = start + t1;  // one past the last key any row reads
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = first_pos - base; k0 < end_pos - base; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end_pos - base - k0);
    in_row_tiles<4>(0, rows, [&]<int N>(int64_t r) {
      if constexpr (B16)
        score_rows_bf16<N, D>(static_cast<const uint32_t*>(q_rows) + r * (D / 2),
                              static_cast<const uint16_t*>(kt_any) + k0 * 2, ldk, scale, s + r * kKeyTile);
      else
        score_rows<N, D>(static_cast<const float*>(q_rows) + r * D, static_cast<const float*>(kt_any) + k0, ldk,
                         s + r * kKeyTile);
    });
    // The online softmax: masked lanes (after a row's position, before its window, past n) weigh nothing.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = start + t0 + r / group;
      // The positions the row reads within this tile: [lo, hi].
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(first));
      const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(std::min(pos, base + k0 + n - 1)));
      float* sr = s + r * kKeyTile;
      __mmask16 valid[4];
      __m512 m = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < 4; ++c) {
        const __m512i key_pos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(base + k0 + 16 * c)));
        valid[c] = _mm512_cmple_epi32_mask(key_pos, hi) & _mm512_cmpge_epi32_mask(key_pos, lo);
        m = _mm512_mask_max_ps(m, valid[c], m, _mm512_loadu_ps(sr + 16 * c));
      }
      const float tile_top = _mm512_reduce_max_ps(m);
      if (tile_top == -INFINITY) {  // the row reads none of these keys
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(sr + 16 * c, _mm512_setzero_ps());
        continue;
      }
      const float new_top = std::max(top[r], tile_top);
      const __m512 shift = _mm512_set1_ps(new_top);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 p = _mm512_maskz_mov_ps(valid[c], exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), shift)));
        _mm512_storeu_ps(sr + 16 * c, p);
        sum = _mm512_add_ps(sum, p);
      }
      if (new_top != top[r]) {
        const float factor = top[r] == -INFINITY ? 0.f : std::exp(top[r] - new_top);
        total[r] *= factor;
        const __m512 f = _mm512_set1_ps(factor);
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(o + r * D + 16 * c, _mm512_mul_ps(f, _mm512_loadu_ps(o + r * D + 16 * c)));
        top[r] = new_top;
      }
      total[r] += _mm512_reduce_add_ps(sum);
    }
    // As many rows as keep their sums in registers: 6 x 4 vectors of 64 values, 3 x 8 of 128.
    in_row_tiles<D == 64 ? 6 : 3>(0, rows, [&]<int N>(int64_t r) {
      if constexpr (B16)
        value_rows_bf16<N, D>(s + r * kKeyTile, static_cast<const uint16_t*>(v_any) + k0 * D, n, o + r * D);
      else
        value_rows<N, D>(s + r * kKeyTile, static_cast<const float*>(v_any) + k0 * D, n, o + r * D);
    });
  }
}
#endif

// One key's dim values of a 16-bit pool to float32: the key into its column of the transposed keys (stride ldk),
// the value into its row.
template <typename P>
inline void widen(const P* key, const P* value, int64_t dim, int64_t ldk, float* key_column, float* value_row) {
  for (int64_t d = 0; d < dim; ++d) key_column[d * ldk] = static_cast<float>(key[d]);
  for (int64_t d = 0; d < dim; ++d) value_row[d] = static_cast<float>(value[d]);
}

#if defined(__AVX512F__)
inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Whether every query value is a bfloat16 value (its float32 bits' lower half zero): a bfloat16 model's queries
// widened for this kernel, as opposed to a float32 model's over a bfloat16 cache (KV_CACHE_DTYPE).
bool bfloat16_values(const at::Tensor& query) {
  const float* qp = query.data_ptr<float>();
  for (int64_t i = 0; i < query.size(0); ++i)
    for (int64_t h = 0; h < query.size(1); ++h) {
      const float* row = qp + i * query.stride(0) + h * query.stride(1);
      for (int64_t d = 0; d < query.size(2); ++d)
        if (bits(row[d]) & 0xFFFFu) return false;
    }
  return true;
}
#endif

}  // namespace

bool prefill_attention_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// query [tokens, heads, dim] and out [tokens, heads, dim] (any token and head strides, float32): the chunk's
// queries, token i at position start + i; pools [blocks, block_size, kv_heads, dim] (float32, or 16-bit, widened
// as they are gathered) holding the sequence's keys
// and values up to position start + tokens (the chunk's own already written); blocks the sequence's block ids,
// from position 0. Query head h reads key head h / (heads / kv_heads). window > 0: each token reads only its
// last `window` positions. Head sizes 64 and 128. bf16_products: a bfloat16 model's chunk over its bfloat16 cache
// multiplies with VDPBF16PS (else float32 FMAs over the widened values).
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                             const at::Tensor& blocks, int64_t start, int64_t window, double scale, at::Tensor& out,
                             bool bf16_products) {
#if defined(__AVX512F__)
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1 && out.dim() == 3 &&
                  out.stride(2) == 1 && query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill_attention: query and out must be CPU float32 [tokens, heads, dim] with a contiguous "
              "last dimension");
  const at::ScalarType pool_type = k_pool.scalar_type();
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  v_pool.scalar_type() == pool_type &&
                  (pool_type == at::kFloat || pool_type == at::kHalf || pool_type == at::kBFloat16) &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.size(3) == query.size(2),
              "paged_prefill_attention: pools must be contiguous float32, float16 or bfloat16 [blocks, block_size, "
              "kv_heads, dim]");
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), pool_blocks = k_pool.size(0);
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill_attention: head size 64 or 128");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && out.size(0) == tokens && out.size(1) == heads &&
                  out.size(2) == dim && tokens > 0 && start >= 0, "paged_prefill_attention: shapes disagree");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() &&
                  blocks.numel() * block_size >= start + tokens,
              "paged_prefill_attention: blocks must be int64 ids covering the sequence");
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t end = start + tokens;
  for (int64_t i = 0; i < (end + block_size - 1) / block_size; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < pool_blocks, "paged_prefill_attention: block id out of range");
  const int64_t group = heads / kv_heads;
  const int64_t base = window > 0 ? std::max<int64_t>(0, start + 1 - window) : 0;  // first position read
  const int64_t keys = end - base;
  const int64_t ldk = (keys + 2 * kKeyTile - 1) / kKeyTile * kKeyTile;  // room for a whole last tile
  const float* qp = query.data_ptr<float>();
  const char* kp = static_cast<const char*>(k_pool.data_ptr());
  const char* vp = static_cast<const char*>(v_pool.data_ptr());
  const int64_t element = k_pool.element_size();
  float* op = out.data_ptr<float>();
  const int64_t q_token = query.stride(0), q_head = query.stride(1), o_token = out.stride(0), o_head = out.stride(1);
  const int64_t tiles = (tokens + kTokenTile - 1) / kTokenTile;
  // Keys transposed ([dim, ldk]) and values packed ([ldk, dim]) per key head, for as many key heads at a time as
  // fit kScratchBytes, about a core's L2 (a gathered head is used while it is still there).
  // A bfloat16 model (bfloat16 cache, every query a bfloat16 value widened) multiplies in bfloat16 where the CPU
  // has AVX512_BF16 and the caller asks (`bf16_products`: where VDPBF16PS outpaces float32 FMAs; on some CPUs it
  // runs at half their rate): the keys and values are gathered as bfloat16 pairs instead of float32.
  const bool b16 = bf16_products && pool_type == at::kBFloat16 && bf16_linear_supported() && bfloat16_values(query);
  constexpr int64_t kScratchBytes = 1 << 20;
  const int64_t per_head = 2 * ldk * dim;
  const int64_t heads_per_pass = std::clamp<int64_t>(kScratchBytes / (per_head * (b16 ? 2 : 4)), 1, kv_heads);
  std::vector<float> scratch(b16 ? 0 : heads_per_pass * per_head);
  std::vector<uint16_t> scratch16(b16 ? heads_per_pass * per_head : 0);
  const auto attend = b16 ? (dim == 64 ? &attend_tile<64, true> : &attend_tile<128, true>)
                          : (dim == 64 ? &attend_tile<64, false> : &attend_tile<128, false>);
  for (int64_t h0 = 0; h0 < kv_heads; h0 += heads_per_pass) {
    const int64_t pass = std::min(heads_per_pass, kv_heads - h0);
    at::parallel_for(0, pass * keys, 64, [&](int64_t begin, int64_t stop) {
      for (int64_t task = begin; task < stop; ++task) {
        const int64_t h = task / keys, k = task % keys;
        const int64_t pos = base + k, slot = bp[pos / block_size] * block_size + pos % block_size;
        const int64_t at = ((slot * kv_heads + h0 + h) * dim) * element;
        if (b16) {  // keys [dim / 2][ldk][2], values [ldk / 2][dim][2]
          const uint16_t* ks = reinterpret_cast<const uint16_t*>(kp + at);
          const uint16_t* vs = reinterpret_cast<const uint16_t*>(vp + at);
          uint16_t* kt = scratch16.data() + h * per_head;
          uint16_t* vt = kt + ldk * dim + (k / 2) * dim * 2 + (k & 1);
          for (int64_t d = 0; d < dim; ++d) kt[(d / 2) * ldk * 2 + k * 2 + (d & 1)] = ks[d];
          for (int64_t d = 0; d < dim; ++d) vt[d * 2] = vs[d];
          continue;
        }
        float* kt = scratch.data() + h * per_head;
        float* vt = kt + ldk * dim + k * dim;
        if (pool_type == at::kFloat) {
          const float* ks = reinterpret_cast<const float*>(kp + at);
          for (int64_t d = 0; d < dim; ++d) kt[d * ldk + k] = ks[d];
          std::copy(reinterpret_cast<const float*>(vp + at), reinterpret_cast<const float*>(vp + at) + dim, vt);
        } else if (pool_type == at::kHalf) {
          widen(reinterpret_cast<const c10::Half*>(kp + at), reinterpret_cast<const c10::Half*>(vp + at), dim, ldk,
                kt + k, vt);
        } else {
          widen(reinterpret_cast<const c10::BFloat16*>(kp + at), reinterpret_cast<const c10::BFloat16*>(vp + at),
                dim, ldk, kt + k, vt);
        }
      }
    });
    for (int64_t h = 0; h < pass; ++h) {
      if (b16) {  // past the last key: zero keys and values (an odd last key pairs with a zero weight)
        uint16_t* kt = scratch16.data() + h * per_head;
        for (int64_t e = 0; e < dim / 2; ++e) std::fill(kt + (e * ldk + keys) * 2, kt + (e + 1) * ldk * 2, 0);
        for (int64_t k = keys; k < ldk; ++k)
          for (int64_t d = 0; d < dim; ++d) kt[ldk * dim + (k / 2) * dim * 2 + d * 2 + (k & 1)] = 0;
        continue;
      }
      for (int64_t d = 0; d < dim; ++d) {
        float* row = scratch.data() + h * per_head + d * ldk;
        std::fill(row + keys, row + ldk, 0.f);
      }
    }
    // (key head, token tile) tasks handed out one at a time, a key head at a time (its keys stay
    // in cache), within it the last tiles (the most keys) first.
    std::atomic<int64_t> next{0};
    const int64_t tasks = pass * tiles;
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
      const int64_t most = kTokenTile * group;
      std::vector<float> q(most * dim), top(most), total(most), o(most * dim), s(most * kKeyTile);
      std::vector<uint32_t> q16(b16 ? most * dim / 2 : 0);
      for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
        const int64_t h = t / tiles, kh = h0 + h, tile = tiles - 1 - t % tiles;
        const int64_t t0 = tile * kTokenTile, t1 = std::min(tokens, t0 + kTokenTile);
        for (int64_t i = t0; i < t1; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const float* src = qp + i * q_token + (kh * group + g) * q_head;
            const int64_t row = (i - t0) * group + g;
            if (b16) {  // the bfloat16 value's bits are the float32's upper half
              for (int64_t e = 0; e < dim / 2; ++e)
                q16[row * (dim / 2) + e] = (bits(src[2 * e]) >> 16) | (bits(src[2 * e + 1]) & 0xFFFF0000u);
              continue;
            }
            for (int64_t d = 0; d < dim; ++d) q[row * dim + d] = src[d] * static_cast<float>(scale);
          }
        if (b16) {
          const uint16_t* kt = scratch16.data() + h * per_head;
          attend(q16.data(), static_cast<float>(scale), t0, t1, group, start, window, base, kt, ldk, kt + ldk * dim,
                 top.data(), total.data(), o.data(), s.data());
        } else {
          const float* kt = scratch.data() + h * per_head;
          attend(q.data(), 1.f, t0, t1, group, start, window, base, kt, ldk, kt + ldk * dim, top.data(),
                 total.data(), o.data(), s.data());
        }
        for (int64_t i = t0; i < t1; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - t0) * group + g;
            const float inv = 1.f / total[r];
            float* dst = op + i * o_token + (kh * group + g) * o_head;
            for (int64_t d = 0; d < dim; ++d) dst[d] = o[r * dim + d] * inv;
          }
      }
    });
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention: this build has no AVX-512");
#endif
}
