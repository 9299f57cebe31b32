"""Retry policy: which statuses to retry and how long to back off between attempts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, for retryable statuses only.

    Every kvcache RPC is idempotent (blocks are content addressed), so any of
    them may be retried; the call's overall deadline (`timeout_s`) bounds the
    attempts and the sleeps between them. By default a call keeps retrying a
    retryable status until its deadline (a server restarting, a sidecar not yet
    up): only the deadline ends it.

    Attributes:
        max_attempts: Attempts in total, the first included (1 disables retries);
            None (the default): as many as the call's deadline allows.
        initial_backoff_s: Sleep after the first failure.
        max_backoff_s: Upper bound of one sleep.
        multiplier: Growth of the sleep per failure.
        jitter: Fraction of the sleep randomised (0.2: +-20%).
        retryable: Status codes worth another attempt.
    """

    max_attempts: int | None = None
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retryable: frozenset[grpc.StatusCode] = field(default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE}))

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("backoff settings out of range")

    def should_retry(self, code: grpc.StatusCode, attempts: int) -> bool:
        """Whether to try again after `attempts` failed attempts ending in `code`."""
        return code in self.retryable and (self.max_attempts is None or attempts < self.max_attempts)

    def backoff_s(self, failures: int) -> float:
        """Sleep before the next attempt, after `failures` (>= 1) failed attempts."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (failures - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)
