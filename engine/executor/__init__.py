"""Execution of a step: the model runner and its start-up probes, the paged KV cache and recurrent states,
attention over cache blocks, sliding windows and the compact decoder forward."""
