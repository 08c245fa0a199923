"""One error hierarchy for the whole service, mapped to HTTP status in one place."""

from __future__ import annotations

from visenc_client.format import Reason


class VisencError(Exception):
    status_code = 500
    kind = "internal"
    #: whether the message may be shown to the caller
    public = False
    #: the per-item reason code (``visenc_client.format.Reason``) when the error is about one image
    item_reason: Reason | None = None

    def __init__(self, message: str = "internal error", **headers: str) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers


class BadRequest(VisencError):
    status_code = 400
    kind = "bad_request"
    public = True


class InvalidHash(BadRequest):
    kind = "invalid_hash"
    item_reason: Reason | None = "invalid_hash"


class InvalidImage(BadRequest):
    kind = "invalid_image"
    item_reason: Reason | None = "invalid_image"


class InvalidVideo(BadRequest):
    kind = "invalid_video"
    item_reason: Reason | None = "invalid_video"


class HashMismatch(BadRequest):
    kind = "hash_mismatch"
    item_reason: Reason | None = "hash_mismatch"


class InvalidBody(BadRequest):
    status_code = 422
    kind = "invalid_body"


class InvalidParams(InvalidBody):
    """Query or path parameters FastAPI refused."""

    kind = "invalid_params"


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


class ImageTooLarge(PayloadTooLarge):
    kind = "image_too_large"
    item_reason: Reason | None = "image_too_large"


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


class Cancelled(VisencError):
    """Every request waiting for an image went away before its forward: the image was dropped."""

    status_code = 499
    kind = "cancelled"
    public = True


class ClientClosed(VisencError):
    """The client closed its connection while its request waited; its queued work is dropped."""

    status_code = 499
    kind = "client_closed"
    public = True


class EncodeFailed(VisencError):
    status_code = 500
    kind = "encode_failed"
    public = True
    item_reason: Reason | None = "encode_failed"


class OutOfMemory(EncodeFailed):
    kind = "out_of_memory"
    item_reason: Reason | None = "out_of_memory"


class NotReady(VisencError):
    status_code = 503
    kind = "not_ready"
    public = True

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message, **{"Retry-After": str(max(1, round(retry_after_s)))})


class DeadlineExceeded(VisencError):
    status_code = 504
    kind = "deadline"
    public = True


class ModelUnavailable(ValueError):
    """The model named at start-up cannot be served: an unknown name or repository, a gated or
    private repository without a token, the hub unreachable with nothing cached, a model type
    visenc does not serve, no vision weights. The message is one line that states the cause
    (the caller names the model)."""


def all_kinds() -> list[str]:
    """Every ``kind`` of the hierarchy (pre-initialises the error counters)."""
    kinds, todo = [], [VisencError]
    while todo:
        cls = todo.pop()
        kinds.append(cls.kind)
        todo.extend(cls.__subclasses__())
    return sorted(set(kinds))
