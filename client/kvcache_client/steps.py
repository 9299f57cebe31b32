"""One implementation of a call, two faces: the call is a generator of I/O steps (httpx's shape).

The SDK's decisions (which request to send, what an answer means, when to fall back, which leases
to hand back, how much of the deadline is left) are written once, as generator functions that
yield an *operation* where they need I/O and receive its outcome (a value, or an exception thrown
in at the yield, to be handled there as if the I/O had raised it):

    def lookup(...) -> Steps[LookupResult]:
        answer = yield Request(lambda transport, t: transport.lookup(ns, keys, t), t)
        return answer

An operation says how it is done through `perform(io)`, which calls a method of the face's I/O
object: a plain function on the blocking face, a coroutine function on the asyncio one, of the same
name and arguments. One driver serves both: `arun` awaits what an operation returns where it is
awaitable, and `run` (the blocking face) drives `arun` without an event loop, since operations that
return their outcomes never suspend it. So a fix to the logic lands once, and the faces differ only
in how they wait (threads and gRPC futures, or tasks).

Who uses it: kvcache_client.calls (the clients' calls: arguments, retries, verification) and
kvcache_client.inplace_core (in-place reads through the server's arena: leases and their hand-back).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

Steps = Generator["Operation", Any, T]
"""A call written once: yields operations, receives their outcomes, returns the call's result."""


class Operation(Protocol):
    """One I/O step a call asks its face for."""

    def perform(self, io: Any) -> Any:
        """Runs the step on `io` (a face's I/O object): its outcome, or an awaitable of it on the asyncio face."""


class Do:
    """An operation that needs no I/O object: fn() (a value on the blocking face, an awaitable on the asyncio one)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def perform(self, io: object) -> Any:
        return self.fn()


def run(steps: Steps[T], io: object = None) -> T:
    """Drives `steps` to its end, each operation run now on `io` (the blocking face, whose
    operations return their outcomes: `arun` then never suspends, and ends within one send).

    Raises:
        whatever the steps raise (an operation's exception is first thrown into them).
    """
    driver = arun(steps, io)
    try:
        driver.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise RuntimeError("an operation of the blocking face returned an awaitable")


async def arun(steps: Steps[T], io: object = None) -> T:
    """Drives `steps` to its end, each operation performed on `io` and awaited where it returns an
    awaitable (the asyncio face). A cancellation arrives in the steps as the CancelledError of the
    operation being awaited, at the yield that asked for it.

    Raises:
        whatever the steps raise (an operation's exception is first thrown into them).
    """
    outcome = _Outcome()
    while True:
        try:
            operation = outcome.into(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            pending = operation.perform(io)
            outcome = _Outcome(await pending if inspect.isawaitable(pending) else pending)
        except BaseException as exc:  # CancelledError, KeyboardInterrupt too: the steps release what they hold
            outcome = _Outcome(error=exc)


class _Outcome:
    """What an operation came to: sent into the steps, or thrown in at their yield."""

    __slots__ = ("error", "value")

    def __init__(self, value: object = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    def into(self, steps: Steps[Any]) -> Operation:
        """Hands the outcome to the steps; their next operation (StopIteration once they return).
        Outside the drivers' except blocks, so an error the steps raise carries no stray context."""
        if self.error is None:
            return steps.send(self.value)
        error, self.error = self.error, None  # not kept past its use (a traceback holds frames)
        return steps.throw(error)
