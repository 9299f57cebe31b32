"""kvcache-router: an OpenAI-compatible, cache-aware front door for prefill and decode workers (docs/router.md)."""

__version__ = "0.1.0"
