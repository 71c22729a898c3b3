"""Embeddings, pooling, score and rerank."""
