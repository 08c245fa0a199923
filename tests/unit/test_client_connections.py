"""The client's rows connections (``visenc_client._http``) survive a server that drops kept-alive
connections: the request goes again on a fresh connection, never failing the caller."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from visenc_client import Client

ROWS = np.arange(12, dtype=np.float32).reshape(3, 4)


class OneRequestPerConnection(http.server.BaseHTTPRequestHandler):
    """Answers one GET of rows, then closes the connection without saying so (a keep-alive timeout)."""

    protocol_version = "HTTP/1.1"
    served: list[int] = []

    def do_GET(self) -> None:
        body = ROWS.tobytes()
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-visenc-shape", "3,4")
        self.send_header("x-visenc-dtype", "float32")
        self.end_headers()
        self.wfile.write(body)
        self.served.append(1)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dropping_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OneRequestPerConnection)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_dropped_keep_alive_connection_is_replaced(dropping_server: str) -> None:
    OneRequestPerConnection.served.clear()
    with Client(dropping_server) as vc:
        for _ in range(4):  # each fetch after the first meets a connection the server closed
            np.testing.assert_array_equal(vc.fetch("a" * 64), ROWS)
    assert len(OneRequestPerConnection.served) == 4
