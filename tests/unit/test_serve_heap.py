"""``visenc serve`` freezes the heap it starts with before it answers anything: a full collection then walks
only what requests made, not the hundreds of thousands of objects torch and the tower bring, which it walks
with the GIL held (``bench/bench_gc.py`` measures both)."""

from __future__ import annotations

import gc
import signal
import socket
from typing import Any

import pytest
import uvicorn

from visenc import cli
from visenc.config import Settings


def test_the_starting_heap_is_frozen_before_the_server_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}

    def run(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        seen["frozen"], seen["collectable"] = gc.get_freeze_count(), len(gc.get_objects())
        for sock in sockets or []:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    handler: Any = signal.getsignal(signal.SIGTERM)
    gc.unfreeze()
    try:
        assert cli.serve(Settings(port=0)) == 0
    finally:
        gc.unfreeze()  # the rest of this process's tests collect as usual
        signal.signal(signal.SIGTERM, handler)
    assert seen["frozen"] > 10 * seen["collectable"], seen
