"""Parts of the `kvcache` command line (kvcache_client.cli): input parsing, rendering, the benchmark.

Nothing here is SDK API; only kvcache_client.cli imports these modules.
"""
