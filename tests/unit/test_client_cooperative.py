"""A process whose sockets gevent made cooperative (Locust's, ``loadtest/prefill_soak.py``): the client's
connections are gevent's sockets with their own timeouts, never ones that block in the kernel. A read lets
the process's other greenlets run (here, the server it reads from), and a stalled read still times out.
Each case in a child process, gevent patched in before or after the client's import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness.paths import ROOT
from tests.support.dead_ends import Peer

pytest.importorskip("gevent", reason="gevent comes with Locust (the load tests)")

PATCH = "from gevent import monkey; monkey.patch_all()\n"
CHILD = """
import socket, sys
import gevent
from visenc_client import Client, TransportError
HEAD = b"HTTP/1.1 200 OK\\r\\ncontent-length: 48\\r\\nx-visenc-shape: 3,4\\r\\nx-visenc-dtype: float32\\r\\n\\r\\n"
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(8)
def serve():
    conn, _ = listener.accept()
    conn.recv(1 << 16)
    gevent.sleep(0.05)
    conn.sendall(HEAD + bytes(48))
gevent.spawn(serve)
with Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1.0) as vc:
    print("read" if vc.fetch("a" * 64).shape == (3, 4) else "misread")
with Client(sys.argv[1], timeout=0.5) as vc:
    try:
        vc.fetch("a" * 64)
    except TransportError as e:
        print("timed-out" if e.timed_out else f"not-a-timeout: {e}")
"""


@pytest.mark.parametrize("order", ["patched first", "imported first"])
def test_a_read_lets_greenlets_run_and_a_stalled_one_times_out(order: str) -> None:
    code = PATCH + CHILD if order == "patched first" else "import visenc_client\n" + PATCH + CHILD
    with Peer("stall") as peer:  # the head and a few bytes, then nothing
        out = subprocess.run(
            [sys.executable, "-c", code, peer.url], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
    assert out.stdout.split() == ["read", "timed-out"], out.stdout + out.stderr[-2000:]
