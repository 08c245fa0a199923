"""Work units for pytest-xdist's ``--dist loadgroup``: what a worker must run together so that a shared
server starts once per worker, and nothing more.

- a test that uses one of the ``shared`` session fixtures (a server several modules read) joins that
  fixture's group: the server starts on one worker only;
- a test that uses a module- or class-scoped fixture joins its module's group, one group per
  parameter of such a fixture (a module's fixture is built once, its parameters may go to two
  workers);
- any other test is a unit of its own.

``ordered`` puts the shared fixtures' groups first (the longest chains), the module groups next and
the single tests last, each kept in collection order: the two workers end close together. Without
xdist the marks do nothing and the order still keeps every fixture's tests together.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

_WIDER = ("module", "package", "class")


def group(item: pytest.Item, shared: Iterable[str]) -> str | None:
    """The work unit ``item`` belongs to (``None``: a unit of its own)."""
    names = getattr(item, "fixturenames", ())
    for name in shared:
        if name in names:
            return name
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    wider = sorted(n for n in names if n in defs and defs[n][-1].scope in _WIDER)
    if not wider:
        return None
    callspec = getattr(item, "callspec", None)
    params = [f"{n}={callspec.indices[n]}" for n in wider if callspec is not None and n in callspec.indices]
    return item.path.name + (f"[{','.join(params)}]" if params else "")


def mark(items: list[pytest.Item], folder: Path, shared: Iterable[str]) -> None:
    """An ``xdist_group`` mark on each test under ``folder`` that belongs to a group."""
    for item in items:
        if folder in item.path.parents:
            name = group(item, tuple(shared))
            if name is not None:
                item.add_marker(pytest.mark.xdist_group(name))


def ordered(items: list[pytest.Item], folder: Path, shared: Iterable[str]) -> None:
    """``items`` reordered in place: under ``folder``, shared groups, then module groups, then the rest."""
    shared = tuple(shared)

    def rank(item: pytest.Item) -> int:
        if folder not in item.path.parents:
            return 0
        name = group(item, shared)
        return 0 if name in shared else 1 if name is not None else 2

    items[:] = sorted(items, key=rank)  # stable: each group keeps its order
