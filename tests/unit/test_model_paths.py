"""A model named by a path that is not there is refused in one line, and the hub is never asked about it;
a hub id (one ``/`` at most, before any ``@REVISION``) still goes to the hub."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness.paths import ROOT
from tests.support.hub import LoopbackHub, point_hub_at
from tests.support.hub_checkpoints import hub_layout

from visenc import preflight
from visenc.errors import ModelUnavailable
from visenc.models.hub import looks_like_path
from visenc.models.loading import open_checkpoint

PATHS = ["./acme/served", "acme/served/extra", "~/acme/served", "/acme/served", ".acme/served", "a/b/c@main"]


@pytest.mark.parametrize("spec", ["acme/served", "acme/served@main", "acme/served@refs/pr/1", "gpt2", "tiny-clip"])
def test_a_hub_id_or_a_name_is_no_path(spec):
    assert not looks_like_path(spec)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with LoopbackHub() as hub:
        hub.publish("acme/served", hub_layout("qwen2_5_vl", tmp_path / "ckpt"))
        point_hub_at(monkeypatch, tmp_path, hub.url)
        hub.reset()
        yield hub


@pytest.mark.parametrize("spec", PATHS)
def test_a_missing_path_is_refused_without_asking_the_hub(spec, hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ./acme/served is not there (the hub has acme/served)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(preflight.StartError, match="no such folder") as e:
        preflight.check_model(spec)
    assert str(e.value) == f"cannot serve {spec}: no such folder (a path: not looked up on the hub)"
    with pytest.raises(ModelUnavailable, match="no such folder"):
        open_checkpoint(spec)
    assert hub.requests == []


def test_the_hub_id_of_the_same_name_is_still_fetched(hub):
    preflight.check_model("acme/served")
    assert open_checkpoint("acme/served").name == "acme/served"
    assert hub.requests, "a hub id is looked up on the hub"


def test_serve_refuses_a_missing_path_in_one_line(tmp_path):
    env = {"PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "visenc", "serve", "--port", "1", "--model", "models/acme/served"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == preflight.EXIT_MODEL_UNAVAILABLE
    assert (
        r.stderr.strip() == "visenc: cannot serve models/acme/served: no such folder (a path: not looked up on the hub)"
    )
    assert not os.path.exists(tmp_path / "models")
