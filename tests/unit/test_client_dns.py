"""A name server that does not answer costs the client its connect timeout, on every path: httpx's requests
(``model``), the rows' own connections (``fetch``) and the connector's sources. The resolver here is
``socket.getaddrinfo`` held on one name until the test ends (as a name server that never answers)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from visenc_client import Client, TransportError
from visenc_client._sources import Absent, RowSources, Served, Want

HELD = "visenc.held.test"
#: far above the connect timeout: a call still waiting then waits for the resolver
PATIENCE_S = 20.0


@pytest.fixture
def held_name(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    answer = threading.Event()
    resolve = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == HELD:
            answer.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "the name server did not answer")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        yield answer
    finally:
        answer.set()


def outcome(fn: Callable[[], Any]) -> Any:
    """What ``fn()`` returned or raised, failing the test if it is still waiting after ``PATIENCE_S``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["got"] = fn()
        except Exception as e:
            box["got"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PATIENCE_S)
    assert not thread.is_alive(), "still waiting for the name server"
    return box["got"]


@pytest.mark.parametrize("call", ["model", "fetch"])
def test_a_name_that_does_not_resolve_costs_the_connect_timeout(held_name: threading.Event, call: str) -> None:
    with Client(f"http://{HELD}:8000", connect_timeout=0.2, timeout=PATIENCE_S * 3) as vc:
        got = outcome(vc.model if call == "model" else lambda: vc.fetch("a" * 64))
    assert isinstance(got, TransportError) and got.timed_out and got.connecting, got
    assert not held_name.is_set()  # the name server never answered


def test_the_connectors_sources_go_on_after_the_connect_timeout(held_name: threading.Event) -> None:
    sources = RowSources(
        [f"http://{HELD}:8000"], served=Served(8, "any"), timeout_s=60, connect_timeout_s=0.2, answer_timeout_s=60
    )
    try:
        got = outcome(lambda: sources.obtain({"a" * 64: Want(1, None)}, wait=False))
        assert isinstance(got["a" * 64], Absent) and "not resolved within" in str(got["a" * 64])
        assert sources.backoff.skipped_for(f"http://{HELD}:8000") > 0  # it cost a timeout: backed off
    finally:
        sources.close()
