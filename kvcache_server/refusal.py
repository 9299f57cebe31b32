"""Refused: raised by request helpers (shm segments, blocks in parts) for input a client got wrong.

The helpers stay free of gRPC contexts; the service catches Refused and answers its status and message.
"""

from __future__ import annotations

import grpc


class Refused(Exception):
    """A request that cannot be honoured; `code` is the gRPC status to answer, `message` says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
