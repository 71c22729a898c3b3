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
// ATen's tensor and the few operators used, not <torch/extension.h>: that header (the whole C++ frontend and
// pybind11) costs each file most of its compile time, and only the files that bind to Python need it.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// The products from 16- and 8-bit integer activations: VPDPWSSD and VPDPBUSD on AVX-512; on AVX2 with each panel in
// two 8-lane halves, VPMADDWD and VPMADDUBSW (or AVX-VNNI's 256-bit VPDPWSSD and VPDPBUSD). A CPU with AVX-512 but
// no VNNI takes an AVX2 build.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLM_WORD_PRODUCT 1
#define LLM_WORDS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define LLM_WORD_PRODUCT 1
#define LLM_WORDS_AVX2 1
#endif
// The product of formats 1 and 2 (float32 activations): 16-lane on AVX-512, two 8-lane halves a panel on AVX2.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LLM_FLOAT_BLOCKS 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel: one 16-lane register
constexpr int64_t kBlock = 32;  // weights per block, along the input dimension

// The two block formats, as the product stores them: per (panel of 16 outputs, block of 32 inputs) the 16
// scales, Q4_1's 16 minimums (float32 for formats 1 and 2, half precision for 3 and 4), then the 16 x 32 q in
// one of two arrangements.
//  - For float32 activations (formats 1 and 2), input by input: the 16 outputs' q of input j in 8 bytes for
//    Q4_1 (output i in the low nibble of byte i, output i + 8 in the high one) or 16 signed bytes for Q8_0.
//  - For 16-bit integer activations (formats 3 and 4), pair of inputs by pair: group g (inputs 2g and 2g + 1)
//    as 32 bytes, byte 2i + t = q of output i at input 2g + t, which widen to the 16-bit pairs a VPDPWSSD lane
//    multiplies. Q4_1 holds groups 4h..4h + 3 in 64 bytes, as 32 16-bit lanes: lane t's nibble j (bits 4j..4j + 3)
//    is group 4h + j's q at position t, so a shift and a mask give a group's pairs without a shuffle (1.25 times
//    the widening rate of bytes, which cost a VPMOVZXBW a group). Q8_0 holds each group's 32 signed bytes in turn.
//  - Formats 5 and 6 are the blocks of quantized checkpoints (GPTQ, AWQ, compressed-tensors, bitsandbytes int8,
//    GGUF k-quants; engine/cpu/quantized_checkpoint.py), w = d * q + m with q in 0..15 (5) or -128..127 (6), in
//    the arrangement of formats 3 and 4 but d and m in float32: a checkpoint's zero point makes m = -d * z, which
//    half precision does not hold exactly, and float32 does (d half precision or bfloat16, z at most 8 bits).
//  - Format 7 is format 6 with a scale per 16 inputs and no minimum (GGUF Q6_K: w = d * s * q per 16 weights,
//    q in -32..31): the header holds the 16 outputs' scales of inputs 0..15, then those of inputs 16..31.
//  - Formats 8 (d and m in half precision) and 9 (float32) hold q in 0..31 (GGUF Q5_0 / Q5_1 / Q5_K): the
//    nibbles as formats 3 and 5 hold them, then per group of 32 pairs a 32-bit word whose bit t is the fifth bit
//    of the group's q at position t: 0.625 or 0.75 bytes a weight, against 1.06 or 1.25 as 8-bit blocks.
enum Format : int64_t {
  kNone = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_1Words = 3, kQ8_0Words = 4, kQ4Scaled = 5, kQ8Scaled = 6, kQ8Halves = 7,
  kQ5Words = 8, kQ5Scaled = 9,
  // Formats 3, 5, 8 and 9 arranged for 8-bit integer activations (QUANTIZED_ACTIVATIONS=int8): the same headers,
  // bytes and bits, the q in quads (see arrange_quads) that VPDPBUSD multiplies four inputs a lane at a time.
  kQ4_1Quads = 10, kQ4ScaledQuads = 11, kQ5WordsQuads = 12, kQ5ScaledQuads = 13,
  // Formats 4, 6 and 7 (8-bit q) likewise: signed q, so the activations are the unsigned operand (qx + 128) and
  // 128 times the block's sum of q comes off each output's integer sum.
  kQ8_0Quads = 14, kQ8ScaledQuads = 15, kQ8HalvesQuads = 16,
  // 4-bit codes that index a table of 16 values (bitsandbytes' NF4 and FP4: w = absmax * table[q]): the nibbles
  // as format 5 holds them, a float32 scale per output and block (no minimum), and the table as 16-bit integers
  // (kCodes) that a VPERMW puts in place of the widened nibbles.
  kNf4Words = 17, kFp4Words = 18,
  // 4- and 5-bit q centred on 8 or 16 (GPTQ's symmetric int4, GGUF Q4_0 and Q5_0: w = d * (q - 8) or d * (q - 16))
  // with d alone in half precision: the minimum -8 d or -16 d is taken from it, so a weight is 4.5 or 5.5 bits,
  // as the file holds it, not 5 or 6. Formats 3 and 8 otherwise, and 21 and 22 their quads.
  kQ4Centered = 19, kQ5Centered = 20, kQ4CenteredQuads = 21, kQ5CenteredQuads = 22,
  // GGUF Q4_K / Q5_K's two-level scales: per block d = D s and m = -M t, s and t 6-bit integers (a byte each in
  // the block's header), D and M half-precision per output and super-block of 256 inputs, kept after the panel's
  // blocks (super_bytes per super-block). 4.625 and 5.625 bits a weight, as the file's 4.5 and 5.5, not 6 and 7.
  kQ4Super = 23, kQ5Super = 24, kQ4SuperQuads = 25, kQ5SuperQuads = 26,
  // GGUF Q6_K as the file holds it: q 0..63 as the low nibbles (format 5's arrangement) and per group of 32 pairs
  // two 32-bit words of the fifth and sixth bits, w = D s (q - 32) with s a signed byte per 16 inputs (the block's
  // header: the 16 outputs' s of inputs 0..15, then of 16..31) and D half precision per output and super-block of
  // 256 inputs, after the panel's blocks. 6.5625 bits a weight, against 10 in format 7.
  kQ6Super = 27,
  // 4-bit q with a zero point (AWQ, GPTQ with zero points: w = d * (q - z)): d in half precision and z as a byte
  // per output and block, m = -d z formed in float32 (exact: 11 bits times 8): 4.75 bits a weight, not 6 with
  // float32 d and m. 29: the same for 8-bit activations.
  kQ4Zero = 28, kQ4ZeroQuads = 29,
  // Format 27 for 8-bit activations: the nibbles by quads (as format 11 holds them), then per quad a 64-bit word of
  // fifth bits and one of sixth bits (bit 4i + t: output i, input 4j + t). q 0..63 is VPDPBUSD's unsigned operand,
  // and 32 times each row's integer sum over a half block comes off that half's integer sum: 6.5625 bits a
  // weight, against format 16's 10.
  kQ6SuperQuads = 30,
  // Formats 19 and 28 with one scale (and zero point) per 64 or 128 inputs, as GPTQ, AWQ and compressed-tensors
  // files hold their groups (128 is the usual size): no block header, the 16 outputs' d (then z) per group kept
  // after the panel's blocks as the K-quants' super-block scales are. 4.25 / 4.125 bits a weight symmetric, 4.375
  // / 4.1875 with zero points, against 4.5 and 4.75 with a header per 32 inputs: a decode step reads that much
  // less. 35-38: the same for 8-bit activations.
  kQ4CenteredBy64 = 31, kQ4CenteredBy128 = 32, kQ4ZeroBy64 = 33, kQ4ZeroBy128 = 34,
  kQ4CenteredBy64Quads = 35, kQ4CenteredBy128Quads = 36, kQ4ZeroBy64Quads = 37, kQ4ZeroBy128Quads = 38,
  // Formats 17 and 18 with one float32 scale per 64 or 128 inputs (bitsandbytes' usual blocksizes), kept after the
  // panel's blocks as 31-34 keep theirs: 4.5 / 4.25 bits a weight, not 5.
  kNf4By64 = 39, kNf4By128 = 40, kFp4By64 = 41, kFp4By128 = 42,
  // 8-bit q (-128..127, no minimum) with a float32 scale per 128 inputs (the last group may be shorter), kept after
  // the panel's blocks: a scale per output (bitsandbytes' int8 SCB, QUANTIZATION=int8, compressed-tensors' channel
  // scales) or per group of 128 (GPTQ, compressed-tensors). About 8.25 bits a weight, against 8.5 with
  // half-precision headers and 10 with float32 ones. 44: the same for 8-bit activations.
  kQ8By128 = 43, kQ8By128Quads = 44
};
constexpr int64_t kLastFormat = kQ8By128Quads;
constexpr bool quad_format(int64_t f) {
  return (f >= kQ4_1Quads && f <= kQ8HalvesQuads) || f == kQ4CenteredQuads || f == kQ5CenteredQuads ||
         f == kQ4SuperQuads || f == kQ5SuperQuads || f == kQ4ZeroQuads || f == kQ6SuperQuads ||
         (f >= kQ4CenteredBy64Quads && f <= kQ4ZeroBy128Quads) || f == kQ8By128Quads;
}
// Formats 31-34: d (and z) per group of 2 or 4 blocks, after the panel's blocks.
constexpr bool grouped(int64_t f) { return f >= kQ4CenteredBy64 && f <= kQ4ZeroBy128; }
constexpr bool grouped_zero(int64_t f) { return f == kQ4ZeroBy64 || f == kQ4ZeroBy128; }
// Formats 39-42: bitsandbytes' codes with a scale per group of 2 or 4 blocks, after the panel's blocks.
constexpr bool coded_groups(int64_t f) { return f >= kNf4By64 && f <= kFp4By128; }
constexpr bool eight_groups(int64_t f) { return f == kQ8By128; }
constexpr bool zero_point(int64_t f) { return f == kQ4Zero; }
constexpr bool super_scaled(int64_t f) { return f == kQ4Super || f == kQ5Super; }
constexpr bool six_bit(int64_t f) { return f == kQ6Super; }
constexpr bool per_sixteen(int64_t f) { return f == kQ8Halves || f == kQ6Super; }  // a scale per 16 inputs
constexpr int64_t kSuperBlocks = 8;  // blocks of 32 in a K-quant's super-block of 256 inputs
// A super-block's bytes after a panel's blocks: the 16 outputs' D and M (formats 23, 24) or D (27), half precision;
// a group's d (31, 32) or d and z (33, 34).
constexpr int64_t super_bytes(int64_t f) {
  return super_scaled(f) ? 16 * 2 * 2 : six_bit(f) || (grouped(f) && !grouped_zero(f)) ? 16 * 2
         : grouped_zero(f) ? 16 * 3 : coded_groups(f) || eight_groups(f) ? 16 * 4 : 0;
}
// The blocks a super-block (or group) spans.
constexpr int64_t super_blocks(int64_t f) {
  return f == kQ4CenteredBy64 || f == kQ4ZeroBy64 || f == kNf4By64 || f == kFp4By64 ? 2
         : f == kQ4CenteredBy128 || f == kQ4ZeroBy128 || f == kNf4By128 || f == kFp4By128 || f == kQ8By128 ? 4
                                                                                                  : kSuperBlocks;
}
// A panel's super-blocks (or groups) over k inputs; format 43's last group may be short.
constexpr int64_t super_groups(int64_t f, int64_t k) {
  const int64_t span = kBlock * super_blocks(f);
  return (k + span - 1) / span;
}
constexpr bool centered(int64_t f) { return f == kQ4Centered || f == kQ5Centered; }
constexpr bool coded(int64_t f) { return f == kNf4Words || f == kFp4Words || coded_groups(f); }
// The integer each code multiplies by, and the levels that stand for 1 (the scale is absmax / levels). FP4's
// values are multiples of 1/192, so its table is exact. NF4's are normal quantiles: rounded to 1/2047 (at most
// 2.1e-4 of the block's absmax off), the most the int32 sums hold with 16-bit activations: 32 products of 32767
// times 2047 stay under 2^31.
struct CodeTable {
  int16_t values[32];  // 16 codes, then zeros: one VPERMW register
  float levels;
};
constexpr CodeTable kNf4Codes = {{-2047, -1425, -1075, -808, -582, -378, -186, 0, 163, 329, 504, 692, 902, 1152, 1480,
                                  2047}, 2047.f};
constexpr CodeTable kFp4Codes = {{0, 1, 128, 192, 64, 96, 32, 48, 0, -1, -128, -192, -64, -96, -32, -48}, 192.f};
constexpr const CodeTable& code_table(int64_t f) {
  return f == kNf4Words || f == kNf4By64 || f == kNf4By128 ? kNf4Codes : kFp4Codes;
}
// The format whose headers and q bytes a quad format shares.
constexpr Format word_base(int64_t f) {
  return f == kQ4_1Quads ? kQ4_1Words : f == kQ4ScaledQuads ? kQ4Scaled : f == kQ5WordsQuads ? kQ5Words
         : f == kQ5ScaledQuads ? kQ5Scaled : f == kQ8_0Quads ? kQ8_0Words : f == kQ8ScaledQuads ? kQ8Scaled
         : f == kQ8HalvesQuads ? kQ8Halves : f == kQ4CenteredQuads ? kQ4Centered
         : f == kQ5CenteredQuads ? kQ5Centered : f == kQ4SuperQuads ? kQ4Super
         : f == kQ5SuperQuads ? kQ5Super : f == kQ4ZeroQuads ? kQ4Zero
         : f == kQ6SuperQuads ? kQ6Super : f == kQ8By128Quads ? kQ8By128
         : f >= kQ4CenteredBy64Quads && f <= kQ4ZeroBy128Quads ? static_cast<Format>(f - 4)
         : static_cast<Format>(f);
}

// One part of a product (a layer, or one of the layers whose outputs a fused projection puts side by side): its
// blocks, format and outputs, which start at column `col` of the result.
struct Part {
  const uint8_t* blocks;
  Format format;
  int64_t n, col;
};

constexpr bool four_bit(Format f) {
  return f == kQ4_1 || f == kQ4Scaled || coded(f) || f == kQ4Centered || f == kQ4Super || f == kQ4Zero || grouped(f);
}
constexpr bool five_bit(Format f) { return f == kQ5Words || f == kQ5Scaled || f == kQ5Centered || f == kQ5Super; }
constexpr bool float_header(Format f) { return f == kQ4Scaled || f == kQ8Scaled || f == kQ8Halves || f == kQ5Scaled; }
constexpr bool has_minimum(Format f) { return f != kQ8_0 && !per_sixteen(f) && !coded(f) && !eight_groups(f); }
constexpr int64_t header_bytes(Format f) { return (f == kQ4_1 ? 2 : 1) * kPanel * 4; }
constexpr int64_t input_bytes(Format f) {
  return four_bit(f) ? kPanel / 2 : five_bit(f) ? kPanel / 2 + kPanel / 8 : six_bit(f) ? kPanel / 2 + kPanel / 4
                                                                                  : kPanel;
}
constexpr int64_t block_bytes(Format f) { return header_bytes(f) + kBlock * input_bytes(f); }
// Formats 3 and 4 keep d (and m) in half precision, as the GGUF file does: 5 bits a Q4_1 weight, not 6.
constexpr int64_t word_header_bytes(Format f) {
  return grouped(f) || coded_groups(f) || eight_groups(f) ? 0
         : coded(f) ? kPanel * 4
         : zero_point(f) ? kPanel * 3
         : centered(f) || super_scaled(f) || six_bit(f) ? kPanel * 2
         : float_header(f) ? 2 * kPanel * 4
                           : (f == kQ4_1 || f == kQ5Words ? 2 : 1) * kPanel * 2;
}
constexpr int64_t word_block_bytes(Format f) { return word_header_bytes(f) + kBlock * input_bytes(f); }
// A panel's bytes in a word or quad format (`f` its word base) for k inputs: its blocks, then any super-blocks'.
constexpr int64_t word_panel_bytes(Format f, int64_t k) {
  return (k / kBlock) * word_block_bytes(f) + super_groups(f, k) * super_bytes(f);
}
constexpr int64_t layout_block_bytes(Format f, bool words) { return words ? word_block_bytes(f) : block_bytes(f); }

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

// The byte of input group g's 32 (see Format) at position t: output t / 2, input 2g + t % 2.
inline int8_t word_q(const int8_t (*q)[kBlock], int g, int t) { return q[t / 2][2 * g + t % 2]; }

// A panel's block of q (16 outputs x 32 inputs) in the arrangement for 16-bit activations (see Format); with
// `Four`, the low 4 bits of each q.
template <bool Four>
void arrange_words(const int8_t (*q)[kBlock], uint8_t* qs) {
  if constexpr (Four) {
    for (int h = 0; h < 4; ++h)
      for (int t = 0; t < 32; ++t) {
        uint16_t lane = 0;
        for (int j = 0; j < 4; ++j) lane |= static_cast<uint16_t>((word_q(q, 4 * h + j, t) & 15) << (4 * j));
        std::memcpy(qs + 64 * h + 2 * t, &lane, 2);
      }
  } else {
    for (int g = 0; g < 16; ++g)
      for (int t = 0; t < 32; ++t) qs[32 * g + t] = static_cast<uint8_t>(word_q(q, g, t));
  }
}

// A panel's block of 4-, 5- or 6-bit q in the arrangement for 8-bit activations: quad j (inputs 4j..4j+3) as 64
// bytes, byte 4i + t = q of output i at input 4j + t; quads 2v and 2v + 1 share 64 bytes (low and high nibbles).
// 5- and 6-bit q add, per quad, a 64-bit word whose bit 4i + t is that q's fifth bit (and then one of sixth bits).
// The sizes are those of the arrangement for 16-bit activations.
template <int Bits>
void arrange_quads(const int8_t (*q)[kBlock], uint8_t* qs) {
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < kPanel; ++i)
      for (int t = 0; t < 4; ++t)
        qs[64 * v + 4 * i + t] = static_cast<uint8_t>((q[i][8 * v + t] & 15) | ((q[i][8 * v + 4 + t] & 15) << 4));
  for (int j = 0; j < 8; ++j)
    for (int bit = 4; bit < Bits; ++bit) {
      uint64_t high = 0;
      for (int i = 0; i < kPanel; ++i)
        for (int t = 0; t < 4; ++t) high |= static_cast<uint64_t>((q[i][4 * j + t] >> bit) & 1) << (4 * i + t);
      std::memcpy(qs + kBlock * kPanel / 2 + 8 * ((Bits - 4) * j + bit - 4), &high, 8);
    }
}

// 8-bit q by quads: quad j (inputs 4j..4j+3) as 64 bytes, byte 4i + t = q of output i at input 4j + t.
void arrange_quads8(const int8_t (*q)[kBlock], uint8_t* qs) {
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < kPanel; ++i)
      for (int t = 0; t < 4; ++t) qs[64 * j + 4 * i + t] = static_cast<uint8_t>(q[i][4 * j + t]);
}

// Bit `bit` of input group g's 32 q (see Format) as a 32-bit word, bit t for position t.
inline uint32_t group_bits(const int8_t (*q)[kBlock], int g, int bit) {
  uint32_t word = 0;
  for (int t = 0; t < 32; ++t) word |= static_cast<uint32_t>((word_q(q, g, t) >> bit) & 1) << t;
  return word;
}

// A panel's block of 5- or 6-bit q (0..31, 0..63) for 16-bit activations: the low nibbles as the 4-bit formats
// hold them, then per group of 32 pairs a 32-bit word of fifth bits (and then one of sixth bits).
template <int Bits>
void arrange_high_bits(const int8_t (*tile)[kBlock], uint8_t* qs) {
  arrange_words<true>(tile, qs);
  for (int g = 0; g < 16; ++g)
    for (int bit = 4; bit < Bits; ++bit) {
      const uint32_t word = group_bits(tile, g, bit);
      std::memcpy(qs + kBlock * kPanel / 2 + 4 * ((Bits - 4) * g + bit - 4), &word, 4);
    }
}

// A panel's block of 4-, 5-, 6- or 8-bit q in the arrangement its product reads: for 16-bit activations, or by
// quads for 8-bit ones (`quads`).
void arrange(const int8_t (*tile)[kBlock], uint8_t* qs, int64_t bits, bool quads) {
  if (quads) {
    if (bits == 8) arrange_quads8(tile, qs);
    else if (bits == 6) arrange_quads<6>(tile, qs);
    else if (bits == 5) arrange_quads<5>(tile, qs);
    else arrange_quads<4>(tile, qs);
  } else if (bits == 4) {
    arrange_words<true>(tile, qs);
  } else if (bits == 5) {
    arrange_high_bits<5>(tile, qs);
  } else if (bits == 6) {
    arrange_high_bits<6>(tile, qs);
  } else {
    arrange_words<false>(tile, qs);
  }
}

// The q of block b of the panel whose first output is row0, from q [out, k].
inline void panel_tile(const int8_t* q, int64_t k, int64_t row0, int64_t b, int8_t (*tile)[kBlock]) {
  for (int64_t i = 0; i < kPanel; ++i) std::memcpy(tile[i], q + (row0 + i) * k + b * kBlock, kBlock);
}

template <Format F>
bool pack_panel(const float* w, int64_t k, uint8_t* out, bool words) {
  int8_t q[kPanel][kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    uint8_t* dst = out + b * layout_block_bytes(F, words);
    float scales[kPanel], minimums[kPanel];
    for (int64_t i = 0; i < kPanel; ++i)
      if (!recover_block<F>(w + i * k + b * kBlock, scales[i], minimums[i], q[i])) return false;
    if (words) {  // d and m are half-precision values (recover_block), so these hold them exactly
      uint16_t halves[2 * kPanel];
      for (int64_t i = 0; i < kPanel; ++i) halves[i] = at::Half(scales[i]).x, halves[kPanel + i] = at::Half(minimums[i]).x;
      std::memcpy(dst, halves, word_header_bytes(F));
    } else {
      std::memcpy(dst, scales, sizeof scales);
      if (F == kQ4_1) std::memcpy(dst + sizeof scales, minimums, sizeof minimums);
    }
    uint8_t* qs = dst + (words ? word_header_bytes(F) : header_bytes(F));
    if (words) {
      arrange_words<F == kQ4_1>(q, qs);
      continue;
    }
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
#if defined(LLM_FLOAT_BLOCKS)
  return true;
#else
  return false;
#endif
}

bool word_blocks_supported() {
#if defined(LLM_WORD_PRODUCT)
  return true;
#else
  return false;
#endif
}

bool quad_blocks_supported() {
#if defined(LLM_WORD_PRODUCT)
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
// once per block for few rows, d * sum(x q) + m * sum(x), is slightly faster but breaks that.)

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

#if defined(LLM_WORDS_AVX512)

constexpr int kWordRows = 6, kQuadRows = 8, kGroupRows = 8;  // row tiles (see the product below)

// 16 inputs as float32, from float32 or bfloat16 rows (a bfloat16 value is the top half of its float32).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// A block of 32 inputs' largest magnitude and sum (in _mm512_reduce_add_ps's order, which the AVX2 build keeps).
template <typename T>
inline void block_extent(const T* xb, float& most, float& sum) {
  const __m512 a = load16(xb), c = load16(xb + 16);
  most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
}

// A block of 32 inputs times to_q, rounded to the nearest integer and saturated to Q.
template <typename Q, typename T>
inline void round_block(const T* xb, float to_q, Q* qb) {
  const __m512 scale = _mm512_set1_ps(to_q);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb), scale));
  const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb + 16), scale));
  if constexpr (sizeof(Q) == 2) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(qb), _mm512_cvtsepi32_epi16(qa));
    _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 16), _mm512_cvtsepi32_epi16(qc));
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qa));
    _mm_store_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qc));
  }
}
#endif
}  // namespace
#endif


#if defined(LLM_FLOAT_BLOCKS) && !defined(__AVX512F__)
namespace {

// AVX2 (x86-64-v3): the product of formats 1 and 2 with each panel's 16 outputs in two 8-lane halves. The same
// sums as the AVX-512 variant's, bit for bit: each output's terms in input order, one fused multiply-add per
// weight, by the same weights (q * d is exact in float32 for 4- and 8-bit q and half-precision d, so
// fl(fl(q * d) + m) is what any contraction gives too).

// The 16 weights of input j in a panel's block: outputs 0..7 in `low`, 8..15 in `high`.
template <Format F>
inline void weights_at(const uint8_t* block, int64_t j, __m256& low, __m256& high) {
  const float* header = reinterpret_cast<const float*>(block);
  const uint8_t* qs = block + header_bytes(F) + j * input_bytes(F);
  if constexpr (F == kQ4_1) {  // 8 bytes: output i in the low nibble of byte i, output i + 8 in the high one
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs));
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    low = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(header)),
                        _mm256_loadu_ps(header + kPanel));
    high = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(header + 8)),
                         _mm256_loadu_ps(header + kPanel + 8));
  } else {  // 16 signed bytes, output i in byte i
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    low = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_loadu_ps(header));
    high = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))),
                         _mm256_loadu_ps(header + 8));
  }
}

// A panel's weights expanded to float32, [k, stride] from column 0.
template <Format F>
void expand_panel(const uint8_t* panel, int64_t k, float* w, int64_t stride) {
  for (int64_t b = 0; b < k / kBlock; ++b)
    for (int64_t j = 0; j < kBlock; ++j) {
      __m256 low, high;
      weights_at<F>(panel + b * block_bytes(F), j, low, high);
      _mm256_storeu_ps(w + (b * kBlock + j) * stride, low);
      _mm256_storeu_ps(w + (b * kBlock + j) * stride + 8, high);
    }
}

// R rows times one panel, expanding its weights in registers as they stream in (2R sums, the two halves of a
// weight and a broadcast input fit AVX2's 16 registers for R <= 6).
template <Format F, int R>
void rows_by_panel(const float* x, int64_t k, const uint8_t* panel, float* out, int64_t n) {
  __m256 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* block = panel + b * block_bytes(F);
    const float* xb = x + b * kBlock;
    for (int64_t j = 0; j < kBlock; ++j) {
      __m256 low, high;
      weights_at<F>(block, j, low, high);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(xb[r * k + j]);
        sums[r][0] = _mm256_fmadd_ps(xv, low, sums[r][0]);
        sums[r][1] = _mm256_fmadd_ps(xv, high, sums[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * n, sums[r][0]);
    _mm256_storeu_ps(out + r * n + 8, sums[r][1]);
  }
}

// R rows times one panel already expanded to float32 ([k, 16]): for more rows, where each expanded weight
// serves every row.
template <int R>
void rows_by_expanded(const float* x, int64_t k, const float* w, float* out, int64_t n) {
  __m256 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    const __m256 low = _mm256_loadu_ps(w + j * kPanel), high = _mm256_loadu_ps(w + j * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * k + j]);
      sums[r][0] = _mm256_fmadd_ps(xv, low, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(xv, high, sums[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * n, sums[r][0]);
    _mm256_storeu_ps(out + r * n + 8, sums[r][1]);
  }
}

constexpr int kRowTile = 6;
using StreamFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t);
using ExpandedFn = void (*)(const float*, int64_t, const float*, float*, int64_t);

template <Format F, int... I>
constexpr std::array<StreamFn, sizeof...(I)> stream_table(std::integer_sequence<int, I...>) {
  return {&rows_by_panel<F, I + 1>...};
}
template <int... I>
constexpr std::array<ExpandedFn, sizeof...(I)> expanded_table(std::integer_sequence<int, I...>) {
  return {&rows_by_expanded<I + 1>...};
}
const auto kStreamQ4 = stream_table<kQ4_1>(std::make_integer_sequence<int, kRowTile>{});
const auto kStreamQ8 = stream_table<kQ8_0>(std::make_integer_sequence<int, kRowTile>{});
const auto kExpanded = expanded_table(std::make_integer_sequence<int, kRowTile>{});

template <Format F>
void product(const float* x, int64_t rows, int64_t k, const uint8_t* packed, float* out, int64_t n) {
  const int64_t panels = n / kPanel, panel_bytes = (k / kBlock) * block_bytes(F);
  if (rows <= kRowTile) {
    const auto& stream = F == kQ4_1 ? kStreamQ4 : kStreamQ8;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) stream[rows - 1](x, k, packed + p * panel_bytes, out + p * kPanel, n);
    });
    return;
  }
  // Each panel expanded once into a buffer that stays in cache, then multiplied by every row, in even tiles.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(k * kPanel);
    const int64_t tiles = (rows + kRowTile - 1) / kRowTile, tile = (rows + tiles - 1) / tiles;
    for (int64_t p = begin; p < end; ++p) {
      expand_panel<F>(packed + p * panel_bytes, k, w.data(), kPanel);
      for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t r = std::min<int64_t>(tile, rows - r0);
        kExpanded[r - 1](x + r0 * k, k, w.data(), out + r0 * n + p * kPanel, n);
      }
    }
  });
}

#if defined(LLM_WORDS_AVX2)
// The AVX2 product from 16-bit integer activations (below, after the shared row quantization): tiles of up to 6
// rows, as the AVX-512 one's (a tile's 6 sums, 6 integer sums, a weight and a broadcast pair fit 16 registers).
constexpr int kWordRows = 6, kQuadRows = 8, kGroupRows = 6;

// 8 inputs as float32, from float32 or bfloat16 rows.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// A block of 32 inputs' largest magnitude and sum, the sum in the order the AVX-512 build takes it
// (_mm512_reduce_add_ps of the two 16-lane halves' sum), so both builds quantize a row alike.
template <typename T>
inline void block_extent(const T* xb, float& most, float& sum) {
  const __m256 a0 = load8(xb), a1 = load8(xb + 8), c0 = load8(xb + 16), c1 = load8(xb + 24);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, c0)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, a1), _mm256_andnot_ps(sign, c1)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(top, 1), _mm256_castps256_ps128(top));
  m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
  most = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const __m256 lanes = _mm256_add_ps(_mm256_add_ps(a1, c1), _mm256_add_ps(a0, c0));  // lanes 8..15 + lanes 0..7
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(lanes, 1), _mm256_castps256_ps128(lanes));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  sum = _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}

// A block of 32 inputs times to_q, rounded to the nearest integer and saturated to Q.
template <typename Q, typename T>
inline void round_block(const T* xb, float to_q, Q* qb) {
  const __m256 scale = _mm256_set1_ps(to_q);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + 8 * i), scale));
  if constexpr (sizeof(Q) == 2) {  // packs interleave 128-bit lanes: a permute puts them back in order
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
  } else {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}
#endif
}  // namespace
#endif

#if defined(LLM_WORD_PRODUCT)
namespace {

// The product for 16-bit integer activations (formats 3 and 4). Each row's block of 32 inputs becomes x ~ s * qx
// with qx in -32767..32767 (s = its largest magnitude / 32767), so an output's block term is
// d * s * sum(q * qx) + m * sum(x): the sum of q * qx is exact in 32-bit integers and VPDPWSSD multiplies 32 of
// them per instruction where a float32 FMA does 16. The activation rounding is 2^-16 of the block's largest
// magnitude, about 256 times finer than bfloat16's. Every step of a row's result depends on that row alone, so
// it does not change with how many rows share the call.
// Rows are multiplied in tiles of at most kWordRows, of even sizes (13 rows: 5 + 4 + 4, 32: 6 + 6 + 5 + 5 + 5 + 5).
// 8-bit activations take one tile of up to kQuadRows where that is all the rows: a call's first tile reads the
// weights from memory while it multiplies, the others from cache, so 7 or 8 rows in one tile, not two, overlap
// the reading with the multiplies once. More rows keep tiles of up to kWordRows (tiles of 8 spill registers).
// Formats 31-34 keep their sums in `out` between spans of blocks, not in registers, which leaves room for tiles of
// up to kGroupRows from 9 rows up: 16 rows as 8 + 8, not 6 + 5 + 5, so each weight load serves more rows. 7 and 8
// rows stay two tiles (one tile of 8 was slower on some layer shapes: docs/experiments.md).
struct RowTiles {
  int64_t count = 0, base = 0, extra = 0;  // the first `extra` tiles hold base + 1 rows, the others base
  RowTiles() = default;
  RowTiles(int64_t rows, int64_t most)
      : count((rows + most - 1) / most), base(rows / count), extra(rows % count) {}
  int64_t size(int64_t t) const { return base + (t < extra); }
  int64_t first_row(int64_t t) const { return t * base + std::min(t, extra); }
  int64_t of_row(int64_t row) const {  // the tile holding `row`
    return row < extra * (base + 1) ? row / (base + 1) : extra + (row - extra * (base + 1)) / base;
  }
};

// Each tile's rows are stored interleaved, so that the product reads a block's inputs for all of them from one
// place: the tile of R rows starting at row0 holds pair g of block b of its row r (inputs 2g and 2g + 1) at
// q[row0 * k + ((b * 16 + g) * R + r) * 2], and that block's scale and sum at [row0 * blocks + b * R + r].
// With 8-bit activations (formats 10-16) the same holds bytes by quads: quad j (inputs 4j..4j+3) of block b of
// row r at byte row0 * k + ((b * 8 + j) * R + r) * 4 (see quantize_rows).
template <typename Q>
struct Rows {
  std::vector<Q> q;  // [rows * k]
  std::vector<float> scale, sum;  // [rows * k / 32]
  // 8-bit rows for format 30 only (asked for by quantize_rows' `halves`): each block's integer sums of qx over
  // inputs 0..15 and 16..31, [rows * k / 16] at 2 * (the block's scale index) + half. Format 30's unsigned q stand
  // for q - 32 (see Format).
  std::vector<int32_t> halves;
  RowTiles tiles;  // the tiles whose rows q interleaves
  // Blocks that share one scale (16-bit rows): 1, or 2 or 4 where every part has a scale per group of 64 or 128
  // inputs (formats 31-34), whose products then take a span's integer sums to float32 once, not once a block.
  // Each block's slots hold its span's scale and sum.
  int64_t span = 1;
};
using QuantizedRows = Rows<int16_t>;
using ByteRows = Rows<int8_t>;

// Rows x [rows, k] as Q integers per block of 32 inputs: 16-bit (qx in -32767..32767, steps of the largest
// magnitude of the block's `span` of blocks / 32767) or 8-bit (-127..127, / 127, as llama.cpp's Q8 activations),
// interleaved by tiles; `halves`: the 8-bit rows' half-block sums as well.
template <typename Q, typename T>
Rows<Q> quantize_rows(const T* x, int64_t rows, int64_t k, bool halves = false, int64_t span = 1) {
  constexpr float kLevels = sizeof(Q) == 2 ? 32767.f : 127.f;
  constexpr int kUnit = 4 / sizeof(Q);  // the values a 32-bit lane multiplies: a pair or a quad
  const int64_t blocks = k / kBlock;
  const RowTiles tiles(rows, sizeof(Q) == 1 ? (rows <= kQuadRows ? kQuadRows : kWordRows)
                             : span > 1 && rows > kGroupRows ? kGroupRows : kWordRows);
  Rows<Q> out{std::vector<Q>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks),
              std::vector<int32_t>(sizeof(Q) == 1 && halves ? 2 * rows * blocks : 0), tiles, span};
  // One (row, span) an iteration: the span's largest magnitude and sum once, then each of its blocks rounded.
  TORCH_CHECK(span > 0 && blocks % span == 0, "quantize_rows: the inputs must be whole spans of blocks");
  const int64_t spans = blocks / span;
  at::parallel_for(0, rows * spans, std::max<int64_t>(1, 64 / span), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / spans, first = (i % spans) * span, tile = tiles.of_row(row);
      const int64_t row0 = tiles.first_row(tile), tile_rows = tiles.size(tile), r = row - row0;
      float largest = 0.f, sum = 0.f;
      for (int64_t b = first; b < first + span; ++b) {
        float most, block_sum;
        block_extent(x + row * k + b * kBlock, most, block_sum);
        sum += block_sum;
        largest = std::isfinite(most) ? std::max(largest, most) : std::numeric_limits<float>::quiet_NaN();
      }
      // NaN or infinity in x: the row's outputs become NaN, as a float32 product's would not be finite (every
      // block of the span takes the span's NaN scale).
      const bool finite = std::isfinite(sum) && std::isfinite(largest);
      for (int64_t b = first; b < first + span; ++b) {
        const T* xb = x + row * k + b * kBlock;
        alignas(64) Q qb[kBlock];
        const int64_t at = row0 * blocks + b * tile_rows + r;
        out.scale[at] = finite ? largest / kLevels : std::numeric_limits<float>::quiet_NaN();
        if (finite && largest > 0.f && largest < 1e-30f) {
          // Inputs near the bottom of float32's range, where kLevels / largest overflows: rounded in double.
          const double to_q = kLevels / static_cast<double>(largest);
          for (int j = 0; j < kBlock; ++j)
            qb[j] = static_cast<Q>(std::clamp(std::nearbyint(static_cast<float>(xb[j]) * to_q), -double{kLevels},
                                              double{kLevels}));
        } else {
          round_block(xb, finite && largest > 0.f ? kLevels / largest : 0.f, qb);
        }
        out.sum[at] = sum;
        if (sizeof(Q) == 1 && halves)
          for (int h = 0; h < 2; ++h)
            out.halves[2 * at + h] = std::accumulate(qb + 16 * h, qb + 16 * h + 16, int32_t{0});
        Q* units = out.q.data() + row0 * k + (b * (kBlock / kUnit) * tile_rows + r) * kUnit;
        for (int g = 0; g < kBlock / kUnit; ++g) std::memcpy(units + g * tile_rows * kUnit, qb + kUnit * g, 4);
      }
    }
  });
  return out;
}

// Block b's super-block (or group) scales after a panel's blocks (formats 23, 24, 27 and 31-34; elsewhere unused).
template <Format F>
inline const uint8_t* block_super(const uint8_t* panel, int64_t b, int64_t blocks) {
  return panel + blocks * word_block_bytes(F) + (b / super_blocks(F)) * super_bytes(F);
}

// A call's rows quantized for the parts that take them: 16-bit pairs (formats 3-9), 8-bit quads (10-16).
struct Activations {
  QuantizedRows words;
  ByteRows bytes;
};

}  // namespace
#endif

#if defined(LLM_WORDS_AVX512)
namespace {

// Group g (inputs 2g and 2g + 1) of a panel's block as the 16-bit pairs a VPDPWSSD lane multiplies, from the
// block's q (`qs`, past its header).
template <Format F>
inline __m512i block_group(const uint8_t* qs, int g) {
  if constexpr (five_bit(F)) {  // the nibbles, plus 16 where the group's word of fifth bits says so
    const __m512i low = block_group<kQ4Scaled>(qs, g);
    uint32_t high;
    std::memcpy(&high, qs + kBlock * kPanel / 2 + 4 * g, 4);
    return _mm512_mask_add_epi16(low, static_cast<__mmask32>(high), low, _mm512_set1_epi16(16));
  } else if constexpr (six_bit(F)) {  // the nibbles, plus 16 and 32 where the group's two words say, less 32
    __m512i v = block_group<kQ4Scaled>(qs, g);
    uint32_t fifth, sixth;
    std::memcpy(&fifth, qs + kBlock * kPanel / 2 + 8 * g, 4);
    std::memcpy(&sixth, qs + kBlock * kPanel / 2 + 8 * g + 4, 4);
    v = _mm512_mask_add_epi16(v, static_cast<__mmask32>(fifth), v, _mm512_set1_epi16(16));
    v = _mm512_mask_add_epi16(v, static_cast<__mmask32>(sixth), v, _mm512_set1_epi16(32));
    return _mm512_sub_epi16(v, _mm512_set1_epi16(32));
  } else if constexpr (coded(F)) {  // the nibbles index the table
    return _mm512_permutexvar_epi16(block_group<kQ4Scaled>(qs, g), _mm512_loadu_si512(code_table(F).values));
  } else if constexpr (four_bit(F)) {
    const __m512i lanes = _mm512_loadu_si512(qs + 64 * (g / 4));
    const __m512i shifted = g % 4 == 0 ? lanes : _mm512_srli_epi16(lanes, 4 * (g % 4));
    return g % 4 == 3 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi16(0x0F));
  } else {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g)));
  }
}

// 16 half-precision values, or 16 unsigned or signed bytes, at `p` as float32.
inline __m512 halves_at(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 bytes_at(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 signed_bytes_at(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The scales of inputs 0..15 (half 0) or 16..31 (half 1) of a block in a format with a scale per 16 inputs:
// float32 in the header (7), or D times the header's signed bytes (27).
template <Format F>
inline __m512 half_scales(const uint8_t* header, const uint8_t* super, int half) {
  if constexpr (six_bit(F)) return _mm512_mul_ps(halves_at(super), signed_bytes_at(header + half * kPanel));
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(header) + half * kPanel);
}

// A panel's block header as the 16 outputs' scales d and minimums m (zero where the format has none); the formats
// with a scale per 16 inputs give those of inputs 16..31 (those of 0..15 are taken mid-block).
template <Format F>
inline void block_scales(const uint8_t* header, __m512& d, __m512& m, const uint8_t* super) {
  m = _mm512_setzero_ps();
  if constexpr (per_sixteen(F)) {
    d = half_scales<F>(header, super, 1);
  } else if constexpr (super_scaled(F)) {  // d = D s, m = -M t, each product rounded to float32 as ggml's
    d = _mm512_mul_ps(halves_at(super), bytes_at(header));
    m = _mm512_sub_ps(m, _mm512_mul_ps(halves_at(super + 2 * kPanel), bytes_at(header + kPanel)));
  } else if constexpr (coded(F) || eight_groups(F)) {
    d = _mm512_loadu_ps(reinterpret_cast<const float*>(coded(F) && !coded_groups(F) ? header : super));
  } else if constexpr (float_header(F)) {
    d = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
    m = _mm512_loadu_ps(reinterpret_cast<const float*>(header) + kPanel);
  } else if constexpr (zero_point(F)) {  // m = -d z
    d = halves_at(header);
    m = _mm512_sub_ps(m, _mm512_mul_ps(d, bytes_at(header + 2 * kPanel)));
  } else if constexpr (grouped_zero(F)) {  // the group's d and z
    d = halves_at(super);
    m = _mm512_sub_ps(m, _mm512_mul_ps(d, bytes_at(super + 2 * kPanel)));
  } else if constexpr (grouped(F)) {  // the group's d, m = -8 d
    d = halves_at(super);
    m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
  } else if constexpr (centered(F)) {
    d = halves_at(header);
    m = _mm512_mul_ps(d, _mm512_set1_ps(F == kQ4Centered ? -8.f : -16.f));
  } else {
    d = halves_at(header);
    if constexpr (has_minimum(F)) m = halves_at(header + 2 * kPanel);
  }
}

// The end of block b for P panels and R rows (both integer products): each panel's integer sums times its scales
// d (`add_scaled`, which knows the product's accumulators), then the minimum's term, m times each row's exact sum.
template <Format F, int R, int P, typename AddScaled>
inline void end_block(const uint8_t* headers, int64_t panel_bytes, int64_t b, int64_t blocks, const float* x_sum,
                      AddScaled& add_scaled, __m512 (&sums)[R][P]) {
  for (int p = 0; p < P; ++p) {
    __m512 d, m;
    const uint8_t* panel = headers + p * panel_bytes;
    block_scales<F>(panel + b * word_block_bytes(F), d, m, block_super<F>(panel, b, blocks));
    add_scaled(p, d);
    if constexpr (has_minimum(F))
      for (int r = 0; r < R; ++r) sums[r][p] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_sum[b * R + r]), sums[r][p]);
  }
}

// Where a product puts the next panel pair's blocks while it multiplies this pair's: for few rows (`rate`: the
// rows times the inputs a lane multiplies, over two) a pair is done before L1 could hold both pairs' blocks, so
// they go to L2 (1 and 2 rows of 16-bit activations, 1 to 4 of 8-bit: 1.1 to 1.2 times as fast from memory);
// for more rows L1 (L2 was 0.9 times as fast).
template <int Rate>
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + line), Rate <= 2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

// Where the weights of a tile come from: the first tile of a panel pair widens them from the blocks itself (and
// keeps them in a cache-resident buffer when more tiles follow), the other tiles read that buffer. Widening in
// a pass of its own cost a quarter of the product at 16 rows: its stores did not overlap the multiplies.
enum class Weights { kWiden, kWidenAndKeep, kKept };

// R rows times P panels: the panels' blocks `panel_bytes` apart from `headers`, their widened pairs (kept or
// read) at w [k / 32][16 groups][P][32]. Few tiles leave the 16 chained VPDPWSSD of a block waiting on each
// other's latency, so R * P <= 2 splits each chain in two.
// Formats 31-34 (grouped) add a span of blocks' integer sums (QuantizedRows::span), scaled, to their float32 sums;
// the others add each block's.
template <Format F, int R, int P, Weights W>
void rows_by_words(const QuantizedRows& xq, int64_t row0, int64_t k, int16_t* w, const uint8_t* headers,
                   int64_t panel_bytes, float* out, int64_t n) {
  // A span's sums chain 32 or 64 VPDPWSSD, not 16: 2 or 3 rows split them too, so the chains' latency stays hidden.
  constexpr int A = R * P <= 2 || (grouped(F) && R * P <= 6) ? 2 : 1;
  // A span is 1, 2, 4 or 8 blocks: its first and last blocks by a mask (b % span took an integer division a block).
  const int64_t blocks = k / kBlock, span = grouped(F) ? xq.span : 1, last = span - 1;
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(xq.q.data() + row0 * k);
  const float* x_scale = xq.scale.data() + row0 * blocks;
  const float* x_sum = xq.sum.data() + row0 * blocks;
  // Tiles of more than kWordRows (formats 31-34 only) keep their sums in `out`: registers would spill.
  constexpr bool kSumsInOut = R > kWordRows;
  __m512 sums[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_ps();
  __m512i acc[A][R][P];
  for (int64_t b = 0; b < blocks; ++b) {
    if ((b & last) == 0)
      for (int a = 0; a < A; ++a)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) acc[a][r][p] = _mm512_setzero_si512();
    // Panel p's integer sums of this block (or its first half), times the scales d and each row's activation
    // scale, into the rows' float32 sums.
    auto add_scaled = [&](int p, __m512 d) {
      for (int r = 0; r < R; ++r) {
        __m512i total = acc[0][r][p];
        if constexpr (A == 2) total = _mm512_add_epi32(total, acc[1][r][p]);
        sums[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(x_scale[b * R + r])),
                                     sums[r][p]);
      }
    };
    int16_t* wb = w + b * 16 * P * 32;
    const int32_t* xb = x_pairs + b * 16 * R;
    const uint8_t* qs[P];
    for (int p = 0; p < P; ++p) qs[p] = headers + p * panel_bytes + b * word_block_bytes(F) + word_header_bytes(F);
    if constexpr (W != Weights::kKept) {
      // The same block of the next panel pair, which this thread multiplies next: a step's weights come from
      // memory, and the hardware prefetcher does not run a pair ahead.
      for (int p = 0; p < P; ++p)
        prefetch_block<R>(headers + (P + p) * panel_bytes + b * word_block_bytes(F), word_block_bytes(F));
    }
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      __m512i wg[P];
      for (int p = 0; p < P; ++p) {
        if constexpr (W == Weights::kKept) {
          wg[p] = _mm512_load_si512(wb + (g * P + p) * 32);
        } else {
          wg[p] = block_group<F>(qs[p], g);
          if constexpr (W == Weights::kWidenAndKeep) _mm512_store_si512(wb + (g * P + p) * 32, wg[p]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xb[g * R + r]);
        for (int p = 0; p < P; ++p) acc[g % A][r][p] = _mm512_dpwssd_epi32(acc[g % A][r][p], xv, wg[p]);
      }
      if constexpr (per_sixteen(F)) {
        if (g == 7) {  // inputs 0..15 done: their sums take the first scales, and the sums start again
          for (int p = 0; p < P; ++p) {
            const uint8_t* panel = headers + p * panel_bytes;
            add_scaled(p, half_scales<F>(panel + b * word_block_bytes(F), block_super<F>(panel, b, blocks), 0));
            for (int a = 0; a < A; ++a)
              for (int r = 0; r < R; ++r) acc[a][r][p] = _mm512_setzero_si512();
          }
        }
      }
    }
    if constexpr (grouped(F)) {
      if ((b & last) == last) {  // a span lies within one group: its d and m serve every block of it
        for (int p = 0; p < P; ++p) {
          __m512 d, m;
          const uint8_t* panel = headers + p * panel_bytes;
          block_scales<F>(panel + b * word_block_bytes(F), d, m, block_super<F>(panel, b, blocks));
          for (int r = 0; r < R; ++r) {
            __m512i total = acc[0][r][p];
            if constexpr (A == 2) total = _mm512_add_epi32(total, acc[1][r][p]);
            const __m512 term = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total),
                                                _mm512_mul_ps(d, _mm512_set1_ps(x_scale[b * R + r])),
                                                _mm512_mul_ps(m, _mm512_set1_ps(x_sum[b * R + r])));
            // The first span's term as it is, in both places, so a row's result does not depend on its tile.
            if constexpr (kSumsInOut) {
              float* o = out + r * n + p * kPanel;
              _mm512_storeu_ps(o, b + 1 == span ? term : _mm512_add_ps(_mm512_loadu_ps(o), term));
            } else {
              sums[r][p] = b + 1 == span ? term : _mm512_add_ps(sums[r][p], term);
            }
          }
        }
      }
    } else {
      end_block<F, R, P>(headers, panel_bytes, b, blocks, x_sum, add_scaled, sums);
    }
  }
  if constexpr (!kSumsInOut)
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + r * n + p * kPanel, sums[r][p]);
}

using WordFn = void (*)(const QuantizedRows&, int64_t, int64_t, int16_t*, const uint8_t*, int64_t, float*, int64_t);
template <Format F, int P, Weights W, int... I>
constexpr std::array<WordFn, sizeof...(I)> word_table(std::integer_sequence<int, I...>) {
  return {&rows_by_words<F, I + 1, P, W>...};
}
constexpr int most_word_rows(Format f) { return grouped(f) ? kGroupRows : kWordRows; }
template <Format F, int P, Weights W>
const std::array<WordFn, most_word_rows(F)>& words_for() {
  static const auto table = word_table<F, P, W>(std::make_integer_sequence<int, most_word_rows(F)>{});
  return table;
}
template <Format F, int P>
WordFn word_tile(int64_t rows, int64_t tile, int64_t tiles) {
  if (tile > 0) return words_for<F, P, Weights::kKept>()[rows - 1];
  return (tiles > 1 ? words_for<F, P, Weights::kWidenAndKeep>() : words_for<F, P, Weights::kWiden>())[rows - 1];
}

// The two quads (2v, 2v + 1) of a panel's block as the unsigned bytes VPDPBUSD takes, from its q (`qs`).
template <Format F>
inline void block_quads(const uint8_t* qs, int v, __m512i& low, __m512i& high) {
  const __m512i packed = _mm512_loadu_si512(qs + 64 * v);
  low = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
  high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
  if constexpr (five_bit(F) || six_bit(F)) {  // each quad's words of fifth (and sixth) bits add 16 (and 32)
    constexpr int H = six_bit(F) ? 2 : 1;
    uint64_t bits[2 * H];
    std::memcpy(bits, qs + kBlock * kPanel / 2 + 16 * H * v, 16 * H);
    for (int h = 0; h < H; ++h) {
      const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << h));
      low = _mm512_mask_add_epi8(low, bits[h], low, add);
      high = _mm512_mask_add_epi8(high, bits[H + h], high, add);
    }
  }
}

// R rows times P panels from 8-bit activations (F: the word format whose headers the quads share). The weights
// need no widening, so every tile reads them from the blocks (a pair's blocks stay in L1/L2 across its tiles).
template <Format F, int R, int P>
void rows_by_quads(const ByteRows& xq, int64_t row0, int64_t k, const uint8_t* headers, int64_t panel_bytes,
                   float* out, int64_t n) {
  // 8-bit q are signed: the activations become the unsigned operand (qx + 128, by flipping each byte's top bit)
  // and 128 times the q's sum, taken by VPDPBUSD from ones once per block for every row, comes off.
  constexpr bool kSigned = !four_bit(F) && !five_bit(F) && !six_bit(F);
  constexpr int A = R * P <= 2 ? 2 : 1;  // split short chains of dependent VPDPBUSD in two
  const int64_t blocks = k / kBlock;
  const int32_t* x_quads = reinterpret_cast<const int32_t*>(xq.q.data() + row0 * k);
  const float* x_scale = xq.scale.data() + row0 * blocks;
  const float* x_sum = xq.sum.data() + row0 * blocks;
  const int32_t* x_halves = xq.halves.data() + 2 * row0 * blocks;
  const int32_t flip = kSigned ? static_cast<int32_t>(0x80808080u) : 0;
  __m512 sums[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) sums[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[A][R][P], qsum[P];
    auto clear = [&]() {
      for (int a = 0; a < A; ++a)
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) acc[a][r][p] = _mm512_setzero_si512();
      for (int p = 0; p < P; ++p) qsum[p] = _mm512_setzero_si512();
    };
    int half = 0;  // the half block whose sums add_scaled takes, in the formats with a scale per 16 inputs
    // Panel p's integer sums (of the block, or of Q6_K's half block) times d and each row's scale into the sums.
    auto add_scaled = [&](int p, __m512 d) {
      for (int r = 0; r < R; ++r) {
        __m512i total = acc[0][r][p];
        if constexpr (A == 2) total = _mm512_add_epi32(total, acc[1][r][p]);
        if constexpr (kSigned) total = _mm512_sub_epi32(total, _mm512_slli_epi32(qsum[p], 7));
        if constexpr (six_bit(F))
          total = _mm512_sub_epi32(total, _mm512_set1_epi32(32 * x_halves[2 * (b * R + r) + half]));
        sums[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(x_scale[b * R + r])),
                                     sums[r][p]);
      }
    };
    clear();
    // Inputs 0..15 done, in the formats with a scale per 16 inputs: their sums take the first scales, and the sums
    // start again.
    auto end_first_half = [&]() {
      for (int p = 0; p < P; ++p) {
        const uint8_t* panel = headers + p * panel_bytes;
        add_scaled(p, half_scales<F>(panel + b * word_block_bytes(F), block_super<F>(panel, b, blocks), 0));
      }
      clear();
      half = 1;
    };
    const int32_t* xb = x_quads + b * 8 * R;
    const uint8_t* qs[P];
    for (int p = 0; p < P; ++p) {
      qs[p] = headers + p * panel_bytes + b * word_block_bytes(F) + word_header_bytes(F);
      // the next panel pair's block, as the words do
      prefetch_block<(R + 1) / 2>(headers + (P + p) * panel_bytes + b * word_block_bytes(F), word_block_bytes(F));
    }
    if constexpr (kSigned) {
      const __m512i ones = _mm512_set1_epi8(1);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i w[P];
        for (int p = 0; p < P; ++p) {
          w[p] = _mm512_loadu_si512(qs[p] + 64 * j);
          qsum[p] = _mm512_dpbusd_epi32(qsum[p], ones, w[p]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(xb[j * R + r] ^ flip);
          for (int p = 0; p < P; ++p) acc[j % A][r][p] = _mm512_dpbusd_epi32(acc[j % A][r][p], x, w[p]);
        }
        if constexpr (per_sixteen(F))
          if (j == 3) end_first_half();
      }
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512i low[P], high[P];
        for (int p = 0; p < P; ++p) block_quads<F>(qs[p], v, low[p], high[p]);
        for (int r = 0; r < R; ++r) {
          const __m512i x_low = _mm512_set1_epi32(xb[(2 * v) * R + r]);
          const __m512i x_high = _mm512_set1_epi32(xb[(2 * v + 1) * R + r]);
          for (int p = 0; p < P; ++p) {
            acc[0][r][p] = _mm512_dpbusd_epi32(acc[0][r][p], low[p], x_low);
            acc[A - 1][r][p] = _mm512_dpbusd_epi32(acc[A - 1][r][p], high[p], x_high);
          }
        }
        if constexpr (per_sixteen(F))
          if (v == 1) end_first_half();
      }
    }
    end_block<F, R, P>(headers, panel_bytes, b, blocks, x_sum, add_scaled, sums);
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + r * n + p * kPanel, sums[r][p]);
}

using QuadFn = void (*)(const ByteRows&, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t);
template <Format F, int P, int... I>
constexpr std::array<QuadFn, sizeof...(I)> quad_table(std::integer_sequence<int, I...>) {
  return {&rows_by_quads<F, I + 1, P>...};
}
template <Format F, int P>
QuadFn quad_tile(int64_t rows) {
  static const auto table = quad_table<F, P>(std::make_integer_sequence<int, kQuadRows>{});
  return table[rows - 1];
}

// 16 float32 values rounded to bfloat16 as c10::BFloat16 rounds one (to nearest, ties to even; NaN to 0x7FC0),
// without AVX512_BF16, which the build does not assume.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

// A panel's 16 float32 sums at `out` finished: plus the bias (where given), then stored in place, or rounded to
// bfloat16 at out16 (where given).
inline void finish_panel(float* out, const float* bias, c10::BFloat16* out16) {
  __m512 v = _mm512_loadu_ps(out);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  if (out16 != nullptr)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16), round_to_bf16(v));
  else
    _mm512_storeu_ps(out, v);
}

// A panel's block's group g as the 32 16-bit values the product multiplies (the packer's check).
template <Format F>
inline void widen_group(const uint8_t* qs, int g, int16_t* out) {
  _mm512_storeu_si512(out, block_group<F>(qs, g));
}

// Every row tile times the panel pair starting at panel `first` of a part (`width` panels: 2, or 1 at a part's
// odd end), into out (the part's first column of row 0, rows `stride` apart).
template <Format F>
void pair_by_tiles(const Activations& xq, int64_t k, int16_t* w, const uint8_t* blocks, int64_t first, int64_t width,
                   float* out, int64_t stride) {
  const int64_t panel_bytes = word_panel_bytes(F, k);
  const RowTiles& tiles = xq.words.tiles;
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first_row(t), r = tiles.size(t);
    (width == 2 ? word_tile<F, 2> : word_tile<F, 1>)(r, t, tiles.count)(
        xq.words, r0, k, w, blocks + first * panel_bytes, panel_bytes, out + r0 * stride + first * kPanel, stride);
  }
}

template <Format F>
void pair_by_quads(const Activations& xq, int64_t k, int16_t*, const uint8_t* blocks, int64_t first, int64_t width,
                   float* out, int64_t stride) {
  const int64_t panel_bytes = word_panel_bytes(F, k);
  const RowTiles& tiles = xq.bytes.tiles;
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first_row(t), r = tiles.size(t);
    (width == 2 ? quad_tile<F, 2> : quad_tile<F, 1>)(r)(xq.bytes, r0, k, blocks + first * panel_bytes, panel_bytes,
                                                        out + r0 * stride + first * kPanel, stride);
  }
}

}  // namespace
#endif

#if defined(LLM_WORDS_AVX2)
namespace {
// The AVX2 (x86-64-v3) product from 16-bit integer activations: the AVX-512 one's arithmetic with each panel's 16
// outputs in two 8-lane halves, VPMADDWD and an add where VPDPWSSD does both (the same exact integer sums: no
// pair of products reaches 2^31), then the same float32 steps per output in the same order, so each output is
// the AVX-512 build's bit for bit.

// 16 lanes holding `add` where bit t of `bits` is set (lane t), else 0.
inline __m256i lanes_of_bits(uint32_t bits, int16_t add) {
  const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           static_cast<int16_t>(0x8000));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), select),
                                         select);
  return _mm256_and_si256(set, _mm256_set1_epi16(add));
}

// A code table's 16-bit values as two byte tables (low and high bytes, each in both 128-bit lanes), for VPSHUFB:
// AVX2 has no 16-bit permute.
struct ByteTables {
  int8_t low[32], high[32];
};
constexpr ByteTables byte_tables(const CodeTable& t) {
  ByteTables out{};
  for (int i = 0; i < 32; ++i) {
    out.low[i] = static_cast<int8_t>(t.values[i % 16] & 0xFF);
    out.high[i] = static_cast<int8_t>(t.values[i % 16] >> 8);
  }
  return out;
}
constexpr ByteTables kNf4Bytes = byte_tables(kNf4Codes), kFp4Bytes = byte_tables(kFp4Codes);

// Half h of group g (inputs 2g and 2g + 1) of a panel's block: the 16-bit pairs of outputs 8h..8h + 7, which the
// AVX-512 build's block_group holds in lanes 16h..16h + 15.
template <Format F>
inline __m256i block_group_half(const uint8_t* qs, int g, int h) {
  if constexpr (five_bit(F)) {
    uint32_t high;
    std::memcpy(&high, qs + kBlock * kPanel / 2 + 4 * g, 4);
    return _mm256_add_epi16(block_group_half<kQ4Scaled>(qs, g, h), lanes_of_bits(high >> (16 * h), 16));
  } else if constexpr (six_bit(F)) {
    uint32_t fifth, sixth;
    std::memcpy(&fifth, qs + kBlock * kPanel / 2 + 8 * g, 4);
    std::memcpy(&sixth, qs + kBlock * kPanel / 2 + 8 * g + 4, 4);
    const __m256i v = _mm256_add_epi16(block_group_half<kQ4Scaled>(qs, g, h), lanes_of_bits(fifth >> (16 * h), 16));
    return _mm256_sub_epi16(_mm256_add_epi16(v, lanes_of_bits(sixth >> (16 * h), 32)), _mm256_set1_epi16(32));
  } else if constexpr (coded(F)) {  // each lane's nibble (its low byte; the high byte 0) picks both bytes
    const ByteTables& t = &code_table(F) == &kNf4Codes ? kNf4Bytes : kFp4Bytes;
    const __m256i index = block_group_half<kQ4Scaled>(qs, g, h);
    const __m256i low = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.low)), index);
    const __m256i high = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.high)), index);
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi16(0x00FF)), _mm256_slli_epi16(high, 8));
  } else if constexpr (four_bit(F)) {
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * (g / 4) + 32 * h));
    const __m256i shifted = g % 4 == 0 ? lanes : _mm256_srli_epi16(lanes, 4 * (g % 4));
    return g % 4 == 3 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi16(0x0F));
  } else {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * g + 16 * h)));
  }
}

// 8 half-precision values, or 8 unsigned or signed bytes, or 8 float32, at `p` as float32.
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 signed_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 floats8(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }

// Outputs 8h..8h + 7's scales of inputs 0..15 (half 0) or 16..31 (half 1), in the formats with a scale per 16.
template <Format F>
inline __m256 half_scales(const uint8_t* header, const uint8_t* super, int half, int h) {
  if constexpr (six_bit(F)) return _mm256_mul_ps(halves8(super + 16 * h), signed_bytes8(header + half * kPanel + 8 * h));
  else return floats8(header + (half * kPanel + 8 * h) * 4);
}

// Outputs 8h..8h + 7's scales d and minimums m of a block, as the AVX-512 build's block_scales forms them.
template <Format F>
inline void block_scales(const uint8_t* header, const uint8_t* super, int h, __m256& d, __m256& m) {
  m = _mm256_setzero_ps();
  if constexpr (per_sixteen(F)) {
    d = half_scales<F>(header, super, 1, h);
  } else if constexpr (super_scaled(F)) {
    d = _mm256_mul_ps(halves8(super + 16 * h), bytes8(header + 8 * h));
    m = _mm256_sub_ps(m, _mm256_mul_ps(halves8(super + 2 * kPanel + 16 * h), bytes8(header + kPanel + 8 * h)));
  } else if constexpr (coded(F) || eight_groups(F)) {
    d = floats8((coded(F) && !coded_groups(F) ? header : super) + 32 * h);
  } else if constexpr (float_header(F)) {
    d = floats8(header + 32 * h);
    m = floats8(header + kPanel * 4 + 32 * h);
  } else if constexpr (zero_point(F)) {
    d = halves8(header + 16 * h);
    m = _mm256_sub_ps(m, _mm256_mul_ps(d, bytes8(header + 2 * kPanel + 8 * h)));
  } else if constexpr (grouped_zero(F)) {
    d = halves8(super + 16 * h);
    m = _mm256_sub_ps(m, _mm256_mul_ps(d, bytes8(super + 2 * kPanel + 8 * h)));
  } else if constexpr (grouped(F)) {
    d = halves8(super + 16 * h);
    m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
  } else if constexpr (centered(F)) {
    d = halves8(header + 16 * h);
    m = _mm256_mul_ps(d, _mm256_set1_ps(F == kQ4Centered ? -8.f : -16.f));
  } else {
    d = halves8(header + 16 * h);
    if constexpr (has_minimum(F)) m = halves8(header + 2 * kPanel + 16 * h);
  }
}

// acc plus each lane's two 16-bit products x * w: AVX-VNNI's one instruction (VPDPWSSD) where the build has it,
// else VPMADDWD and an add. The same 32-bit sums either way (both wrap, neither saturates).
inline __m256i pair_sums(__m256i acc, __m256i x, __m256i w) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, x, w);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}

// R rows (a tile of xq starting at row0) times one panel, one half of its outputs after the other: the first half
// reads the panel's blocks from memory, the second from L1.
template <Format F, int R>
void rows_by_words(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* panel, float* out, int64_t n) {
  constexpr int A = R <= 2 || (grouped(F) && R <= 3) ? 2 : 1;  // short chains of dependent adds split in two
  const int64_t blocks = k / kBlock, span = grouped(F) ? xq.span : 1, last = span - 1;
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(xq.q.data() + row0 * k);
  const float* x_scale = xq.scale.data() + row0 * blocks;
  const float* x_sum = xq.sum.data() + row0 * blocks;
  for (int h = 0; h < 2; ++h) {
    __m256 sums[R];
    __m256i acc[A][R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      if ((b & last) == 0)
        for (int a = 0; a < A; ++a)
          for (int r = 0; r < R; ++r) acc[a][r] = _mm256_setzero_si256();
      const uint8_t* header = panel + b * word_block_bytes(F);
      const uint8_t* qs = header + word_header_bytes(F);
      const uint8_t* super = block_super<F>(panel, b, blocks);
      auto total = [&](int r) { return A == 2 ? _mm256_add_epi32(acc[0][r], acc[A - 1][r]) : acc[0][r]; };
      auto add_scaled = [&](__m256 d) {
        for (int r = 0; r < R; ++r)
          sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total(r)), _mm256_mul_ps(d, _mm256_set1_ps(x_scale[b * R + r])),
                                    sums[r]);
      };
      const int32_t* xb = x_pairs + b * 16 * R;
#pragma GCC unroll 16
      for (int g = 0; g < 16; ++g) {
        const __m256i w = block_group_half<F>(qs, g, h);
        for (int r = 0; r < R; ++r)
          acc[g % A][r] = pair_sums(acc[g % A][r], _mm256_set1_epi32(xb[g * R + r]), w);
        if constexpr (per_sixteen(F)) {
          if (g == 7) {  // inputs 0..15 done: their sums take the first scales, and the sums start again
            add_scaled(half_scales<F>(header, super, 0, h));
            for (int a = 0; a < A; ++a)
              for (int r = 0; r < R; ++r) acc[a][r] = _mm256_setzero_si256();
          }
        }
      }
      __m256 d, m;
      if constexpr (grouped(F)) {
        if ((b & last) == last) {  // a span lies within one group: its d and m serve every block of it
          block_scales<F>(header, super, h, d, m);
          for (int r = 0; r < R; ++r) {
            const __m256 term = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total(r)),
                                                _mm256_mul_ps(d, _mm256_set1_ps(x_scale[b * R + r])),
                                                _mm256_mul_ps(m, _mm256_set1_ps(x_sum[b * R + r])));
            sums[r] = b + 1 == span ? term : _mm256_add_ps(sums[r], term);
          }
        }
      } else {
        block_scales<F>(header, super, h, d, m);
        add_scaled(d);
        if constexpr (has_minimum(F))
          for (int r = 0; r < R; ++r) sums[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x_sum[b * R + r]), sums[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * n + 8 * h, sums[r]);
  }
}

using WordFn = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, float*, int64_t);
template <Format F, int... I>
constexpr std::array<WordFn, sizeof...(I)> word_table(std::integer_sequence<int, I...>) {
  return {&rows_by_words<F, I + 1>...};
}
template <Format F>
WordFn word_tile(int64_t rows) {
  static const auto table = word_table<F>(std::make_integer_sequence<int, kWordRows>{});
  return table[rows - 1];
}

// Every row tile times the `width` panels from panel `first` of a part, into out (the part's first column of row
// 0, rows `stride` apart).
template <Format F>
void pair_by_tiles(const Activations& xq, int64_t k, int16_t*, const uint8_t* blocks, int64_t first, int64_t width,
                   float* out, int64_t stride) {
  const int64_t panel_bytes = word_panel_bytes(F, k);
  const RowTiles& tiles = xq.words.tiles;
  for (int64_t p = first; p < first + width; ++p)
    for (int64_t t = 0; t < tiles.count; ++t) {
      const int64_t r0 = tiles.first_row(t);
      word_tile<F>(tiles.size(t))(xq.words, r0, k, blocks + p * panel_bytes, out + r0 * stride + p * kPanel, stride);
    }
}

// 32 bytes holding `add` where bit t of `bits` is set (byte t), else 0.
inline __m256i bytes_of_bits(uint32_t bits, int8_t add) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte t takes byte t / 8 of bits (set1 puts all four in each lane)
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(add));
}

// Half h (outputs 8h..8h + 7) of the two quads (2v, 2v + 1) of a panel's block as unsigned bytes, from its q
// (`qs`): the AVX-512 build's block_quads, lanes 8h..8h + 7.
template <Format F>
inline void block_quads_half(const uint8_t* qs, int v, int h, __m256i& low, __m256i& high) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * v + 32 * h));
  low = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));
  high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
  if constexpr (five_bit(F) || six_bit(F)) {  // each quad's words of fifth (and sixth) bits add 16 (and 32)
    constexpr int H = six_bit(F) ? 2 : 1;
    uint64_t bits[2 * H];
    std::memcpy(bits, qs + kBlock * kPanel / 2 + 16 * H * v, 16 * H);
    for (int i = 0; i < H; ++i) {
      const int8_t add = static_cast<int8_t>(16 << i);
      low = _mm256_add_epi8(low, bytes_of_bits(static_cast<uint32_t>(bits[i] >> (32 * h)), add));
      high = _mm256_add_epi8(high, bytes_of_bits(static_cast<uint32_t>(bits[H + i] >> (32 * h)), add));
    }
  }
}

// R rows times one panel from 8-bit activations, one half of its outputs after the other (F: the word format whose
// headers the quads share). The integer sums are the AVX-512 build's, so each output is too, bit for bit.
// - AVX-VNNI: VPDPBUSD on 8 lanes, as the AVX-512 build multiplies 16 (8-bit q: activations made unsigned by
//   flipping their top bit, 128 times the q's sum off).
// - AVX2: VPMADDUBSW (unsigned times signed bytes, pairs summed to 16 bits, saturating) and VPMADDWD by ones. The
//   q of 4-, 5- and 6-bit formats are the unsigned operand: a pair is at most 2 * 63 * 128 in magnitude, and the
//   16-bit sums of 8, 4 or 2 quads (the q below 16, 32, 64) stay below 2^15, so they add up before one VPMADDWD
//   widens them. 8-bit q (-128..127) are made the unsigned operand by magnitude, the activations taking their signs
//   (VPSIGNB): a pair is at most 2 * 128 * 127 < 2^15.
template <Format F, int R>
void rows_by_quads(const ByteRows& xq, int64_t row0, int64_t k, const uint8_t* panel, float* out, int64_t n) {
  constexpr bool kSigned = !four_bit(F) && !five_bit(F) && !six_bit(F);
#if !defined(__AVXVNNI__)
  constexpr int kRun = six_bit(F) ? 1 : five_bit(F) ? 2 : 4;  // quad pairs whose 16-bit sums add before widening
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const int64_t blocks = k / kBlock;
  const int32_t* x_quads = reinterpret_cast<const int32_t*>(xq.q.data() + row0 * k);
  const float* x_scale = xq.scale.data() + row0 * blocks;
  const float* x_sum = xq.sum.data() + row0 * blocks;
  const int32_t* x_halves = xq.halves.data() + 2 * row0 * blocks;
  for (int h = 0; h < 2; ++h) {
    __m256 sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* header = panel + b * word_block_bytes(F);
      const uint8_t* qs = header + word_header_bytes(F);
      const uint8_t* super = block_super<F>(panel, b, blocks);
      __m256i acc[R];
      [[maybe_unused]] __m256i qsum = _mm256_setzero_si256();
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      int half = 0;  // the half block whose sums add_scaled takes, in the formats with a scale per 16 inputs
      auto add_scaled = [&](__m256 d) {
        for (int r = 0; r < R; ++r) {
          __m256i total = acc[r];
#if defined(__AVXVNNI__)
          if constexpr (kSigned) total = _mm256_sub_epi32(total, _mm256_slli_epi32(qsum, 7));
#endif
          if constexpr (six_bit(F))
            total = _mm256_sub_epi32(total, _mm256_set1_epi32(32 * x_halves[2 * (b * R + r) + half]));
          sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x_scale[b * R + r])),
                                    sums[r]);
        }
      };
      auto end_first_half = [&]() {  // inputs 0..15 done: their sums take the first scales, and start again
        add_scaled(half_scales<F>(header, super, 0, h));
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
        qsum = _mm256_setzero_si256();
        half = 1;
      };
      const int32_t* xb = x_quads + b * 8 * R;
      if constexpr (kSigned) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32 * h));
#if defined(__AVXVNNI__)
          qsum = _mm256_dpbusd_avx_epi32(qsum, _mm256_set1_epi8(1), w);
          for (int r = 0; r < R; ++r)
            acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_set1_epi32(xb[j * R + r] ^ static_cast<int32_t>(0x80808080u)), w);
#else
          const __m256i magnitude = _mm256_abs_epi8(w);
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(xb[j * R + r]), w);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
          }
#endif
          if constexpr (per_sixteen(F))
            if (j == 3) end_first_half();
        }
      } else {
        [[maybe_unused]] __m256i run[R];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          __m256i low, high;
          block_quads_half<F>(qs, v, h, low, high);
          for (int r = 0; r < R; ++r) {
            const __m256i x_low = _mm256_set1_epi32(xb[(2 * v) * R + r]);
            const __m256i x_high = _mm256_set1_epi32(xb[(2 * v + 1) * R + r]);
#if defined(__AVXVNNI__)
            acc[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[r], low, x_low), high, x_high);
#else
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
            run[r] = v % kRun == 0 ? pairs : _mm256_add_epi16(run[r], pairs);
            if (v % kRun == kRun - 1) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(run[r], ones));
#endif
          }
          if constexpr (per_sixteen(F))
            if (v == 1) end_first_half();
        }
      }
      __m256 d, m;
      block_scales<F>(header, super, h, d, m);
      add_scaled(d);
      if constexpr (has_minimum(F))
        for (int r = 0; r < R; ++r) sums[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x_sum[b * R + r]), sums[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * n + 8 * h, sums[r]);
  }
}

using QuadFn = void (*)(const ByteRows&, int64_t, int64_t, const uint8_t*, float*, int64_t);
template <Format F, int... I>
constexpr std::array<QuadFn, sizeof...(I)> quad_table(std::integer_sequence<int, I...>) {
  return {&rows_by_quads<F, I + 1>...};
}
template <Format F>
QuadFn quad_tile(int64_t rows) {
  static const auto table = quad_table<F>(std::make_integer_sequence<int, kQuadRows>{});
  return table[rows - 1];
}

template <Format F>
void pair_by_quads(const Activations& xq, int64_t k, int16_t*, const uint8_t* blocks, int64_t first, int64_t width,
                   float* out, int64_t stride) {
  const int64_t panel_bytes = word_panel_bytes(F, k);
  const RowTiles& tiles = xq.bytes.tiles;
  for (int64_t p = first; p < first + width; ++p)
    for (int64_t t = 0; t < tiles.count; ++t) {
      const int64_t r0 = tiles.first_row(t);
      quad_tile<F>(tiles.size(t))(xq.bytes, r0, k, blocks + p * panel_bytes, out + r0 * stride + p * kPanel, stride);
    }
}

// A panel's 16 float32 sums at `out` finished: plus the bias (where given), then stored in place, or rounded to
// bfloat16 at out16 (where given) as c10::BFloat16 rounds (to nearest, ties to even; NaN to 0x7FC0).
inline void finish_panel(float* out, const float* bias, c10::BFloat16* out16) {
  __m256i rounded[2];
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_loadu_ps(out + 8 * h);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
    if (out16 == nullptr) {
      _mm256_storeu_ps(out + 8 * h, v);
      continue;
    }
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    rounded[h] = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  if (out16 != nullptr)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded[0], rounded[1]), 0xD8));
}

// A panel's block's group g as the 32 16-bit values the product multiplies (the packer's check).
template <Format F>
inline void widen_group(const uint8_t* qs, int g, int16_t* out) {
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), block_group_half<F>(qs, g, h));
}
}  // namespace
#endif

#if defined(LLM_WORD_PRODUCT)
namespace {

using PairFn = void (*)(const Activations&, int64_t, int16_t*, const uint8_t*, int64_t, int64_t, float*, int64_t);
PairFn pair_fn(Format f) {
  switch (f) {
    case kQ4_1Quads: return &pair_by_quads<kQ4_1>;
    case kQ4ScaledQuads: return &pair_by_quads<kQ4Scaled>;
    case kQ5WordsQuads: return &pair_by_quads<kQ5Words>;
    case kQ5ScaledQuads: return &pair_by_quads<kQ5Scaled>;
    case kQ8_0Quads: return &pair_by_quads<kQ8_0>;
    case kQ8ScaledQuads: return &pair_by_quads<kQ8Scaled>;
    case kQ8HalvesQuads: return &pair_by_quads<kQ8Halves>;
    case kQ4_1Words: return &pair_by_tiles<kQ4_1>;
    case kQ8_0Words: return &pair_by_tiles<kQ8_0>;
    case kQ4Scaled: return &pair_by_tiles<kQ4Scaled>;
    case kQ8Scaled: return &pair_by_tiles<kQ8Scaled>;
    case kQ8Halves: return &pair_by_tiles<kQ8Halves>;
    case kQ5Words: return &pair_by_tiles<kQ5Words>;
    case kNf4Words: return &pair_by_tiles<kNf4Words>;
    case kQ4Centered: return &pair_by_tiles<kQ4Centered>;
    case kQ5Centered: return &pair_by_tiles<kQ5Centered>;
    case kQ4CenteredQuads: return &pair_by_quads<kQ4Centered>;
    case kQ5CenteredQuads: return &pair_by_quads<kQ5Centered>;
    case kQ4Super: return &pair_by_tiles<kQ4Super>;
    case kQ5Super: return &pair_by_tiles<kQ5Super>;
    case kQ4SuperQuads: return &pair_by_quads<kQ4Super>;
    case kQ5SuperQuads: return &pair_by_quads<kQ5Super>;
    case kQ6Super: return &pair_by_tiles<kQ6Super>;
    case kQ4Zero: return &pair_by_tiles<kQ4Zero>;
    case kQ4ZeroQuads: return &pair_by_quads<kQ4Zero>;
    case kQ6SuperQuads: return &pair_by_quads<kQ6Super>;
    case kQ4CenteredBy64: return &pair_by_tiles<kQ4CenteredBy64>;
    case kQ4CenteredBy128: return &pair_by_tiles<kQ4CenteredBy128>;
    case kQ4ZeroBy64: return &pair_by_tiles<kQ4ZeroBy64>;
    case kQ4ZeroBy128: return &pair_by_tiles<kQ4ZeroBy128>;
    case kQ4CenteredBy64Quads: return &pair_by_quads<kQ4CenteredBy64>;
    case kQ4CenteredBy128Quads: return &pair_by_quads<kQ4CenteredBy128>;
    case kQ4ZeroBy64Quads: return &pair_by_quads<kQ4ZeroBy64>;
    case kQ4ZeroBy128Quads: return &pair_by_quads<kQ4ZeroBy128>;
    case kFp4Words: return &pair_by_tiles<kFp4Words>;
    case kNf4By64: return &pair_by_tiles<kNf4By64>;
    case kNf4By128: return &pair_by_tiles<kNf4By128>;
    case kFp4By64: return &pair_by_tiles<kFp4By64>;
    case kFp4By128: return &pair_by_tiles<kFp4By128>;
    case kQ8By128: return &pair_by_tiles<kQ8By128>;
    case kQ8By128Quads: return &pair_by_quads<kQ8By128>;
    default: return &pair_by_tiles<kQ5Scaled>;
  }
}

// x [rows, k] (float32 or bfloat16) times every part, the parts' outputs side by side in [rows, n]: the rows are
// quantized once for all of them and every part's panel pairs share one parallel loop. Each pair's columns are
// finished as soon as its tiles are done (bias added, rounded to bfloat16 where `out16` is given) while they are
// in cache; `out` holds the float32 sums (the result itself where out16 is null).
template <typename T>
void word_products(const T* x, int64_t rows, int64_t k, const std::vector<Part>& parts, int64_t n, float* out,
                   c10::BFloat16* out16, const float* bias) {
  bool words = false, quads = false, halves = false;
  for (const Part& part : parts) {
    (quad_format(part.format) ? quads : words) = true;
    halves = halves || part.format == kQ6SuperQuads;
  }
  Activations xq;
  // A scale per span of blocks where every 16-bit part has a scale per group: the smallest group's span.
  int64_t span = kSuperBlocks;
  for (const Part& part : parts)
    if (!quad_format(part.format)) span = grouped(part.format) ? std::min(span, super_blocks(part.format)) : 1;
  TORCH_CHECK((span & (span - 1)) == 0, "blocks_linear: a span of blocks must be a power of two");
  if (words) xq.words = quantize_rows<int16_t>(x, rows, k, false, span);
  if (quads) xq.bytes = quantize_rows<int8_t>(x, rows, k, halves);
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (part, first panel)
  for (int64_t i = 0; i < static_cast<int64_t>(parts.size()); ++i)
    for (int64_t first = 0; first < parts[i].n / kPanel; first += 2) pairs.emplace_back(i, first);
  // Pairs of panels, each widened once (by its first tile of rows) into a buffer the later tiles read from cache.
  at::parallel_for(0, static_cast<int64_t>(pairs.size()), 1, [&](int64_t begin, int64_t end) {
    // The thread's buffer, kept from call to call: a new one every call was zero-filled by each thread, 60-160 KB
    // a layer, though a call of one tile of rows never touches it.
    thread_local std::vector<int16_t> storage;
    const size_t needed = xq.words.tiles.count > 1 ? k * 2 * kPanel + 32 : 0;
    if (storage.size() < needed) storage.resize(needed);
    int16_t* w = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    for (int64_t i = begin; i < end; ++i) {
      const Part& part = parts[pairs[i].first];
      const int64_t first = pairs[i].second, width = std::min<int64_t>(2, part.n / kPanel - first);
      pair_fn(part.format)(xq, k, w, part.blocks, first, width, out + part.col, n);
      if (bias == nullptr && out16 == nullptr) continue;
      const int64_t col = part.col + first * kPanel;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = col; c < col + width * kPanel; c += kPanel)
          finish_panel(out + r * n + c, bias != nullptr ? bias + c : nullptr,
                       out16 != nullptr ? out16 + r * n + c : nullptr);
    }
  });
}
}  // namespace
#endif

namespace {

template <Format F>
at::Tensor pack_as(const float* w, int64_t n, int64_t k, bool words) {
  const int64_t panels = n / kPanel, panel_bytes = (k / kBlock) * layout_block_bytes(F, words);
  auto packed = at::empty({panels, panel_bytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
#if defined(LLM_FLOAT_BLOCKS)
    std::vector<float> expanded(k * kPanel);
#endif
    for (int64_t p = begin; p < end && exact.load(std::memory_order_relaxed); ++p) {
      if (!pack_panel<F>(w + p * kPanel * k, k, out + p * panel_bytes, words)) {
        exact = false;
        return;
      }
      // The product reads the blocks with its own code: check that they give back every weight bit for bit (a
      // compiler that fused q * d + m into one rounding, or a misplaced q, would not).
#if defined(LLM_WORD_PRODUCT)
      if (words) {
        alignas(64) int16_t widened[16 * 32];
        for (int64_t b = 0; b < k / kBlock; ++b) {
          const uint8_t* block = out + p * panel_bytes + b * word_block_bytes(F);
          const uint16_t* header = reinterpret_cast<const uint16_t*>(block);
          for (int g = 0; g < 16; ++g) widen_group<F>(block + word_header_bytes(F), g, widened + g * 32);
          for (int g = 0; g < 16; ++g)
            for (int t = 0; t < 32; ++t) {
              const int64_t i = t / 2, j = b * kBlock + 2 * g + t % 2;
              volatile float v = static_cast<float>(widened[g * 32 + t]) * half_value(header[i]);
              if (F == kQ4_1) v = v + half_value(header[kPanel + i]);
              if (v != w[(p * kPanel + i) * k + j]) exact = false;
            }
        }
        continue;
      }
#endif
#if defined(LLM_FLOAT_BLOCKS)
      expand_panel<F>(out + p * panel_bytes, k, expanded.data(), kPanel);
      for (int64_t i = 0; i < kPanel; ++i)
        for (int64_t j = 0; j < k; ++j)
          if (expanded[j * kPanel + i] != w[(p * kPanel + i) * k + j]) exact = false;
#endif
    }
  });
  return exact ? packed : at::Tensor();
}

// The bytes of one panel's block of 32 inputs in `format`.
int64_t packed_block_bytes(int64_t format) {
  switch (word_base(format)) {
    case kQ4_1: return block_bytes(kQ4_1);
    case kQ8_0: return block_bytes(kQ8_0);
    case kQ4_1Words: return word_block_bytes(kQ4_1);
    case kQ8_0Words: return word_block_bytes(kQ8_0);
    case kQ4Scaled: return word_block_bytes(kQ4Scaled);
    case kQ8Halves: return word_block_bytes(kQ8Halves);
    case kQ5Words: return word_block_bytes(kQ5Words);
    case kQ5Scaled: return word_block_bytes(kQ5Scaled);
    case kNf4Words: return word_block_bytes(kNf4Words);
    case kQ4Centered: return word_block_bytes(kQ4Centered);
    case kQ5Centered: return word_block_bytes(kQ5Centered);
    case kQ4Super: return word_block_bytes(kQ4Super);
    case kQ5Super: return word_block_bytes(kQ5Super);
    case kQ6Super: return word_block_bytes(kQ6Super);
    case kQ4Zero: return word_block_bytes(kQ4Zero);
    case kFp4Words: return word_block_bytes(kFp4Words);
    case kQ4CenteredBy64: case kQ4CenteredBy128: case kQ4ZeroBy64: case kQ4ZeroBy128:
    case kNf4By64: case kNf4By128: case kFp4By64: case kFp4By128:
      return word_block_bytes(kQ4CenteredBy64);
    case kQ8By128: return word_block_bytes(kQ8By128);
    default: return word_block_bytes(kQ8Scaled);
  }
}

}  // namespace

// weight float32 [out, in] (any strides) -> (format, blocks): 1 and the Q4_1 blocks, 2 and the Q8_0 blocks, in
// the product's layout ([out / 16, bytes per panel]), or with `words` 3 and 4 and the same blocks arranged for
// 16-bit integer activations (with `quads` too, formats 10 and 14, for 8-bit activations); 0 and an empty
// tensor where the weight is exactly neither, its shape does not divide into panels and blocks, or this build has
// no such product.
std::tuple<int64_t, at::Tensor> pack_blocks(const at::Tensor& weight, bool words, bool quads) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_blocks: weight must be a float32 CPU matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (!(words ? word_blocks_supported() : blocks_supported()) || n % kPanel || k % kBlock || n == 0 || k == 0)
    return {kNone, at::empty({0}, at::kByte)};
  // The first block decides for weights of any other origin, before a copy of the whole matrix.
  const at::Tensor first = weight[0].narrow(0, 0, kBlock).contiguous();
  float scale, minimum;
  int8_t q[kBlock];
  if (!recover_block<kQ4_1>(first.data_ptr<float>(), scale, minimum, q) &&
      !recover_block<kQ8_0>(first.data_ptr<float>(), scale, minimum, q))
    return {kNone, at::empty({0}, at::kByte)};
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = pack_as<kQ4_1>(w.data_ptr<float>(), n, k, words);
  if (packed.defined() && words && quads) {
    // The checked words rearranged by quads, block by block in place: the same header and bytes (format 10).
    const int64_t blocks = k / kBlock, bytes = word_block_bytes(kQ4_1);
    uint8_t* data = packed.data_ptr<uint8_t>();
    at::parallel_for(0, (n / kPanel) * blocks, 1, [&](int64_t begin, int64_t end) {
      int8_t q[kPanel][kBlock];
      for (int64_t i = begin; i < end; ++i) {
        uint8_t* qs = data + i * bytes + word_header_bytes(kQ4_1);
        for (int h = 0; h < 4; ++h)
          for (int t = 0; t < 32; ++t) {  // the inverse of arrange_words<true>
            uint16_t lane;
            std::memcpy(&lane, qs + 64 * h + 2 * t, 2);
            for (int j = 0; j < 4; ++j) q[t / 2][2 * (4 * h + j) + t % 2] = static_cast<int8_t>((lane >> (4 * j)) & 15);
          }
        arrange_quads<4>(q, qs);
      }
    });
    return {kQ4_1Quads, packed};
  }
  if (packed.defined()) return {words ? kQ4_1Words : kQ4_1, packed};
  packed = pack_as<kQ8_0>(w.data_ptr<float>(), n, k, words);
  if (packed.defined() && words && quads) {
    // As for Q4_1: the checked words rearranged by quads (format 14).
    const int64_t blocks = k / kBlock, bytes = word_block_bytes(kQ8_0);
    uint8_t* data = packed.data_ptr<uint8_t>();
    at::parallel_for(0, (n / kPanel) * blocks, 1, [&](int64_t begin, int64_t end) {
      int8_t q[kPanel][kBlock];
      for (int64_t i = begin; i < end; ++i) {
        uint8_t* qs = data + i * bytes + word_header_bytes(kQ8_0);
        for (int g = 0; g < 16; ++g)
          for (int t = 0; t < 32; ++t) q[t / 2][2 * g + t % 2] = static_cast<int8_t>(qs[32 * g + t]);
        arrange_quads8(q, qs);
      }
    });
    return {kQ8_0Quads, packed};
  }
  if (packed.defined()) return {words ? kQ8_0Words : kQ8_0, packed};
  return {kNone, at::empty({0}, at::kByte)};
}

// What every packer of a checkpoint's q checks: this build has the product, q is an int8 CPU matrix whose outputs
// fill panels of 16 and inputs runs of `inputs` (a block of 32, or a super-block of 256), its values in lo..hi.
// q contiguous.
at::Tensor checked_q(const char* fn, const at::Tensor& q, int64_t inputs, int lo, int hi) {
  TORCH_CHECK(word_blocks_supported(), fn, ": this build has no product for 16-bit activations (it needs AVX2, FMA and F16C)");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar, fn, ": q must be an int8 CPU "
              "matrix");
  TORCH_CHECK(q.size(0) % kPanel == 0 && q.size(1) % inputs == 0 && q.numel() > 0, fn, ": the weight's shape must "
              "divide into 16 outputs by ", inputs, " inputs");
  const at::Tensor qc = q.contiguous();
  if (lo > -128 || hi < 127)  // (int8 holds nothing else: no pass over q for 8-bit weights)
    TORCH_CHECK(qc.min().item<int>() >= lo && qc.max().item<int>() <= hi, fn, ": q must be in ", lo, "..", hi);
  return qc;
}

// A quantized checkpoint's weight [out, in] as w = scale * q + minimum per block of 32 inputs of one output:
// q int8 [out, in] (0..15 for bits 4, -128..127 for 8), scale and minimum float32 [out, in / 32] -> (format,
// blocks): 5 or 6 and the blocks in the product's layout for 16-bit integer activations. The product multiplies
// by exactly these weights (d * q + m in real numbers; float32 rounds only the sums). With `half` (the caller
// found every scale and minimum exact in half precision, and for 8 bits every minimum zero) the blocks are
// formats 3 and 4 instead: the same product with half-precision headers, a bit less per weight. A scale per 16
// inputs ([out, in / 16], 8 bits, every minimum zero: GGUF Q6_K) gives format 7. With `quads` the weights take
// the arrangement for 8-bit activations (formats 10-16). With `centered` as well as `half` (4- or 5-bit q whose
// every minimum is -8 or -16 times its scale) the header holds d alone (formats 19-22).
std::tuple<int64_t, at::Tensor> pack_scaled(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minimum,
                                            int64_t bits, bool half, bool quads, bool centered) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "pack_scaled: bits must be 4, 5 or 8");
  const at::Tensor qc = checked_q("pack_scaled", q, kBlock, bits == 8 ? -128 : 0, bits == 8 ? 127 : (1 << bits) - 1);
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock;
  const bool per_16 = scale.dim() == 2 && scale.size(1) == 2 * blocks;
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == (per_16 ? 2 : 1) * blocks, "pack_scaled: scale and minimum must be float32 "
                    "[out, in / 32] (or both [out, in / 16])");
  const at::Tensor sc = scale.contiguous(), mc = minimum.contiguous();
  TORCH_CHECK(!per_16 || (bits == 8 && !half && !mc.any().item<bool>()), "pack_scaled: a scale per 16 inputs needs "
              "8-bit q, float32 headers and zero minimums");
  TORCH_CHECK(!centered || (half && !per_16 && bits != 8 &&
                             mc.equal(sc * static_cast<float>(-(1 << (bits - 1))))),
              "pack_scaled: centred blocks need 4- or 5-bit q, half-precision scales and minimums of -8 or -16 scales");
  const Format f = per_16 ? (quads ? kQ8HalvesQuads : kQ8Halves)
                  : centered ? (bits == 5 ? (quads ? kQ5CenteredQuads : kQ5Centered)
                                          : (quads ? kQ4CenteredQuads : kQ4Centered))
                  : bits == 5 ? (half ? (quads ? kQ5WordsQuads : kQ5Words) : (quads ? kQ5ScaledQuads : kQ5Scaled))
                  : bits == 8 ? (half ? (quads ? kQ8_0Quads : kQ8_0Words) : (quads ? kQ8ScaledQuads : kQ8Scaled))
                  : half ? (quads ? kQ4_1Quads : kQ4_1Words) : (quads ? kQ4ScaledQuads : kQ4Scaled);
  const int64_t block = packed_block_bytes(f), panels = n / kPanel, panel_bytes = blocks * block;
  const int64_t header_size = centered ? word_header_bytes(kQ4Centered)
                              : half ? word_header_bytes(bits == 4 ? kQ4_1 : bits == 5 ? kQ5Words : kQ8_0)
                                     : 2 * kPanel * 4;
  auto packed = at::empty({panels, panel_bytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ss = sc.data_ptr<float>();
  const float* ms = mc.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int8_t tile[kPanel][kBlock];
    float header[2 * kPanel];
    uint16_t halves[2 * kPanel];
    for (int64_t p = begin; p < end; ++p)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* dst = out + p * panel_bytes + b * block;
        for (int64_t i = 0; i < kPanel; ++i) {
          const int64_t row = p * kPanel + i;
          if (per_16)
            header[i] = ss[row * 2 * blocks + 2 * b], header[kPanel + i] = ss[row * 2 * blocks + 2 * b + 1];
          else
            header[i] = ss[row * blocks + b], header[kPanel + i] = ms[row * blocks + b];
          halves[i] = at::Half(header[i]).x, halves[kPanel + i] = at::Half(header[kPanel + i]).x;
        }
        std::memcpy(dst, half ? static_cast<const void*>(halves) : static_cast<const void*>(header), header_size);
        panel_tile(qs, k, p * kPanel, b, tile);
        arrange(tile, dst + header_size, bits, quads);
      }
  });
  return {f, packed};
}

// What a packer checks of a per-block factor it is given: a CPU matrix of `type`, [rows, cols], and with
// `half_values` float32 values that half precision holds exactly (the packed headers keep them so). `what`: the
// message.
void check_factor(const at::Tensor& t, at::ScalarType type, int64_t rows, int64_t cols, bool half_values,
                  const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 2 && t.size(0) == rows &&
              t.size(1) == cols && (!half_values || t.to(at::kHalf).to(at::kFloat).equal(t)), what);
}

// A weight of n outputs by k inputs packed in word format `base`, panels of 16 outputs in parallel: block(dst,
// row0, b) writes block b of the panel whose first output is row0, super(dst, row0, u) its super-block u's scales.
template <typename Block, typename Super>
at::Tensor fill_panels(Format base, int64_t n, int64_t k, Block& block, Super& super) {
  const int64_t blocks = k / kBlock, bytes = word_block_bytes(base), panel_bytes = word_panel_bytes(base, k);
  auto packed = at::empty({n / kPanel, panel_bytes}, at::kByte);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = out + p * panel_bytes;
      for (int64_t b = 0; b < blocks; ++b) block(panel + b * bytes, p * kPanel, b);
      for (int64_t u = 0; u < super_groups(base, k); ++u)
        super(panel + blocks * bytes + u * super_bytes(base), p * kPanel, u);
    }
  });
  return packed;
}

// fill_panels for a format without super-blocks.
template <typename Block>
at::Tensor fill_panels(Format base, int64_t n, int64_t k, Block& block) {
  auto none = [](uint8_t*, int64_t, int64_t) {};
  return fill_panels(base, n, k, block, none);
}

// 4-bit codes q int8 [out, in] (0..15) of `table` ("nf4" or "fp4": bitsandbytes' tables) with a scale (absmax)
// float32 [out, in / 32] per block -> (format, blocks): 17 or 18, w = scale * table[q] as kCodes rounds it; with a
// scale per 64 or 128 inputs ([out, in / 64], [out, in / 128]) 39-42, each group's scale kept once.
std::tuple<int64_t, at::Tensor> pack_coded(const at::Tensor& q, const at::Tensor& scale, const std::string& table) {
  TORCH_CHECK(table == "nf4" || table == "fp4", "pack_coded: table must be nf4 or fp4");
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "pack_coded: scale must be float32 [out, in / 32], [out, in / 64] or [out, in / 128]");
  const int64_t group = q.size(1) / scale.size(1);
  TORCH_CHECK(group == kBlock || group == 2 * kBlock || group == 4 * kBlock,
              "pack_coded: scale must be float32 [out, in / 32], [out, in / 64] or [out, in / 128]");
  const at::Tensor qc = checked_q("pack_coded", q, group, 0, 15);
  const int64_t n = q.size(0), k = q.size(1), groups = k / group;
  check_factor(scale, at::kFloat, n, groups, false, "pack_coded: scale must be float32 [out, in / 32], [out, in / "
               "64] or [out, in / 128]");
  const at::Tensor sc = scale.contiguous();
  const bool nf4 = table == "nf4";
  const Format f = group == kBlock ? (nf4 ? kNf4Words : kFp4Words)
                   : group == 2 * kBlock ? (nf4 ? kNf4By64 : kFp4By64) : (nf4 ? kNf4By128 : kFp4By128);
  const float levels = code_table(f).levels;
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ss = sc.data_ptr<float>();
  auto scales = [&](uint8_t* dst, int64_t row0, int64_t g) {
    float d[kPanel];
    for (int64_t i = 0; i < kPanel; ++i) d[i] = ss[(row0 + i) * groups + g] / levels;
    std::memcpy(dst, d, sizeof d);
  };
  const int64_t header = word_header_bytes(f);
  auto block = [&](uint8_t* dst, int64_t row0, int64_t b) {
    int8_t tile[kPanel][kBlock];
    if (header) scales(dst, row0, b);
    panel_tile(qs, k, row0, b, tile);
    arrange_words<true>(tile, dst + header);
  };
  if (header) return {f, fill_panels(f, n, k, block)};
  return {f, fill_panels(f, n, k, block, scales)};
}

// 4-bit q int8 [out, in] (0..15) with a zero point: d float32 [out, in / 32] (half-precision values) and z uint8
// [out, in / 32], w = d (q - z) -> (28, blocks), or 29 with `quads`.
std::tuple<int64_t, at::Tensor> pack_zero_points(const at::Tensor& q, const at::Tensor& d, const at::Tensor& z,
                                                 bool quads) {
  const at::Tensor qc = checked_q("pack_zero_points", q, kBlock, 0, 15);
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock;
  check_factor(d, at::kFloat, n, blocks, true, "pack_zero_points: d must be float32 [out, in / 32] half-precision "
               "values");
  check_factor(z, at::kByte, n, blocks, false, "pack_zero_points: z must be uint8 [out, in / 32]");
  const at::Tensor dc = d.contiguous(), zc = z.contiguous();
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ds = dc.data_ptr<float>();
  const uint8_t* zs = zc.data_ptr<uint8_t>();
  auto block = [&](uint8_t* dst, int64_t row0, int64_t b) {
    int8_t tile[kPanel][kBlock];
    uint16_t halves[kPanel];
    for (int64_t i = 0; i < kPanel; ++i) {
      halves[i] = at::Half(ds[(row0 + i) * blocks + b]).x;
      dst[2 * kPanel + i] = zs[(row0 + i) * blocks + b];
    }
    std::memcpy(dst, halves, sizeof halves);
    panel_tile(qs, k, row0, b, tile);
    arrange(tile, dst + word_header_bytes(kQ4Zero), 4, quads);
  };
  return {quads ? kQ4ZeroQuads : kQ4Zero, fill_panels(kQ4Zero, n, k, block)};
}

// Writes a block of `bits`-bit q with no header (the formats whose scales follow the panel's blocks).
auto bare_block(const int8_t* qs, int64_t k, int64_t bits, bool quads) {
  return [=](uint8_t* dst, int64_t row0, int64_t b) {
    int8_t tile[kPanel][kBlock];
    panel_tile(qs, k, row0, b, tile);
    arrange(tile, dst, bits, quads);
  };
}

// 8-bit q int8 [out, in] (-128..127, in a multiple of 32) with a float32 scale d [out, ceil(in / 128)] (the last
// group the rest of the row), w = d q -> (43, blocks), or 44 with `quads`.
std::tuple<int64_t, at::Tensor> pack_eight_by_128(const at::Tensor& q, const at::Tensor& d, bool quads) {
  const at::Tensor qc = checked_q("pack_eight_by_128", q, kBlock, -128, 127);
  const int64_t n = q.size(0), k = q.size(1), groups = super_groups(kQ8By128, k);
  check_factor(d, at::kFloat, n, groups, false, "pack_eight_by_128: d must be float32 [out, ceil(in / 128)]");
  const at::Tensor dc = d.contiguous();
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ds = dc.data_ptr<float>();
  auto block = bare_block(qs, k, 8, quads);
  auto super = [&](uint8_t* dst, int64_t row0, int64_t u) {
    float scales[kPanel];
    for (int64_t i = 0; i < kPanel; ++i) scales[i] = ds[(row0 + i) * groups + u];
    std::memcpy(dst, scales, sizeof scales);
  };
  return {quads ? kQ8By128Quads : kQ8By128, fill_panels(kQ8By128, n, k, block, super)};
}

// 4-bit q int8 [out, in] (0..15) with a scale per group of 64 or 128 inputs: d float32 [out, in / group]
// (half-precision values), w = d (q - 8), or with z (uint8 [out, in / group], or an empty tensor) w = d (q - z)
// -> (31-34, blocks), or 35-38 with `quads`.
std::tuple<int64_t, at::Tensor> pack_groups(const at::Tensor& q, const at::Tensor& d, const at::Tensor& z,
                                            bool quads) {
  TORCH_CHECK(d.dim() == 2 && d.size(1) > 0 && q.dim() == 2 && q.size(1) % d.size(1) == 0 &&
                  (q.size(1) / d.size(1) == 64 || q.size(1) / d.size(1) == 128),
              "pack_groups: d must be [out, in / 64] or [out, in / 128]");
  const int64_t group = q.size(1) / d.size(1);
  const at::Tensor qc = checked_q("pack_groups", q, group, 0, 15);
  const int64_t n = q.size(0), k = q.size(1), groups = k / group;
  check_factor(d, at::kFloat, n, groups, true, "pack_groups: d must be float32 half-precision values");
  const bool zero = z.defined() && z.numel() > 0;
  if (zero) check_factor(z, at::kByte, n, groups, false, "pack_groups: z must be uint8 [out, in / group]");
  const Format base = zero ? (group == 64 ? kQ4ZeroBy64 : kQ4ZeroBy128)
                           : (group == 64 ? kQ4CenteredBy64 : kQ4CenteredBy128);
  const at::Tensor dc = d.contiguous(), zc = zero ? z.contiguous() : z;
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ds = dc.data_ptr<float>();
  const uint8_t* zs = zero ? zc.data_ptr<uint8_t>() : nullptr;
  auto block = bare_block(qs, k, 4, quads);
  auto super = [&](uint8_t* dst, int64_t row0, int64_t u) {
    uint16_t halves[kPanel];
    for (int64_t i = 0; i < kPanel; ++i) {
      halves[i] = at::Half(ds[(row0 + i) * groups + u]).x;
      if (zero) dst[2 * kPanel + i] = zs[(row0 + i) * groups + u];
    }
    std::memcpy(dst, halves, sizeof halves);
  };
  return {quads ? base + 4 : base, fill_panels(base, n, k, block, super)};
}

// GGUF Q4_K / Q5_K blocks with their two-level scales: q int8 [out, in] (0..15 or 0..31), D and M float32
// [out, in / 256] (half-precision values), s and t uint8 [out, in / 32] (0..63): w = D s q - M t per block of
// 32 -> (format, blocks): 23 or 24 (25 or 26 with `quads`, for 8-bit activations).
std::tuple<int64_t, at::Tensor> pack_super(const at::Tensor& q, const at::Tensor& big_d, const at::Tensor& s,
                                           const at::Tensor& big_m, const at::Tensor& t, int64_t bits, bool quads) {
  TORCH_CHECK(bits == 4 || bits == 5, "pack_super: bits must be 4 or 5");
  const at::Tensor qc = checked_q("pack_super", q, kBlock * kSuperBlocks, 0, (1 << bits) - 1);
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock, supers = blocks / kSuperBlocks;
  for (const at::Tensor* x : {&big_d, &big_m})
    check_factor(*x, at::kFloat, n, supers, true, "pack_super: D and M must be float32 [out, in / 256] half-precision "
                 "values");
  for (const at::Tensor* x : {&s, &t})
    check_factor(*x, at::kByte, n, blocks, false, "pack_super: s and t must be uint8 [out, in / 32]");
  const at::Tensor dc = big_d.contiguous(), mc = big_m.contiguous(), sc = s.contiguous(), tc = t.contiguous();
  const Format base = bits == 4 ? kQ4Super : kQ5Super;
  const Format f = quads ? (bits == 4 ? kQ4SuperQuads : kQ5SuperQuads) : base;
  const int8_t* qs = qc.data_ptr<int8_t>();
  const uint8_t *ss = sc.data_ptr<uint8_t>(), *ts = tc.data_ptr<uint8_t>();
  const float *ds = dc.data_ptr<float>(), *ms = mc.data_ptr<float>();
  auto block = [&](uint8_t* dst, int64_t row0, int64_t b) {
    int8_t tile[kPanel][kBlock];
    for (int64_t i = 0; i < kPanel; ++i) {
      dst[i] = ss[(row0 + i) * blocks + b];
      dst[kPanel + i] = ts[(row0 + i) * blocks + b];
    }
    panel_tile(qs, k, row0, b, tile);
    arrange(tile, dst + word_header_bytes(base), bits, quads);
  };
  auto super = [&](uint8_t* dst, int64_t row0, int64_t u) {
    uint16_t halves[2 * kPanel];
    for (int64_t i = 0; i < kPanel; ++i)
      halves[i] = at::Half(ds[(row0 + i) * supers + u]).x, halves[kPanel + i] = at::Half(ms[(row0 + i) * supers + u]).x;
    std::memcpy(dst, halves, sizeof halves);
  };
  const at::Tensor packed = fill_panels(base, n, k, block, super);
  return {f, packed};
}

// GGUF Q6_K blocks as the file holds them: q int8 [out, in] (-32..31), D float32 [out, in / 256] (half-precision
// values), s int8 [out, in / 16]: w = D s q per 16 inputs -> (27, blocks), or 30 with `quads`.
std::tuple<int64_t, at::Tensor> pack_six_bit(const at::Tensor& q, const at::Tensor& big_d, const at::Tensor& s,
                                             bool quads) {
  const at::Tensor qc = checked_q("pack_six_bit", q, kBlock * kSuperBlocks, -32, 31);
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock, supers = blocks / kSuperBlocks;
  check_factor(big_d, at::kFloat, n, supers, true, "pack_six_bit: D must be float32 [out, in / 256] half-precision "
               "values");
  check_factor(s, at::kChar, n, 2 * blocks, false, "pack_six_bit: s must be int8 [out, in / 16]");
  const at::Tensor dc = big_d.contiguous(), sc = s.contiguous();
  const int8_t* qs = qc.data_ptr<int8_t>();
  const int8_t* ss = sc.data_ptr<int8_t>();
  const float* ds = dc.data_ptr<float>();
  auto block = [&](uint8_t* dst, int64_t row0, int64_t b) {
    int8_t tile[kPanel][kBlock];
    for (int64_t i = 0; i < kPanel; ++i) {
      const int64_t row = row0 + i;
      dst[i] = static_cast<uint8_t>(ss[row * 2 * blocks + 2 * b]);
      dst[kPanel + i] = static_cast<uint8_t>(ss[row * 2 * blocks + 2 * b + 1]);
      for (int64_t j = 0; j < kBlock; ++j)
        tile[i][j] = static_cast<int8_t>(qs[row * k + b * kBlock + j] + 32);  // 0..63
    }
    arrange(tile, dst + word_header_bytes(kQ6Super), 6, quads);
  };
  auto super = [&](uint8_t* dst, int64_t row0, int64_t u) {
    uint16_t halves[kPanel];
    for (int64_t i = 0; i < kPanel; ++i) halves[i] = at::Half(ds[(row0 + i) * supers + u]).x;
    std::memcpy(dst, halves, sizeof halves);
  };
  const at::Tensor packed = fill_panels(kQ6Super, n, k, block, super);
  return {quads ? kQ6SuperQuads : kQ6Super, packed};
}

// x [rows, in] (contiguous; float32, or bfloat16 for formats 3 to 16) times each weight `pack_blocks` or
// `pack_scaled` packed (`packed[i]` in `formats[i]`, outs[i] outputs), the outputs side by side, [rows, sum of
// outs], in x's dtype, plus `bias` (float32 [sum of outs]) before any rounding to bfloat16. Formats 1 and 2 (float32
// activations) take one weight at a time.
at::Tensor blocks_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& formats, const std::vector<int64_t>& outs,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocks_supported(), "blocks_linear: this build has no block product (it needs AVX2 and FMA)");
  TORCH_CHECK(!packed.empty() && packed.size() == formats.size() && packed.size() == outs.size(),
              "blocks_linear: one format and output count per packed weight");
  const bool words = formats[0] >= kQ4_1Words;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || (words && x.scalar_type() == at::kBFloat16)),
              "blocks_linear: x must be a contiguous float32 CPU matrix [rows, in] (or bfloat16, for formats 3 to 16)");
  const int64_t rows = x.size(0), k = x.size(1);
  int64_t n = 0;
  std::vector<Part> parts;
  for (size_t i = 0; i < packed.size(); ++i) {
    const int64_t format = formats[i], out_features = outs[i];
    TORCH_CHECK(format >= kQ4_1 && format <= kLastFormat, "blocks_linear: unknown format");
    TORCH_CHECK(format <= kQ8_0 || word_blocks_supported(), "blocks_linear: this build has no product from integer "
                "activations (it needs AVX2, FMA and F16C)");
    TORCH_CHECK(!quad_format(format) || quad_blocks_supported(), "blocks_linear: this build has no product from "
                "8-bit activations (it needs AVX512_VNNI)");
    TORCH_CHECK((format >= kQ4_1Words) == words && (words || packed.size() == 1), "blocks_linear: formats 1 and 2 "
                "take one weight at a time");
    const int64_t bytes = packed_block_bytes(format), base = word_base(format), span = kBlock * super_blocks(base);
    const at::Tensor& p = packed[i];
    TORCH_CHECK(p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 2 && k % kBlock == 0 &&
                    out_features % kPanel == 0 && p.size(0) == out_features / kPanel &&
                    (super_bytes(base) == 0 || k % span == 0 || base == kQ8By128) &&
                    p.size(1) == (k / kBlock) * bytes + super_groups(base, k) * super_bytes(base),
                "blocks_linear: packed weight does not match x, format and out_features");
    parts.push_back(Part{p.data_ptr<uint8_t>(), static_cast<Format>(format), out_features, n});
    n += out_features;
  }
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                "blocks_linear: bias must be a contiguous float32 vector of the outputs");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#if defined(LLM_FLOAT_BLOCKS)
  if (!words) {
    const float* xs = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    if (formats[0] == kQ4_1) product<kQ4_1>(xs, rows, k, parts[0].blocks, o, n);
    if (formats[0] == kQ8_0) product<kQ8_0>(xs, rows, k, parts[0].blocks, o, n);
    if (b != nullptr) out.add_(*bias);
    return out;
  }
#endif
#if defined(LLM_WORD_PRODUCT)
  if (x.scalar_type() == at::kFloat) {
    word_products(x.data_ptr<float>(), rows, k, parts, n, out.data_ptr<float>(), nullptr, b);
  } else {
    std::vector<float> sums(rows * n);
    word_products(x.data_ptr<c10::BFloat16>(), rows, k, parts, n, sums.data(), out.data_ptr<c10::BFloat16>(), b);
  }
#endif
  return out;
}

// One weight: blocks_linear_parts with one part.
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  return blocks_linear_parts(x, {packed}, {format}, {out_features}, bias);
}
