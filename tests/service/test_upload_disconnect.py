"""A client that goes away while its body is still arriving is no internal error of the service."""

from __future__ import annotations

from harness.waits import metric
from tests.support.api import running_app


async def test_a_client_gone_mid_upload_is_not_counted_as_an_internal_error(tiny_tower):
    async with running_app(tiny_tower) as client:
        app = client.app  # type: ignore[attr-defined]
        before = metric((await client.get("/metrics")).text, "visenc_errors_total", kind="internal")
        messages = iter([{"type": "http.request", "body": b'{"items": [{"data": "', "more_body": True}])

        async def receive():
            return next(messages, {"type": "http.disconnect"})

        async def send(message):
            return None

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/encode",
            "raw_path": b"/v1/encode",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"visenc"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("visenc", 80),
        }
        await app(scope, receive, send)  # the disconnect does not escape the app either
        after = metric((await client.get("/metrics")).text, "visenc_errors_total", kind="internal")
        assert after == before
        assert metric((await client.get("/metrics")).text, "visenc_errors_total", kind="client_closed") == 1
        assert (await client.get("/health")).status_code == 200
