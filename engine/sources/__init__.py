"""Where model files come from: store.py resolves MODEL_NAME (embedded, baked, local, S3, Hub); s3.py and hub.py
fetch into cache.py's entries; gguf.py converts GGUF files once; prefetch.py bakes models into an image."""
