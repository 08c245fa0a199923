"""The client's exceptions::

VisencClientError
├── TransportError        the service could not be reached or stopped answering (``url``)
├── ProtocolError         the service answered something this client cannot read
├── ImageEncodeError      the service could not decode or encode one image (``hash``, ``message``)
└── APIError              the service answered an error (``status_code``, ``kind``, ``message``)
    ├── BadRequestError   400 / 413 / 415 / 422: fix the request, do not retry
    ├── NotFoundError     404: unknown image (upload its bytes again)
    ├── OverloadedError   429: retry after ``retry_after_s``
    └── ServerError       5xx
        ├── UnavailableError 503: not ready (loading, shutting down, worker down); retry after ``retry_after_s``
        └── DeadlineError 504: not ready in time; retrying may succeed
"""

from __future__ import annotations


class VisencClientError(Exception):
    pass


class TransportError(VisencClientError):
    """``url``: what was asked; ``connecting``: it failed before the server took the request."""

    def __init__(self, message: str, url: str | None = None, *, connecting: bool = False) -> None:
        super().__init__(f"{url}: {message}" if url else message)
        self.url = url
        self.reason = message
        self.connecting = connecting

    @property
    def timed_out(self) -> bool:
        import httpx
        import redis

        return isinstance(self.__cause__, TimeoutError | httpx.TimeoutException | redis.TimeoutError)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class ProtocolError(VisencClientError):
    pass


class ImageEncodeError(VisencClientError):
    """An ``error`` handle: this image cannot be encoded; ``reason``: the service's stable code. Do not retry."""

    def __init__(self, image_hash: str, message: str, reason: str | None = None) -> None:
        super().__init__(f"image {image_hash}: {message}" + (f" ({reason})" if reason else ""))
        self.hash = image_hash
        self.message = message
        self.reason = reason


class APIError(VisencClientError):
    def __init__(self, status_code: int, kind: str, message: str) -> None:
        super().__init__(f"{status_code} {kind}: {message}")
        self.status_code = status_code
        self.kind = kind
        self.message = message


class BadRequestError(APIError):
    pass


class NotFoundError(APIError):
    pass


class OverloadedError(APIError):
    def __init__(self, status_code: int, kind: str, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(status_code, kind, message)
        self.retry_after_s = retry_after_s


class ServerError(APIError):
    pass


class UnavailableError(ServerError):
    def __init__(self, status_code: int, kind: str, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(status_code, kind, message)
        self.retry_after_s = retry_after_s


class DeadlineError(ServerError):
    pass


def _seconds(retry_after: str | None) -> float:
    """``Retry-After`` in seconds (1 where absent or not a number of seconds, e.g. an HTTP date)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else 1.0
    except ValueError:
        return 1.0


def error_for(status_code: int, kind: str, message: str, retry_after: str | None = None) -> APIError:
    if status_code == 404:
        return NotFoundError(status_code, kind, message)
    if status_code == 429:
        return OverloadedError(status_code, kind, message, _seconds(retry_after))
    if status_code == 503:
        return UnavailableError(status_code, kind, message, _seconds(retry_after))
    if status_code == 504:
        return DeadlineError(status_code, kind, message)
    if status_code >= 500:
        return ServerError(status_code, kind, message)
    return BadRequestError(status_code, kind, message)
