"""Tests of the LMCache L2 adapter against the real lmcache==0.5.6 (CPU) and a real kvcache server."""
