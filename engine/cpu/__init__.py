"""The CPU fast paths: plan.py decides them (weights' type, kernels, layouts, block products, KV type); the
others carry them out (fused layers, weight layouts, GGUF block products, the C++ kernels in native/, memory)."""
