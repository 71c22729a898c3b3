"""Choosing tokens: sampling parameters and the sampler (penalties, logprobs), and grammar-constrained decoding."""
