"""What people type and the files they point at: keys in hex, token ids, sizes.

Every problem is a CliError with exit code USAGE, raised before any request is sent.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from kvcache_core.keys import KEY_BYTES

OK = 0
MISS = 1
USAGE = 2
UNREACHABLE = 3
REJECTED = 4
NOT_SERVING = 5


class CliError(Exception):
    """An expected failure: printed as one line on stderr, then the process exits with `code`."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code


_SEPARATORS = re.compile(r"[\s,]+")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_key(text: str) -> bytes:
    """A chunk key written as 32 hex digits."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise CliError(f"{text!r} is not a key: expected {2 * KEY_BYTES} hex digits") from None
    if len(key) != KEY_BYTES:
        raise CliError(f"{text!r} is not a key: expected {2 * KEY_BYTES} hex digits, got {2 * len(key)}")
    return key


def parse_size(text: str) -> int:
    """'16MiB' -> 16777216; plain integers are bytes."""
    m = _SIZE.match(text)
    if not m:
        raise CliError(f"{text!r} is not a size (e.g. 4096, 256KiB, 16MiB)")
    number, unit = m.groups()
    return int(float(number) * _UNITS[(unit or "b").lower()])


def read_bytes(path: str) -> bytes:
    """A file's bytes; "-" reads stdin."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


def _items(path: str) -> list[str]:
    """A JSON list, or whitespace- or comma-separated words, as strings."""
    data = read_bytes(path)
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CliError(f"{path} is not UTF-8 text") from None
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path} is not a valid JSON list: {exc}") from None
        if not isinstance(values, list):
            raise CliError(f"{path} must hold one JSON list")
        return [v if isinstance(v, str) else json.dumps(v) for v in values]
    return [word for word in _SEPARATORS.split(text) if word]


def read_tokens(path: str) -> list[int]:
    """Token ids from a JSON list or whitespace/comma-separated integers; "-" reads stdin."""
    tokens: list[int] = []
    for i, word in enumerate(_items(path)):
        if not word.isascii() or not word.isdigit():
            raise CliError(f"{path}: token {i} ({word!r}) is not a non-negative integer")
        value = int(word)
        if value >= 1 << 32:
            raise CliError(f"{path}: token {i} ({value}) is not below 2**32")
        tokens.append(value)
    return tokens


def read_keys(path: str) -> list[bytes]:
    """Hex keys from a JSON list of strings or whitespace/comma-separated words; "-" reads stdin."""
    keys = []
    for i, word in enumerate(_items(path)):
        try:
            keys.append(parse_key(word))
        except CliError as exc:
            raise CliError(f"{path}: key {i}: {exc}") from None
    return keys
