"""Waiting, for the tests, the benches and the load tests alike: for a condition (``until`` in a
coroutine, ``wait_until`` in a thread), for a server to answer (``wait_ready``), and a free loopback
port. Every wait has a deadline and says what it waited for; none sleeps a fixed time and hopes.
Also the one reader of Prometheus samples (``metric``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a Prometheus exposition whose labels include
    ``labels`` (0 if there are none)."""
    total = 0.0
    for m in _SAMPLE.finditer(text):
        if m.group("name") != name:
            continue
        have = dict(_LABEL.findall(m.group("labels") or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group("value"))
    return total


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on loopback ``port``."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def wait_until(check: Callable[[], object], timeout_s: float = 10.0, what: str = "", interval_s: float = 0.01) -> None:
    """Until ``check()`` is true, polled every ``interval_s``; ``TimeoutError`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not reached within {timeout_s} s: {what or check}")
        time.sleep(interval_s)


async def until(
    check: Callable[[], object | Awaitable[object]], timeout_s: float = 10.0, what: str = "", interval_s: float = 0.01
) -> None:
    """Until ``check()`` (a function or a coroutine function) is true, polled every ``interval_s``;
    ``TimeoutError`` past ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError(f"not reached within {timeout_s} s: {what or check}")
        await asyncio.sleep(interval_s)


def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 120.0, path: str = "/readyz"
) -> None:
    """Until ``GET url + path`` answers 200; ``RuntimeError`` at once if ``proc`` exits first."""
    import httpx

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it answered")
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(url + path, timeout=2.0).status_code == 200
        return False

    wait_until(answers, timeout_s, f"{url}{path} answers 200", interval_s=0.2)
