"""A circuit breaker, so a dead backend costs one timeout per back-off period, not one per request.

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN   --(reset_s elapsed: one probe call allowed)--> HALF_OPEN
    HALF_OPEN --success--> CLOSED        HALF_OPEN --failure--> OPEN (back-off doubles, capped)

While OPEN, calls are not attempted: the server's lower tiers treat that as a miss (counted as
skipped), the vLLM connector as a miss or a failed load. Shared by both, which is why it lives in
the SDK package (it imports nothing but the standard library).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Counts consecutive failures of one backend and decides whether to call it."""

    def __init__(
        self,
        failure_threshold: int = 3,
        reset_s: float = 2.0,
        max_reset_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_s <= 0 or max_reset_s < reset_s:
            raise ValueError("breaker settings out of range")
        self._threshold = failure_threshold
        self._base_reset_s = reset_s
        self._max_reset_s = max_reset_s
        self._reset_s = reset_s
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self.state = BreakerState.CLOSED
        self.opened = 0  # times the breaker opened
        self.skipped = 0  # calls not attempted while open

    def allow(self) -> bool:
        """Whether to attempt a call now. In HALF_OPEN, only one probe at a time is allowed."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self._reset_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        self.skipped += 1
        return False

    def success(self) -> None:
        self._failures = 0
        self._probing = False
        self._reset_s = self._base_reset_s
        self.state = BreakerState.CLOSED

    @property
    def cooldown_s(self) -> float:
        """The current back-off before the next probe."""
        return self._reset_s

    def failure(self) -> bool:
        """Records a failed call; True when this failure opened a closed breaker (log it once)."""
        was_closed = self.state is BreakerState.CLOSED
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._reset_s = min(self._max_reset_s, self._reset_s * 2)
            self._open()
        elif self.state is BreakerState.CLOSED and self._failures >= self._threshold:
            self._open()
        self._probing = False
        return was_closed and self.state is BreakerState.OPEN

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self.opened += 1
