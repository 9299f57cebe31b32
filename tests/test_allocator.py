"""The server's glibc malloc settings (kvcache_server/allocator.py): with a trim threshold (opt-in),
freed message-sized memory is kept for the next message instead of being handed back and faulted in
again, and the periodic trim still hands it back.

Each case runs in a child interpreter (mallopt changes the whole process) and counts minor page
faults (getrusage), not time: a window of eight 4 MiB buffers, freed and made again, as gRPC's
messages and a Get's replies are.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache_server.allocator import malloc_thresholds
from kvcache_server.config import ServerSection

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_trim are glibc's"),
]

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import json, resource, sys
sys.path.insert(0, {repo!r})
from kvcache_server.allocator import malloc_trim, tune_malloc
tuned = tune_malloc({mmap}, {trim})
PAGE, N, SIZE = 4096, 8, 4 << 20

def window():
    bufs = [bytearray(SIZE) for _ in range(N)]
    for b in bufs:
        b[::PAGE] = b"\\x01" * (SIZE // PAGE)  # every page written, as a message's bytes are
    del bufs

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

window()  # the first window faults in whatever thresholds say
before = faults()
for _ in range(4):
    window()
again = faults() - before
trimmed = malloc_trim()
before = faults()
window()
print(json.dumps({{"tuned": tuned, "again": again, "trimmed": trimmed, "after_trim": faults() - before}}))
"""


def run_child(mmap_threshold: int, trim_threshold: int) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(repo=str(REPO), mmap=mmap_threshold, trim=trim_threshold)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_a_trim_threshold_keeps_freed_message_memory_for_the_next_messages_and_the_trim_hands_it_back() -> None:
    window_pages = 8 * (4 << 20) // 4096
    keep = 256 << 20  # server.malloc_trim_threshold_bytes, opt-in (default 0: glibc's own thresholds)

    kept = run_child(0, keep)
    assert kept["tuned"] == 1
    # Four windows after the first: nearly nothing faults in again (a few pages of Python's own).
    assert kept["again"] < window_pages // 8, kept
    # malloc_trim (every server.malloc_trim_interval_s) hands the free pages back: the next window
    # faults them in again, so RSS still comes back down between bursts.
    assert kept["trimmed"] == 1 and kept["after_trim"] > window_pages // 2, kept

    # glibc's own thresholds (the setting at 0, the default): every window's memory is handed back at
    # its free and faulted in again.
    alone = run_child(0, 0)
    assert alone["tuned"] == 0
    assert alone["again"] > 4 * window_pages // 2, alone

    # The memory-tight setting: every allocation of 128 KiB or more its own mapping, faulted each time.
    tight = run_child(128 << 10, keep)
    assert tight["tuned"] == 1 and tight["again"] > 4 * window_pages // 2, tight


def test_the_servers_settings_map_to_thresholds_and_no_periodic_trim_keeps_glibcs_own() -> None:
    assert malloc_thresholds(ServerSection()) == (0, 0)  # the default: glibc's own thresholds
    keep = 256 << 20
    assert malloc_thresholds(ServerSection(malloc_trim_threshold_bytes=keep)) == (0, keep)
    # No periodic trim: a fixed trim threshold would keep its bytes for good.
    assert malloc_thresholds(ServerSection(malloc_trim_threshold_bytes=keep, malloc_trim_interval_s=0)) == (0, 0)
    tight = ServerSection(malloc_mmap_threshold_bytes=128 << 10, malloc_trim_threshold_bytes=keep)
    assert malloc_thresholds(tight) == (128 << 10, keep)
