"""Re-exports kvcache_core.breaker (the contract now lives in kvcache_core; this import path keeps working)."""

from kvcache_core.breaker import (  # noqa: F401
    BreakerState,
    CircuitBreaker,
)
