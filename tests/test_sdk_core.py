"""Both SDK faces keep issue #22's invariant 6 the same way, because they are one implementation.

Whatever deadline, cancellation or exception ends a call, KVCacheClient and AsyncKVCacheClient hand
back every lease and reservation the server granted. One table of scenarios runs against both faces
and a real server (same host, its arena shared), and after each the server's own counters must be
exact: Stats says arena_leases == 0 and arena_reservations == 0, and no lease was left to expire.
A face that drifts from the other fails here. The structural checks below say why they cannot
drift: both drive the same steps (kvcache_client.calls, kvcache_client.inplace_core) and keep their
account of late answers in the same LeaseBook; a face only does I/O.

"Stopping" a call is the asyncio face's task.cancel() and the blocking face's interrupt (a signal
handler raising in the calling thread, as KeyboardInterrupt does), both while the call waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient, calls, inplace_core
from kvcache_client import aio as aio_module
from kvcache_client import client as client_module
from kvcache_client.arena import InPlaceCalls
from kvcache_client.arena_aio import AsyncInPlaceCalls
from kvcache_client.errors import DeadlineExceeded, KVCacheError
from kvcache_client.inplace_core import LeaseBook
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "n"
MiB = 1 << 20
BLOCK_BYTES = 128 << 10
KEYS = 16


class Raised(Exception):
    """What a caller's own code raises inside leased()'s block."""


class Stopped(BaseException):
    """The blocking face's cancellation: raised in the calling thread while it waits (as KeyboardInterrupt is)."""


# -- the table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call of a scenario: `kind` (leased, get_into, get_many, put_many), its deadline, and how
    the caller ends it: "use" (reads what it got), "raise" (Raised inside leased()'s block),
    "wrong size" (get_into with a destination of the wrong size), "stop" (stopped after stop_s)."""

    kind: str
    timeout_s: float | None = None
    then: str = "use"
    stop_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    calls: Callable[[random.Random], list[Call]]
    stall_s: float = 0.0
    """The server's loop answers nothing for this long as the calls start (their answers come late)."""
    outcomes: Callable[[dict[str, int]], bool] = lambda _: True
    """Checks the counts of how the calls ended (ok, deadline, raised, wrong size, stopped)."""
    handed_back: int | None = None
    """LeaseGet answers that came after their caller stopped waiting, whose leases were handed back."""
    faces: tuple[str, ...] = ("blocking", "asyncio")
    leases_only: bool = False
    """Every get leases in place (client.bulk.same_host_get_bytes = 0): a small one would otherwise be
    one bulk GET (kvcache_client.bulk.SAME_HOST_BULK_GET_BYTES), which pins no lease to hand back."""


def _sweep(rng: random.Random) -> list[Call]:
    # Log-uniform over 0.01-15 ms: a quiet, fast machine finishes these calls in well under a
    # millisecond (CI saw 300 of 300 pass with 0.5-15 ms), so the range reaches deadlines no call
    # can meet, and every face sees deadlines pass before, between and after its round trips.
    kinds = ["leased", "get_into", "get_many", "put_many"]
    return [Call(kinds[i % 4], timeout_s=10 ** rng.uniform(-5, math.log10(0.015))) for i in range(300)]


SCENARIOS = [
    Scenario(  # 300 calls with 0.01-15 ms deadlines: many pass while the server still answers
        "deadlines of 0.01-15 ms",
        _sweep,
        outcomes=lambda n: n["deadline"] > 0 and n["ok"] + n["deadline"] == 300,
    ),
    Scenario(
        "the caller raises inside leased()",
        lambda _: [Call("leased", then="raise") for _ in range(20)],
        outcomes=lambda n: n["raised"] == 20,
    ),
    Scenario(
        "get_into with a destination of the wrong size",
        lambda _: [Call("get_into", then="wrong size") for _ in range(20)],
        outcomes=lambda n: n["wrong size"] == 20,
    ),
    Scenario(  # each LeaseGet is answered, pinning slots, after its caller stopped waiting
        "stopped or past the deadline while the server stalls",
        lambda _: [
            Call("leased", then="stop", stop_s=0.02),
            Call("get_into", then="stop", stop_s=0.02),
            Call("get_many", timeout_s=0.02),
            Call("put_many", timeout_s=0.02),
        ],
        stall_s=0.5,
        outcomes=lambda n: n["stopped"] == 2 and n["deadline"] == 2,
        handed_back=3,
        leases_only=True,
    ),
    # Cancelled at any await, deadlines of 1-15 ms. asyncio only: a cancellation arrives at an await,
    # where the SDK can act on it, but an interrupt at a random point of a blocking call may land in
    # gRPC's own code, whose channel it leaves locked (no SDK can hand anything back then); the
    # blocking face is stopped where its caller waits (the scenario above) and at random points by
    # its deadlines (the first scenario).
    Scenario(
        "cancelled at random points",
        lambda rng: [
            Call(["leased", "get_into", "get_many"][i % 3], timeout_s=rng.uniform(0.001, 0.015))
            if i % 2
            else Call(["leased", "get_into", "get_many"][i % 3], then="stop", stop_s=rng.uniform(0.0, 0.004))
            for i in range(60)
        ],
        outcomes=lambda n: n["stopped"] > 0,
        faces=("asyncio",),
    ),
]


# -- the two faces behind one async surface ------------------------------------------------------------


class Face:
    """What a scenario asks of a client. The blocking face's calls run (blocking) inside the
    scenario's coroutine, so one script drives both faces."""

    name: str

    def leased(self, keys: list[bytes], timeout_s: float | None) -> contextlib.AbstractAsyncContextManager[list[Any]]:
        raise NotImplementedError

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def stopped(self, run: Callable[[], Any], after_s: float) -> None:
        """Runs run() and stops it after `after_s`; raises what stopping raises (or run's own error)."""
        raise NotImplementedError

    async def settle(self) -> LeaseBook:
        """Waits until no abandoned call nor release is still under way; the face's book."""
        raise NotImplementedError

    def inplace(self) -> InPlaceCalls | AsyncInPlaceCalls:
        return self.client._transport.inner._inplace  # type: ignore[attr-defined]

    client: Any


class Blocking(Face):
    name = "blocking"

    def __init__(self, target: str) -> None:
        self.client = KVCacheClient(target, timeout_s=30)

    @contextlib.asynccontextmanager
    async def leased(self, keys: list[bytes], timeout_s: float | None) -> AsyncIterator[list[Any]]:
        with self.client.leased(NS, keys, timeout_s=timeout_s) as views:
            yield views

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client, method)(*args, **kwargs)

    async def stopped(self, run: Callable[[], Any], after_s: float) -> None:
        with _interrupt_after(after_s):
            await run()

    async def settle(self) -> LeaseBook:
        inplace = self.inplace()
        assert isinstance(inplace, InPlaceCalls)
        inplace.drain(15)  # each abandoned call ends within its deadline plus CLEANUP_S
        assert not inplace.book.pending
        return inplace.book


class Asyncio(Face):
    name = "asyncio"

    def __init__(self, target: str) -> None:
        self.client = AsyncKVCacheClient(target, timeout_s=30)

    def leased(self, keys: list[bytes], timeout_s: float | None) -> contextlib.AbstractAsyncContextManager[list[Any]]:
        return self.client.leased(NS, keys, timeout_s=timeout_s)  # type: ignore[no-any-return]

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.client, method)(*args, **kwargs)

    async def stopped(self, run: Callable[[], Any], after_s: float) -> None:
        task = asyncio.ensure_future(run())
        await asyncio.sleep(after_s)
        task.cancel()
        await task

    async def settle(self) -> LeaseBook:
        inplace = self.inplace()
        assert isinstance(inplace, AsyncInPlaceCalls)
        await asyncio.wait_for(inplace.drain(), 15)
        return inplace.book


@contextlib.contextmanager
def _interrupt_after(after_s: float) -> Iterator[None]:
    """Raises Stopped in this (the main) thread after `after_s`, wherever it is then."""
    main = threading.get_ident()
    fired = threading.Event()

    def handler(signum: int, frame: object) -> None:
        raise Stopped()

    def fire() -> None:
        fired.set()
        signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(after_s, fire)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        try:
            timer.join()
            if fired.is_set():
                time.sleep(0.001)  # a signal on its way is delivered while the handler is still ours
        except Stopped:
            pass
        signal.signal(signal.SIGUSR1, previous)


# -- the script both faces run -------------------------------------------------------------------------


@dataclass
class Tally:
    counts: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "deadline": 0, "raised": 0, "wrong size": 0, "stopped": 0}
    )
    wrong_bytes: int = 0


def _blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        k = os.urandom(16)
        out.append((k, raw_block(k, os.urandom(size))))
    return out


async def _one(face: Face, call: Call, stored: dict[bytes, bytes], rng: random.Random, tally: Tally) -> None:
    keys = rng.sample(sorted(stored), 8)

    def check(got: list[Any]) -> None:
        tally.wrong_bytes += sum(b is not None and bytes(b) != stored[k] for k, b in zip(keys, got, strict=True))

    async def leased() -> None:
        async with face.leased(keys, call.timeout_s) as views:
            check(views)
            if call.then == "raise":
                raise Raised()

    async def get_into() -> None:
        short = 1 if call.then == "wrong size" else 0
        dst = [bytearray(len(stored[k]) - 48 - short) for k in keys]
        found = await face.call("get_into", NS, keys, dst, timeout_s=call.timeout_s)
        tally.wrong_bytes += sum(f and bytes(d) != stored[k][48:] for k, f, d in zip(keys, found, dst, strict=True))

    async def get_many() -> None:
        check(await face.call("get_many", NS, keys, timeout_s=call.timeout_s))

    async def put_many() -> None:
        await face.call("put_many", "p", _blocks(4, 64 << 10), timeout_s=call.timeout_s)

    run = {"leased": leased, "get_into": get_into, "get_many": get_many, "put_many": put_many}[call.kind]
    try:
        if call.then == "stop":
            await face.stopped(run, call.stop_s)
        else:
            await run()
        tally.counts["ok"] += 1
    except DeadlineExceeded:
        tally.counts["deadline"] += 1
    except Raised:
        tally.counts["raised"] += 1
    except ValueError:
        tally.counts["wrong size"] += 1
    except (Stopped, asyncio.CancelledError):
        tally.counts["stopped"] += 1
    except KVCacheError:  # a deadline that passed inside another status's call (an ended stream)
        tally.counts["deadline"] += 1


def _hold(lock: threading.Lock, seconds: float) -> None:
    with lock:
        time.sleep(seconds)


async def _scenario(face: Face, scenario: Scenario, server: ServerThread) -> tuple[Tally, int]:
    rng = random.Random(scenario.name)
    stored = dict(_blocks(KEYS, BLOCK_BYTES))
    tally = Tally()
    assert (await face.call("put_many", NS, list(stored.items()))).stored == KEYS
    async with face.leased(sorted(stored), None) as views:  # the path is on: every block in place
        assert all(v is not None for v in views)
    before = face.inplace().book.handed_back
    if scenario.stall_s:  # the RAM tier's lock held: the event loop and the bulk port's LEASEs both wait
        threading.Thread(target=_hold, args=(server.stack.ram._lock, scenario.stall_s), daemon=True).start()
        await asyncio.sleep(0.05)
    for call in scenario.calls(rng):
        await _one(face, call, stored, rng, tally)
    book = await face.settle()
    stats = await face.call("stats")
    assert (stats.arena_leases, stats.arena_reservations) == (0, 0), (face.name, scenario.name, tally.counts)
    assert (stats.arena_leases_expired, stats.arena_reservations_reclaimed) == (0, 0)  # handed back, not expired
    assert face.client._transport.arena.state == "on"  # nothing turned the path off
    got = await face.call("get_many", NS, sorted(stored))
    assert [bytes(b) for b in got] == [stored[k] for k in sorted(stored)]
    return tally, book.handed_back - before


@pytest.fixture
def arena_server(make_server, tmp_path: Path) -> ServerThread:
    # Leases outlive every scenario: one found open, or expired, was not handed back.
    return make_server(ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 60}, shm={"dir": str(tmp_path / "shm")})


FACES: dict[str, Callable[[str], Face]] = {"blocking": Blocking, "asyncio": Asyncio}


@pytest.mark.parametrize(
    ("scenario", "face_name"),
    [pytest.param(s, f, id=f"{s.name}-{f}") for s in SCENARIOS for f in s.faces],
)
def test_every_lease_and_reservation_is_handed_back(
    arena_server: ServerThread, scenario: Scenario, face_name: str
) -> None:
    async def run() -> tuple[Tally, int]:
        face = FACES[face_name](arena_server.target)
        if scenario.leases_only:
            face.client.bulk.same_host_get_bytes = 0
            face.client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
        try:
            return await _scenario(face, scenario, arena_server)
        finally:
            if isinstance(face.client, AsyncKVCacheClient):
                await face.client.close()
            else:
                face.client.close()

    tally, handed_back = asyncio.run(run())
    print(face_name, scenario.name, tally.counts, "handed back:", handed_back)
    assert tally.wrong_bytes == 0
    assert scenario.outcomes(tally.counts), tally.counts
    if scenario.handed_back is not None:
        assert handed_back == scenario.handed_back
    stats = arena_server.stack.ram.arena_stats()
    assert (stats["leases"], stats["reservations"], stats["leases_expired"]) == (0, 0, 0)


# -- why the faces cannot drift: one implementation ------------------------------------------------------


def test_both_faces_keep_their_account_in_one_lease_book_and_do_only_io(arena_server: ServerThread) -> None:
    async def asyncio_face() -> Any:
        async with AsyncKVCacheClient(arena_server.target) as client:
            return client._transport.inner._inplace

    with KVCacheClient(arena_server.target) as blocking:
        faces = [blocking._transport.inner._inplace, asyncio.run(asyncio_face())]
    assert [type(f.book) for f in faces] == [LeaseBook, LeaseBook]
    assert faces[0].book is not faces[1].book  # one account per client
    # Each face implements the same I/O operations, plainly or as coroutines, and nothing else of the
    # steps: requests, answers, fallbacks and hand-backs are the core's.
    io_methods = {n for n, v in vars(inplace_core.InPlaceIO).items() if inspect.isfunction(v) and n[0] != "_"}
    assert io_methods == {"lease_get", "follow", "hand_back", "send_release", "fetch", "copy_out"}
    for name in io_methods:
        assert not inspect.iscoroutinefunction(getattr(InPlaceCalls, name)), name
        assert inspect.iscoroutinefunction(getattr(AsyncInPlaceCalls, name)), name
    client_io = {n for n, v in vars(calls.ClientIO).items() if inspect.isfunction(v) and n[0] != "_"}
    assert client_io == {"request", "sleep", "transport"}
    for name in client_io:
        assert not inspect.iscoroutinefunction(getattr(client_module._BlockingIO, name)), name
        assert inspect.iscoroutinefunction(getattr(aio_module._AsyncIO, name)), name
    for face in (InPlaceCalls, AsyncInPlaceCalls, KVCacheClient, AsyncKVCacheClient):
        source = inspect.getsource(face)
        for decision in (
            "LeaseGetRequest(",
            "lease_ids(",
            "not_leased(",
            "arena_fallback(",
            "should_retry(",
            "verified(",
        ):
            assert decision not in source, (face.__name__, decision)


def test_both_faces_drive_the_same_steps(arena_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spy on the core's steps sees every call of either face: a fix there lands in both."""
    seen: list[str] = []

    def spy(module: Any, name: str) -> None:
        steps = getattr(module, name)

        def spied(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return steps(*args, **kwargs)

        monkeypatch.setattr(module, name, spied)

    spy(inplace_core, "lease")
    spy(inplace_core, "get")
    spy(inplace_core, "releasing")
    monkeypatch.setattr(calls.Calls, "retrying", _spied_method(calls.Calls.retrying, seen))
    data = _blocks(2, BLOCK_BYTES)
    keys = [k for k, _ in data]

    with KVCacheClient(arena_server.target) as client:
        client.bulk.same_host_get_bytes = 0  # every get through the core's lease steps, none as one bulk GET
        client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
        client.put_many(NS, data)
        with client.leased(NS, keys) as views:
            assert all(v is not None for v in views)
        assert client.get_many(NS, keys) == [memoryview(b) for _, b in data]
    blocking_seen, seen[:] = list(seen), []

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target) as client:
            client.bulk.same_host_get_bytes = 0
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            await client.put_many(NS, data)
            async with client.leased(NS, keys) as views:
                assert all(v is not None for v in views)
            assert await client.get_many(NS, keys) == [memoryview(b) for _, b in data]

    asyncio.run(run())
    assert blocking_seen == seen
    # put_many; leased: a lease, handed back when the block ends; get_many: its copies out of the arena
    # (blocks_in_place: off here, so none), then a lease, copied out, handed back
    expected = ["retrying", "retrying", "lease", "releasing", "retrying", "retrying", "get", "lease", "releasing"]
    assert seen == expected, seen


def _spied_method(method: Callable[..., Any], seen: list[str]) -> Callable[..., Any]:
    def spied(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(method.__name__)
        return method(self, *args, **kwargs)

    return spied
