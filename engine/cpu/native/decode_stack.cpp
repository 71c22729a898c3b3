// A decode step's decoder layers in one call (engine/executor/compact_decoder.py's native stack), and the linear
// products it calls held as objects (`Product`), which the compact forward also calls one at a time.
//
// Why: at one stream a layer's work is nine kernel calls, and each call from Python has a fixed cost besides its
// work (the interpreter's tuple and view handling, pybind's argument conversion, the GIL's release and return).
// Here the same kernels run in the same order on the same tensors from one loop, so the step computes the same
// bits as the layer-by-layer path (compact_decoder._Layer.fused) and only the calls' cost goes (what it saved:
// docs/performance.md).
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

// The module's kernels (decode_kernels.cpp, quantized_linear.cpp, bf16_linear.cpp).
at::Tensor add_rms_norm_(at::Tensor& delta, const at::Tensor& residual, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter);
void rope_and_cache_(at::Tensor& qkv, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                     int64_t heads, int64_t kv_heads, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots);
void paged_decode_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& blocks, const at::Tensor& lengths, int64_t window, double scale,
                            at::Tensor& out);
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);
at::Tensor blocks_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                               const std::vector<int64_t>& formats, const std::vector<int64_t>& outs,
                               const c10::optional<at::Tensor>& bias);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, bool widen);

namespace {

// One linear layer's product of contiguous rows [tokens, in] with its own arguments bound: a packed layer
// (blocks_linear), fused packed parts side by side (blocks_linear_parts) or a bfloat16 layer (bf16_linear).
struct Product {
  enum Kind { kBlocks, kParts, kBf16 };
  Kind kind;
  std::vector<at::Tensor> packed;
  std::vector<int64_t> formats, outs;
  int64_t out_features;
  c10::optional<at::Tensor> bias;
  bool widen;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kBlocks: return blocks_linear(x, packed[0], formats[0], out_features, bias);
      case kParts: return blocks_linear_parts(x, packed, formats, outs, bias);
      default: return bf16_linear(x, packed[0], out_features, bias, widen);
    }
  }
};

Product blocks_product(const at::Tensor& packed, int64_t format, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  return Product{Product::kBlocks, {packed}, {format}, {}, out_features, bias, false};
}

Product parts_product(const std::vector<at::Tensor>& packed, const std::vector<int64_t>& formats,
                      const std::vector<int64_t>& outs, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(!packed.empty() && packed.size() == formats.size() && packed.size() == outs.size(),
              "Product.parts: one format and output width per packed part");
  int64_t total = 0;
  for (int64_t out : outs) total += out;
  return Product{Product::kParts, packed, formats, outs, total, bias, false};
}

Product bf16_product(const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& bias,
                     bool widen) {
  return Product{Product::kBf16, {packed}, {}, {}, out_features, bias, widen};
}

// One decoder layer of the shape compact_decoder._Layer.fused computes: fused q/k/v, rotary embedding and cache
// write, decode attention over the paged cache, o_proj, residual add with the post-attention RMS norm, the
// SiLU-gated MLP, and the residual add with the next layer's input norm (or the final norm).
struct Layer {
  Product qkv, o, gate_up, down;
  at::Tensor post_w, next_w;
  double post_eps, next_eps, scale;
  int64_t heads, kv_heads, head_dim, inter, window;
  bool rotary;
};

class DecodeStack {
 public:
  void add(Product qkv, Product o, Product gate_up, Product down, at::Tensor post_w, double post_eps,
           at::Tensor next_w, double next_eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
           double scale, int64_t window, bool rotary) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && inter > 0,
                "DecodeStack.add: heads, key-value heads, the head size and the MLP's width must be positive, the "
                "heads a multiple of the key-value heads");
    layers_.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(post_w),
                            std::move(next_w), post_eps, next_eps, scale, heads, kv_heads, head_dim, inter, window,
                            rotary});
  }

  // The cache's pools, one pair per layer in the stack's order; kept until the next call (the engine's pools
  // live as long as its cache).
  void set_pools(std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools) {
    TORCH_CHECK(k_pools.size() == layers_.size() && v_pools.size() == layers_.size(),
                "DecodeStack.set_pools: one key pool and one value pool per layer");
    k_pools_ = std::move(k_pools);
    v_pools_ = std::move(v_pools);
  }

  // x: the residual stream [tokens, hidden] of decode rows; normed: its first layer's input norm. The rows attend
  // in buckets (engine/executor/kv_cache.py's DecodeBucket): bucket i's rows start at offsets[i], their block
  // table is blocks[i] and their lengths lengths[i]. Returns the last layer's output and its final norm, as the
  // layer-by-layer path does.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, at::Tensor normed, const c10::optional<at::Tensor>& cos,
                                         const c10::optional<at::Tensor>& sin, const at::Tensor& slots,
                                         const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& blocks,
                                         const std::vector<at::Tensor>& lengths) {
    TORCH_CHECK(k_pools_.size() == layers_.size(), "DecodeStack.run: set_pools first");
    TORCH_CHECK(!offsets.empty() && offsets.size() == blocks.size() && offsets.size() == lengths.size(),
                "DecodeStack.run: one offset, block table and lengths per bucket");
    const int64_t tokens = x.size(0);
    std::vector<int64_t> rows(offsets.size());
    int64_t covered = 0;
    for (size_t b = 0; b < offsets.size(); ++b) {
      rows[b] = lengths[b].numel();
      TORCH_CHECK(offsets[b] == covered, "DecodeStack.run: the buckets must cover the rows in order");
      covered += rows[b];
    }
    TORCH_CHECK(covered == tokens, "DecodeStack.run: the buckets must cover every row");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor qkv = l.qkv(normed).view({tokens, l.heads + 2 * l.kv_heads, l.head_dim});
      rope_and_cache_(qkv, l.rotary ? cos : c10::nullopt, l.rotary ? sin : c10::nullopt, l.heads, l.kv_heads,
                      k_pools_[i], v_pools_[i], slots);
      // Values have the keys' head size: rope_and_cache_ takes both from the q/k/v rows' heads.
      at::Tensor out = qkv.new_empty({tokens, l.heads, l.head_dim});
      at::Tensor query = qkv.narrow(1, 0, l.heads);
      for (size_t b = 0; b < offsets.size(); ++b) {
        at::Tensor part = out.narrow(0, offsets[b], rows[b]);
        paged_decode_attention(query.narrow(0, offsets[b], rows[b]), k_pools_[i], v_pools_[i], blocks[b],
                               lengths[b], l.window, l.scale, part);
      }
      at::Tensor y = l.o(out.view({tokens, l.heads * l.head_dim}));
      normed = add_rms_norm_(y, x, l.post_w, l.post_eps);
      x = y;
      y = l.down(silu_mul(l.gate_up(normed), l.inter));
      normed = add_rms_norm_(y, x, l.next_w, l.next_eps);
      x = y;
    }
    return {x, normed};
  }

 private:
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_pools_, v_pools_;
};

}  // namespace

void register_decode_stack(py::module& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<Product>(m, "Product", "a linear layer's product of contiguous rows [tokens, in], arguments bound")
      .def("__call__", &Product::operator(), nogil, py::arg("rows"));
  m.def("blocks_product", &blocks_product, "blocks_linear's product bound to a packed weight",
        py::arg("packed"), py::arg("format"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("parts_product", &parts_product, "blocks_linear_parts' product bound to packed parts",
        py::arg("packed"), py::arg("formats"), py::arg("outs"), py::arg("bias") = py::none());
  m.def("bf16_product", &bf16_product, "bf16_linear's product bound to a packed bfloat16 weight",
        py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(), py::arg("widen") = false);
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder layers in one call")
      .def(py::init<>())
      .def("add", &DecodeStack::add, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("post_w"), py::arg("post_eps"), py::arg("next_w"), py::arg("next_eps"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"), py::arg("scale"), py::arg("window"),
           py::arg("rotary"))
      .def("set_pools", &DecodeStack::set_pools, py::arg("k_pools"), py::arg("v_pools"))
      .def("run", &DecodeStack::run, nogil, py::arg("x"), py::arg("normed"), py::arg("cos"), py::arg("sin"),
           py::arg("slots"), py::arg("offsets"), py::arg("blocks"), py::arg("lengths"));
}
