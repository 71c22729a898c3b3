"""The tokenizer routes: tokenize and detokenize."""
