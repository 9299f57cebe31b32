"""Blocks checked under their keys and copied into callers' destinations: get_into's copies and
every batch verification of what a call received (written once for both faces; the asyncio face runs
large copies in a worker thread). Out of kvcache_client.calls to keep each module under ~500 lines.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvcache_client.arena import LeasedBlocks, copy_payload_into
from kvcache_client.errors import BlockFormatError
from kvcache_client.results import Fetched
from kvcache_client.shm import CallEnded
from kvcache_core.format import parse_header, verify_block
from kvcache_core.landing import each, land

log = logging.getLogger(__name__)


def verified(
    fetched: list[Fetched | None], keys: Sequence[bytes], on_corrupt: Callable[[], None]
) -> list[memoryview | None]:
    """Blocks that pass their checksum under the key they were asked for; the rest become misses
    (a damaged block, or another key's block: format v2 binds each block to its key)."""
    found = [i for i, item in enumerate(fetched) if item is not None]

    def check(i: int) -> str | None:
        try:
            verify_block(fetched[i][0], keys[i])  # type: ignore[index]
        except BlockFormatError as exc:
            # str(exc), not exc: a record kept by a handler would keep the exception, whose traceback
            # holds this frame and every block of the call (buffers the pool could not reuse).
            return str(exc)
        return None

    # Several large blocks at once on a few threads (xxh3 lets go of the GIL: kvcache_core.landing).
    whys = each(check, found, [len(fetched[i][0]) for i in found])  # type: ignore[index]
    out: list[memoryview | None] = [None] * len(fetched)
    for i, why in zip(found, whys, strict=True):
        data, tier = fetched[i]  # type: ignore[misc]
        if why is None:
            out[i] = memoryview(data)
            continue
        log.error("block %s from tier %s failed verification, treating as a miss: %s", keys[i].hex(), tier, why)
        on_corrupt()
    return out


# -- get_into's copies (the asyncio face runs large ones in a worker thread) ---------------------------


def check_destinations(keys: Sequence[bytes], destinations: Sequence[object]) -> None:
    """Raises:
    ValueError: not one destination per key.
    """
    if len(destinations) != len(keys):
        raise ValueError(f"{len(destinations)} destinations for {len(keys)} keys")


def copy_into(
    blocks: Sequence[memoryview | None], destinations: Sequence[object], stop: threading.Event | None = None
) -> None:
    """Copies each found block's payload once into its destination (arena.copy_payload_into).

    Raises:
        CallEnded: `stop` was set (the caller was cancelled) before every block was copied.
        ValueError, TypeError: see copy_payload_into.
    """
    for block, destination in zip(blocks, destinations, strict=True):
        if stop is not None and stop.is_set():
            raise CallEnded("stopped before every block was copied")
        if block is not None:
            copy_payload_into(block, destination)


def land_into(
    blocks: Sequence[memoryview | None],
    keys: Sequence[bytes],
    destinations: Sequence[object],
    sinks: Sequence[memoryview | None],
    on_corrupt: Callable[[], None],
) -> list[bool]:
    """get_into's copies out of leased(verify=False): each block's payload copied into its
    destination's byte view and verified there, several at once (kvcache_core.landing: one pass,
    off the GIL); a destination without a view (a GPU tensor) gets a block verified where it lies,
    then copied (copy_payload_into). True where a verified block landed; a block that fails is a
    miss, counted (its destination may hold the copy, as on the bulk path's landing).

    Raises:
        ValueError, TypeError: see copy_payload_into (land() checks every size before it copies).
    """
    found = [False] * len(keys)
    jobs: list[tuple[memoryview, bytes, memoryview]] = []
    at: list[int] = []
    elsewhere: list[int] = []  # destinations without a byte view: verified in the slot, then copied
    for i, block in enumerate(blocks):
        if block is None:
            continue
        sink = sinks[i] if i < len(sinks) else None
        if sink is None:
            elsewhere.append(i)
            continue
        if _payload_len(block) != len(sink):
            # As before: a damaged block is a miss whatever its size; a sound one the wrong size for
            # its destination is the caller's error (raised before anything is copied).
            _checked_copy(block, keys[i], destinations[i], on_corrupt)  # raises ValueError unless damaged
            continue
        jobs.append((block, keys[i], sink))
        at.append(i)
    for i, why in zip(at, land(jobs), strict=True):
        if why is None:
            found[i] = True
            continue
        log.error("block %s failed verification as it landed, treating as a miss: %s", keys[i].hex(), why)
        on_corrupt()
    for i in elsewhere:
        found[i] = _checked_copy(blocks[i], keys[i], destinations[i], on_corrupt)  # type: ignore[arg-type]
    return found


def _checked_copy(block: memoryview, key: bytes, destination: object, on_corrupt: Callable[[], None]) -> bool:
    """The block verified where it lies, then its payload copied into `destination`; False (counted)
    for a block that fails. Raises as copy_payload_into."""
    (checked,) = verified([(block, "ram")], [key], on_corrupt)
    if checked is None:
        return False
    copy_payload_into(checked, destination)
    return True


def _payload_len(block: memoryview) -> int:
    """The payload length its header gives; -1 for a header that cannot be read (land() says why)."""
    try:
        return parse_header(block).payload_len
    except BlockFormatError:
        return -1


def payload_sinks(destinations: Sequence[object]) -> list[memoryview | None]:
    """Each destination as a writable byte view a payload can be received into (a contiguous CPU
    tensor, a writable contiguous buffer), or None (a GPU tensor, anything else: copied as before)."""
    sinks: list[memoryview | None] = []
    for destination in destinations:
        view: memoryview | None = None
        try:
            if type(destination).__module__.partition(".")[0] == "torch":  # torch only when given a tensor
                import torch

                t: Any = destination
                if t.device.type == "cpu" and t.is_contiguous():
                    view = memoryview(t.detach().view(-1).view(torch.uint8).numpy())
            else:
                view = memoryview(destination).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            view = None
        sinks.append(None if view is None or view.readonly else view)
    return sinks


def block_bytes(blocks: Sequence[memoryview | None]) -> int:
    return sum(len(b) for b in blocks if b is not None)


def copied(blocks: Sequence[memoryview | None], found: list[bool] | None = None) -> list[bool]:
    """get_into's answer once the copies out of leased() ended: `found` (else True where a block
    was found), all False when the copies outlived the leases (LeasedBlocks.expired: they are then
    not trusted)."""
    if found is None:
        found = [block is not None for block in blocks]
    if isinstance(blocks, LeasedBlocks) and blocks.expired():
        log.warning("get_into outlived its arena leases; %d blocks treated as misses", sum(found))
        return [False] * len(found)
    return found
