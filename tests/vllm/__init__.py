"""Tests of the vLLM KV connector against the real vllm==0.33.0 (CPU)."""
