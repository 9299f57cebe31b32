"""Tests of the SGLang HiCache storage backend against the real sglang==0.5.23 (CPU)."""
