"""A hub whose host name does not resolve ends the start at once, in one line (exit 4), unless the cache
holds the model; a hub that refuses the connection, times out or says "try later" is still waited out
(429 and 5xx: tests/unit/test_hub_retry.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.paths import ROOT
from tests.support.hub import LoopbackHub, point_hub_at
from tests.support.hub_checkpoints import hub_layout

from visenc import preflight
from visenc.errors import ModelUnavailable
from visenc.models import hub_errors
from visenc.models.hub_errors import Unreachable, Unresolvable, hub_answers
from visenc.models.loading import load_tower

NOWHERE = "http://no-such-host.invalid"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hub_layout("qwen2_5_vl", tmp_path_factory.mktemp("q") / "q")


@pytest.fixture
def hub(folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LoopbackHub]:
    monkeypatch.setattr(hub_errors, "FIRST_PAUSE_S", 0.05)
    with LoopbackHub() as h:
        h.publish("acme/q", folder)
        point_hub_at(monkeypatch, tmp_path, h.url)
        yield h


def test_serve_with_an_unresolvable_hub_ends_at_once_in_one_line(tmp_path: Path) -> None:
    """``hub_wait_s=300``: were the name taken for a busy hub, the start would wait (and log each try)."""
    env = {
        "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}",
        "PATH": "/usr/bin:/bin",
        "HF_ENDPOINT": NOWHERE,
        "HF_HOME": str(tmp_path / "hf"),
    }
    r = subprocess.run(
        [sys.executable, "-m", "visenc", "serve", "--model", "acme/q", "--hub-wait-s", "300"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == preflight.EXIT_MODEL_UNAVAILABLE, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no-such-host.invalid: its host name does not resolve" in lines[0] and "HF_ENDPOINT" in lines[0]
    assert "asked" not in lines[0]


def test_an_unresolvable_hub_still_serves_what_the_cache_holds(hub: LoopbackHub, monkeypatch) -> None:
    from huggingface_hub import constants

    want = load_tower("acme/q").fingerprint
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", NOWHERE + "/{repo_id}/resolve/{revision}/{filename}")
    assert load_tower("acme/q", hub_wait_s=300).fingerprint == want


def test_a_hub_that_refuses_connections_is_waited_out(hub: LoopbackHub, folder: Path) -> None:
    hub.stop()
    later = threading.Timer(1.0, hub.start)
    later.start()
    try:
        assert load_tower("acme/q", hub_wait_s=60).fingerprint == load_tower(str(folder)).fingerprint
    finally:
        later.join()
    assert hub.served(), "the hub was never asked once it was back"


def test_a_timeout_is_try_later_and_a_name_that_does_not_resolve_is_not() -> None:
    import socket

    import httpx2

    with pytest.raises(Unreachable) as timeout, hub_answers("main"):
        raise httpx2.ReadTimeout("timed out")
    assert type(timeout.value) is Unreachable and timeout.value.waited_out
    with pytest.raises(Unresolvable) as name, hub_answers("main"):
        try:
            raise socket.gaierror(-3, "Temporary failure in name resolution")
        except socket.gaierror as e:
            raise httpx2.ConnectError(str(e)) from e
    assert not name.value.waited_out and "Temporary failure in name resolution" in str(name.value)
    assert isinstance(name.value, ModelUnavailable)
