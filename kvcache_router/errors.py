"""OpenAI-style errors: the body every refusal of the router has, and the middleware that makes sure of it.

{"error": {"message": "...", "type": "invalid_request_error" | "server_error", "param": ..., "code": "..."}}

A worker's error answer is never relayed as it came (a 500's body may be a traceback naming the
worker's files and state): `worker_error` keeps its status and rebuilds the body. A 4xx that is a
well-formed OpenAI error (OpenAI's {"error": {...}} or vLLM's flat {"object": "error", ...}) keeps
its message, type, param and code, since they tell the client what it got wrong; anything else, and
every 5xx, gets a message of the router's own.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from kvcache_router.metrics import RequestReport

log = logging.getLogger(__name__)

_MAX_WORKER_MESSAGE_CHARS = 2000


class RouterError(Exception):
    """A request the router answers itself with an OpenAI-style error.

    Args:
        status: The HTTP status.
        message: The error's message, for the client.
        code: The error's code (a string of the router's; a worker's may be an int, as vLLM's are).
        param: The request field at fault, if one is.
        kind: The error's type; by default invalid_request_error for 4xx, server_error for 5xx.
        close: Close the connection after the answer (the request's body was not read whole).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | int | None,
        param: str | None = None,
        kind: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.close = status, code, param, close
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    @property
    def reason(self) -> str:
        """What the request's log line and report say went wrong."""
        return str(self.code)

    def response(self, report: RequestReport | None = None) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        response = web.json_response(body, status=self.status, headers=report.headers() if report else None)
        if self.close:
            response.force_close()
        return response


class WorkerError(RouterError):
    """A worker's error answer, rebuilt by `worker_error`."""

    @property
    def reason(self) -> str:
        return "upstream_rejected" if self.status < 500 else "upstream_error"


def worker_error(role: str, status: int, data: bytes) -> WorkerError:
    """The answer the client gets for a worker's error answer (status >= 400, body `data`)."""
    if status < 500 and (fields := _openai_error(data)) is not None:
        message, kind, param, code = fields
        return WorkerError(status, message, code=code, param=param, kind=kind)
    verb = "refused the request" if status < 500 else "failed"
    return WorkerError(status, f"the {role} worker {verb} (HTTP {status})", code="upstream_error")


def _openai_error(data: bytes) -> tuple[str, str | None, str | None, str | int | None] | None:
    """(message, type, param, code) of a well-formed OpenAI or vLLM error body; None for anything else."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    error: Any = body.get("error") if "error" in body else (body if body.get("object") == "error" else None)
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    kind, param, code = error.get("type"), error.get("param"), error.get("code")
    return (
        error["message"][:_MAX_WORKER_MESSAGE_CHARS],
        kind if isinstance(kind, str) else None,
        param if isinstance(param, str) else None,
        code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths, wrong methods and bugs answered as OpenAI errors too (a bug with its traceback logged)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "invalid_request")
        return RouterError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=code).response()
    except Exception:
        log.exception("%s %r failed", request.method, request.path)  # %r: the path is the client's, decoded
        return RouterError(
            500, "the router failed on this request (its log has the details)", code="internal_error"
        ).response()
