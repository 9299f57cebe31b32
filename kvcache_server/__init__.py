"""The kvcache server: a gRPC front end over a stack of storage tiers. Never imports torch."""

__version__ = "0.1.0"
