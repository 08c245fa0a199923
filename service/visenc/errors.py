"""One error hierarchy for the whole service, mapped to HTTP status in one place.

    VisencError                 500  base; ``kind`` labels the failure counter
    ├── BadRequest              400  malformed body, bad hash, bad range
    │   ├── InvalidImage        400  corrupt or unsupported image bytes
    │   └── HashMismatch        400  uploaded bytes do not hash to the given hash
    ├── Unauthorized            401  missing or unknown API key
    ├── NotFound                404  no such embedding (never encoded, or evicted)
    │   └── TransportDisabled   404  an optional transport (shared memory) is switched off
    ├── PayloadTooLarge         413  body, item count, image bytes or pixels over a limit
    ├── UnsupportedMediaType    415  content type we do not speak
    ├── Overloaded              429  admission queue full (``retry_after_s``)
    ├── ClientClosed            499  the client went away before the answer (nothing is sent)
    ├── EncodeFailed            500  the forward raised; only that batch's images fail
    ├── NotReady                503  model not loaded, worker stalled, shutting down
    └── DeadlineExceeded        504  the result was not ready within the deadline

Messages are written for the caller: they say which limit was hit and its value.
A 500 never echoes internals (the handler logs them and answers a generic text).
"""

from __future__ import annotations


class VisencError(Exception):
    status_code = 500
    kind = "internal"
    #: whether the message may be shown to the caller
    public = False

    def __init__(self, message: str = "internal error", **headers: str) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers


class BadRequest(VisencError):
    status_code = 400
    kind = "bad_request"
    public = True


class InvalidImage(BadRequest):
    kind = "invalid_image"


class HashMismatch(BadRequest):
    kind = "hash_mismatch"


class Unauthorized(VisencError):
    status_code = 401
    kind = "unauthorized"
    public = True


class NotFound(VisencError):
    status_code = 404
    kind = "not_found"
    public = True


class TransportDisabled(NotFound):
    kind = "transport_disabled"


class PayloadTooLarge(VisencError):
    status_code = 413
    kind = "too_large"
    public = True


class UnsupportedMediaType(VisencError):
    status_code = 415
    kind = "unsupported_media_type"
    public = True


class Overloaded(VisencError):
    status_code = 429
    kind = "overloaded"
    public = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, **{"Retry-After": str(max(1, round(retry_after_s)))})


class ClientClosed(VisencError):
    """The client closed its connection while its request waited; its queued work is dropped."""

    status_code = 499
    kind = "client_closed"
    public = True


class EncodeFailed(VisencError):
    status_code = 500
    kind = "encode_failed"
    public = True


class NotReady(VisencError):
    status_code = 503
    kind = "not_ready"
    public = True


class DeadlineExceeded(VisencError):
    status_code = 504
    kind = "deadline"
    public = True
