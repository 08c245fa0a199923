"""Work units for pytest-xdist (``-n 2 --dist loadgroup``): what a worker must run together so that a
shared server starts once per worker, and nothing more.

- a test that uses any of the ``shared`` session fixtures (servers several modules read; one may
  start another) joins their one group: they start on one worker only;
- a test that uses a module- or class-scoped fixture joins its module's group, one group per
  parameter of such a fixture (a module's fixture is built once, its parameters may go to two
  workers);
- any other test is a unit of its own.

The groups are read from the fixtures each test uses, which only the workers know (they collect; the
controller schedules by test id): each worker writes ``{test id: group}`` to the file the controller
named in ``$VISENC_XDIST_GROUPS`` before it reports its collection, and ``GroupScheduling`` (xdist's
scheduler by scope) reads it, once every worker has reported. (xdist's own ``xdist_group`` marks
rename the test ids, which pytest 9 no longer lets it do.)

``ordered`` puts the shared fixtures' groups first (the longest chains), the module groups next and
the single tests last, each in collection order: the two workers end close together. Without xdist
nothing is written and the order still keeps every fixture's tests together.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

ENV = "VISENC_XDIST_GROUPS"
SHARED_GROUP = "shared"
_WIDER = ("module", "package", "class")


def group(item: pytest.Item, shared: Iterable[str]) -> str | None:
    """The work unit ``item`` belongs to (``None``: a unit of its own)."""
    names = getattr(item, "fixturenames", ())
    if any(name in names for name in shared):
        return SHARED_GROUP
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    wider = sorted(n for n in names if n in defs and defs[n][-1].scope in _WIDER)
    if not wider:
        return None
    callspec = getattr(item, "callspec", None)
    params = [f"{n}={callspec.indices[n]}" for n in wider if callspec is not None and n in callspec.indices]
    return item.path.name + (f"[{','.join(params)}]" if params else "")


def ordered(items: list[pytest.Item], folder: Path, shared: Iterable[str]) -> None:
    """``items`` reordered in place: under ``folder``, shared groups, then module groups, then the rest."""
    shared = tuple(shared)

    def rank(item: pytest.Item) -> int:
        if folder not in item.path.parents:
            return 0
        name = group(item, shared)
        return 0 if name == SHARED_GROUP else 1 if name is not None else 2

    items[:] = sorted(items, key=rank)  # stable: each group keeps its order


def slow_setup(items: list[pytest.Item], folder: Path, shared: Iterable[str], timeout_s: float) -> None:
    """A ``timeout`` of ``timeout_s`` for each grouped test under ``folder`` that sets none: the first
    test of a group starts its servers (each given minutes to answer) in its setup."""
    shared = tuple(shared)
    for item in items:
        if folder in item.path.parents and item.get_closest_marker("timeout") is None:
            if group(item, shared) is not None:
                item.add_marker(pytest.mark.timeout(timeout_s))


def name_the_file(config: pytest.Config) -> None:
    """In the controller of an xdist run: the file the workers will write (inherited by them)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[ENV] = path


def write(config: pytest.Config, items: list[pytest.Item], folder: Path, shared: Iterable[str]) -> None:
    """In a worker: each grouped test's id and group under ``folder``, to the controller's file."""
    path = os.environ.get(ENV)
    if path is None or not hasattr(config, "workerinput"):
        return
    shared = tuple(shared)
    groups = {i.nodeid: g for i in items if folder in i.path.parents and (g := group(i, shared)) is not None}
    fd, part = tempfile.mkstemp(dir=Path(path).parent, prefix="xdist-groups-part-")
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    os.replace(part, path)  # every worker writes the same table: whichever lands last is whole


def scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler by scope, with each test's scope its group (or the test itself)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                path = os.environ.get(ENV)
                text = Path(path).read_text() if path else ""
                self._groups = json.loads(text) if text else {}
            return self._groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def forget_the_file(config: pytest.Config) -> None:
    """In the controller, at the end: the file is removed."""
    path = os.environ.get(ENV)
    if path is not None and not hasattr(config, "workerinput"):
        Path(path).unlink(missing_ok=True)
