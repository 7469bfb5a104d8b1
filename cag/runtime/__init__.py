"""The decode runtime: continuous batching (decoder), per-request suffix slots, the lean step over a
pass's rows, attention over a shared prefix (cascade), kept conversations, and the transformers KV
cache plumbing that prefill and the forward path share (kv_cache, generate)."""
