"""cag: cache-augmented generation. Prefill a corpus once, keep its KV cache, answer from it."""

__version__ = "0.1.0"
