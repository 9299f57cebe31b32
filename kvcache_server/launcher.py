"""Run a server in a child process and learn its address from the first line it prints.

For examples, benchmarks and tests that need a real kvcache server (or another
server that announces itself the same way) next to them:

    with LocalKVCacheServer("--ram-capacity", "4GiB") as server:
        client = KVCacheClient(server.target)

The child's stdout is read for the start-up line, then drained by a thread so
the child never blocks on a full pipe; its stderr goes to a temporary file that
start-up errors quote. `stop()` sends SIGTERM (the server drains and exits) and
kills the child if it does not exit in time.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import TracebackType

SERVING = re.compile(r" serving \S+ on (\S+):(\d+)(?: |;|$)")
"""kvcache-server's start-up line: "kvcache-server 0.1.0 serving kvcache.v1.KVCache on HOST:PORT (...)"."""


class ServerStartError(RuntimeError):
    """The child exited or printed no matching start-up line in time; the message ends with its stderr."""


class ChildServer:
    """A server process whose first stdout line says where it serves."""

    def __init__(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.first_line = ""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child; closed in stop()

    def launch(self, pattern: re.Pattern[str] | str | None, timeout_s: float = 30.0) -> re.Match[str] | None:
        """Starts the child; with `pattern`, waits for its first stdout line and returns the match in it."""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        try:
            if pattern is None:
                self._drain()
                return None
            self.first_line = self._read_line(timeout_s)
            match = re.search(pattern, self.first_line)
            if match is None:
                raise ServerStartError(f"{self.name}: unexpected first line {self.first_line!r}{self.stderr_tail()}")
        except BaseException:
            self.stop()
            raise
        self._drain()
        return match

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerStartError(f"{self.name}: no start-up line within {timeout_s:.0f}s{self.stderr_tail()}")
                if not sel.select(remaining):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    code = self.proc.wait()
                    raise ServerStartError(f"{self.name}: exited with {code} before serving{self.stderr_tail()}")
                buf += chunk
        return buf.split(b"\n", 1)[0].decode(errors="replace")

    def _drain(self) -> None:
        stdout = self.proc.stdout if self.proc else None
        if stdout is None:
            return

        def run() -> None:
            try:
                while os.read(stdout.fileno(), 65536):
                    pass
            except OSError:
                pass

        threading.Thread(target=run, name=f"drain-{self.name}", daemon=True).start()

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            self._stderr.seek(0)
            text = self._stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return f"\n--- {self.name} stderr ---\n{text[-n:]}" if text.strip() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit status. Safe to call twice."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
        self._stderr.close()
        return proc.returncode

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class LocalKVCacheServer(ChildServer):
    """`python -m kvcache_server --port 0 ARGS...` in a child process; a context manager that starts it."""

    def __init__(self, *args: str, start_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        super().__init__("kvcache-server", [sys.executable, "-m", "kvcache_server", "--port", "0", *args], env=env)
        self.start_timeout_s = start_timeout_s
        self.target = ""

    def start(self) -> str:
        """Starts the server and returns its address, "host:port", once it takes calls."""
        match = self.launch(SERVING, self.start_timeout_s)
        assert match is not None
        self.target = f"{match.group(1)}:{match.group(2)}"
        return self.target

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def __enter__(self) -> LocalKVCacheServer:
        self.start()
        return self
