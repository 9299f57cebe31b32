"""OpenAI-style errors: the body every refusal of the router has, and the middleware that makes sure of it.

{"error": {"message": "...", "type": "invalid_request_error" | "server_error", "param": ..., "code": "..."}}
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from kvcache_router.metrics import RequestReport

log = logging.getLogger(__name__)


class RouterError(Exception):
    """A request the router answers itself with an OpenAI-style error."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self, report: RequestReport | None = None) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=report.headers() if report else None)


class UpstreamAnswer(Exception):
    """A worker's 4xx answer to pass to the client unchanged: the request is at fault, not the worker."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


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
        log.exception("%s %s failed", request.method, request.path)
        return RouterError(
            500, "the router failed on this request (its log has the details)", code="internal_error"
        ).response()
