"""The proxy's one error: an OpenAI-style answer (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ProxyError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return JSONResponse(body, self.status)


def upstream_failed(upstream: str, e: BaseException) -> ProxyError:
    return ProxyError(f"upstream {upstream} failed: {type(e).__name__}", 502, "upstream_error")
