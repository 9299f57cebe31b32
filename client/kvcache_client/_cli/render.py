"""Text for people: sizes, durations and the tables `kvcache stats` and `kvcache lookup` print."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache_client.results import ServerStats, TierInfo

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; below 1 KiB, exact bytes."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _BINARY_UNITS:
        value /= 1024
        if value < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """3723.4 -> '1h 02m 03s'; 93784 -> '1d 2h 03m 04s'."""
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m {secs:02d}s"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{seconds:.1f}s"


def hit_ratio(tier: TierInfo) -> float | None:
    """hits / (hits + misses), or None before the first read."""
    reads = tier.hits + tier.misses
    return tier.hits / reads if reads else None


def _usage(t: TierInfo) -> str:
    if not t.capacity_bytes:
        return human_bytes(t.used_bytes) if t.used_bytes else "-"
    share = 100 * t.used_bytes / t.capacity_bytes
    return f"{human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)} ({share:.1f}%)"


def _ratio(t: TierInfo) -> str:
    ratio = hit_ratio(t)
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


_ROWS: list[tuple[str, Callable[[TierInfo], str]]] = [
    ("blocks", lambda t: f"{t.blocks:,}"),
    ("used / capacity", _usage),
    ("hits", lambda t: f"{t.hits:,}"),
    ("misses", lambda t: f"{t.misses:,}"),
    ("hit ratio", _ratio),
    ("puts", lambda t: f"{t.puts:,}"),
    ("evictions", lambda t: f"{t.evictions:,}"),
    ("retained", lambda t: f"{t.retained_blocks:,} ({human_bytes(t.retained_bytes)})"),
    # The disk's retention (RAM's refused and expired are the server-wide line above the table).
    (
        "retained refused / copied / dropped",
        lambda t: f"{t.retention_refused:,} / {t.retention_copied:,} / {t.retention_dropped:,}",
    ),
    ("rejected", lambda t: f"{t.rejected:,}"),
    ("promotions", lambda t: f"{t.promotions:,}"),
    ("demotions", lambda t: f"{t.demotions:,}"),
    ("queue depth", lambda t: f"{t.queue_depth:,} ({human_bytes(t.queue_bytes)})"),
    ("queue dropped", lambda t: f"{t.queue_dropped:,}"),
    ("errors", lambda t: f"{t.errors:,}"),
    ("write errors", lambda t: f"{t.write_errors:,}"),
    ("skipped", lambda t: f"{t.skipped:,}"),
    ("checksum failures", lambda t: f"{t.checksum_failures:,}"),
    ("breaker", lambda t: t.breaker),
    ("healthy", lambda t: "yes" if t.healthy else "NO"),
    ("bytes read", lambda t: human_bytes(t.bytes_read)),
    ("bytes written", lambda t: human_bytes(t.bytes_written)),
]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def stats_text(stats: ServerStats, target: str) -> str:
    """The server's counters: a summary, then one column per tier (fastest first)."""
    summary = [
        f"kvcache-server {stats.version} at {target}, up {human_duration(stats.uptime_s)}",
        f"limits: max block {human_bytes(stats.max_block_bytes)}, {stats.max_keys_per_request:,} keys per request",
        f"failed requests: {stats.failed_requests:,}; blocks refused on put (checksum): "
        f"{stats.put_checksum_failures:,}",
        f"retention: {stats.retention_refused:,} refused (share full), {stats.retention_expired:,} expired; "
        f"prefetch: {stats.prefetch_queued:,} queued, {stats.prefetch_promoted:,} promoted, "
        f"{stats.prefetch_dropped:,} dropped, {stats.prefetch_failed:,} failed",
        "",
    ]
    header = ["tier", *(t.name for t in stats.tiers)]
    rows = [[label, *(cell(t) for t in stats.tiers)] for label, cell in _ROWS]
    return "\n".join(summary) + table(header, rows)


def runs(tiers: Sequence[str]) -> list[tuple[int, int, str]]:
    """Consecutive chunks held by the same tier: [(first, last, tier), ...]."""
    out: list[tuple[int, int, str]] = []
    for i, tier in enumerate(tiers):
        if out and out[-1][2] == tier:
            out[-1] = (out[-1][0], i, tier)
        else:
            out.append((i, i, tier))
    return out


def lookup_text(
    namespace: str,
    num_keys: int,
    prefix_length: int,
    tiers: Sequence[str],
    *,
    num_tokens: int | None = None,
    chunk_tokens: int | None = None,
) -> str:
    """What `kvcache lookup` prints: the namespace, the chunks, the stored prefix and where it lives."""
    lines = [f"namespace      {namespace}"]
    if num_tokens is None or chunk_tokens is None:
        lines.append(f"keys           {num_keys}")
        lines.append(f"stored prefix  {prefix_length} of {num_keys} keys")
    else:
        tail = num_tokens % chunk_tokens
        shape = f"{chunk_tokens} per chunk" + (f", last chunk {tail}" if tail else "")
        lines.append(f"chunks         {num_keys} ({num_tokens:,} tokens, {shape})")
        stored_tokens = min(prefix_length * chunk_tokens, num_tokens)
        lines.append(f"stored prefix  {prefix_length} chunks, {stored_tokens:,} tokens")
    for first, last, tier in runs(tiers):
        where = f"chunk {first}" if first == last else f"chunks {first}-{last}"
        lines.append(f"  {where:<13}{tier}")
    return "\n".join(lines)
