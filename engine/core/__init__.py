"""The scheduling core: the generation loops (interface.py, the paged loop.py, fallback.py), the scheduler, KV
blocks, sequences, outputs and detokenization, beam search, speculative decoding and the pooling queue."""
