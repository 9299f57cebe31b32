"""Engine plugins that store and fetch KV through kvcache (vLLM, transformers)."""
