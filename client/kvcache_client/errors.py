"""The SDK's exceptions: one base class, a shallow tree whose names say whether to retry.

    KVCacheError
    ├── BlockFormatError (also ValueError)    bytes that are not a valid block
    │   ├── UnknownFormatVersion
    │   └── ChecksumMismatch
    └── RPCError                               the server answered with a non-OK status
        ├── InvalidRequest        INVALID_ARGUMENT, OUT_OF_RANGE     do not retry
        ├── DataCorrupted         DATA_LOSS                          do not retry
        ├── ResourceExhausted     RESOURCE_EXHAUSTED                 retry later, maybe
        ├── Unauthenticated       UNAUTHENTICATED                    do not retry
        ├── PermissionDenied      PERMISSION_DENIED                  do not retry
        ├── DeadlineExceeded      DEADLINE_EXCEEDED                  the call's deadline passed
        └── Unavailable           UNAVAILABLE                        retried by the SDK's policy

The first four (and WireError) are the contract's, defined in kvcache_core.errors and re-exported here.
A miss is never an exception: `lookup` returns a length and `get_many` None.
"""

from __future__ import annotations

import grpc

from kvcache_core.errors import BlockFormatError, ChecksumMismatch, KVCacheError, UnknownFormatVersion, WireError

__all__ = [
    "BlockFormatError",
    "ChecksumMismatch",
    "DataCorrupted",
    "DeadlineExceeded",
    "InvalidRequest",
    "KVCacheError",
    "PermissionDenied",
    "RPCError",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "UnknownFormatVersion",
    "WireError",
    "error_for",
    "from_rpc_error",
]


class RPCError(KVCacheError):
    """The server answered with a non-OK gRPC status.

    Attributes:
        code: The gRPC status code.
        details: The server's message.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidRequest(RPCError):
    """The request was malformed; sending it again will fail again."""


class DataCorrupted(RPCError):
    """The server refused a block whose bytes did not match its checksum."""


class ResourceExhausted(RPCError):
    """A size or rate limit of the server was hit."""


class Unauthenticated(RPCError):
    """No valid credentials were presented."""


class PermissionDenied(RPCError):
    """The credentials lack the right for this call."""


class DeadlineExceeded(RPCError):
    """The call did not finish before its deadline."""


class Unavailable(RPCError):
    """The server could not be reached or is shutting down; retryable."""


_BY_CODE: dict[grpc.StatusCode, type[RPCError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.DATA_LOSS: DataCorrupted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}


def from_rpc_error(exc: grpc.RpcError) -> RPCError:
    """Maps a grpc error (sync or aio) to the SDK's exception type."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    return _BY_CODE.get(code, RPCError)(code, details)


def error_for(code: grpc.StatusCode, details: str) -> RPCError:
    """The SDK's exception for a status that arrived without gRPC (the bulk path's ERROR frames)."""
    return _BY_CODE.get(code, RPCError)(code, details)
