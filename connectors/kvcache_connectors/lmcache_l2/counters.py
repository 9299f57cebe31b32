"""Counters: what the adapter did, cumulative; report_status() carries a snapshot (LMCache's /status)."""

from __future__ import annotations

import threading


class Counters:
    """What the adapter did, cumulative (report_status carries a snapshot). Thread-safe."""

    NAMES = (
        "stored_chunks",  # chunks stored in kvcache
        "store_failed_tasks",  # store tasks that did not store every chunk
        "lookup_hits",  # keys a lookup found (and locked)
        "lookup_misses",  # keys a lookup did not find, failures included
        "lookup_failures",  # lookup calls that failed or were skipped (their keys missed)
        "locks_not_held",  # hits answered without holding their blocks (max_locked_bytes reached)
        "key_locks",  # hits locked on the key alone (locks="keys"): the load reads them
        "lookups_local",  # lookup groups the presence index answered "none" without a LeaseGet
        "lookups_inline",  # lookups answered from the presence index on LMCache's thread
        "leases_lost",  # hits of early lookups whose lease found the block gone (the load reads them again)
        "loaded_chunks",  # chunks copied into LMCache's buffers
        "load_missing_chunks",  # chunks a load did not copy (gone, failed, wrong size)
        "load_failed_tasks",  # load tasks that did not load every chunk
        "corrupt_chunks",  # chunks whose copy failed its key-bound checksum (a miss)
        "unlocks",  # locks dropped by submit_unlock
        "releases_failed",  # lease releases that failed (the server expires them)
        "deleted_chunks",  # chunks a delete removed from this adapter's accounting
        "delete_failures",  # delete calls that failed or were refused (queue full)
        "refused_tasks",  # tasks completed at once: lane queue full, or the adapter closed
        "breaker_skips",  # calls not attempted while the breaker was open
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, value: int = 1) -> None:
        if value:
            with self._lock:
                self._values[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
