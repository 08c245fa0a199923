"""Reading the service's state in tests: one Prometheus sample reader and one wait-for-an-event."""

from __future__ import annotations

import asyncio
import inspect
import re
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


async def until(check: Callable[[], object | Awaitable[object]], timeout_s: float = 10.0, what: str = "") -> None:
    """Until ``check()`` (a function or a coroutine function) is true; fails past ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, f"not reached within {timeout_s} s: {what or check}"
        await asyncio.sleep(0.01)
