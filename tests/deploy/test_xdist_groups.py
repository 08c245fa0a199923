"""``make test-vllm``'s scheduling (``tests/support/xdist_groups.py``), on a toy suite run on two
workers as the vLLM suite is: the tests of a shared session fixture run on one worker, so its
server starts once; a module fixture's tests run on one worker per parameter; the other tests
go where there is room."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from harness.paths import ROOT

CONFTEST = """
from pathlib import Path
import pytest
from tests.support import xdist_groups

HERE = Path(__file__).parent
SHARED = ("server",)

def pytest_configure(config):
    xdist_groups.name_the_file(config)

@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    yield
    xdist_groups.ordered(items, HERE, SHARED)
    xdist_groups.write(config, items, HERE, SHARED)

@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    return xdist_groups.scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None

def pytest_unconfigure(config):
    xdist_groups.forget_the_file(config)

def record(kind, name):
    with open(Path(__file__).parent.parent / "ran", "a") as f:
        f.write(f"{kind} {name} {__import__('os').environ.get('PYTEST_XDIST_WORKER')}\\n")

@pytest.fixture(scope="session")
def server():
    record("start", "server")

@pytest.fixture(scope="module", params=[1, 2, 3])
def engine(request):
    record("start", f"{request.module.__name__}-{request.param}")
    return request.param
"""

TESTS = """
import time
import pytest
from conftest import record

@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    time.sleep(0.2)
    record("alone", f"{__name__}-{i}")

@pytest.mark.parametrize("i", range(3))
def test_server(server, i):
    time.sleep(0.2)
    record("server", f"{__name__}-{i}")

def test_engine(engine):
    time.sleep(0.2)
    record("engine", f"{__name__}-{engine}")

def test_engine_again(engine):
    record("engine", f"{__name__}-{engine}")
"""


def test_groups_run_on_one_worker_and_the_rest_spreads(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("test_a.py", "test_b.py"):
        (suite / name).write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    done = subprocess.run(
        [*command, "--dist", "loadgroup", "--no-loadscope-reorder", "suite"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line.split() for line in (tmp_path / "ran").read_text().splitlines()]
    workers: dict[str, set[str]] = defaultdict(set)
    for kind, name, worker in lines:
        key = "server" if kind == "server" else name if kind == "engine" else f"alone {name}"
        workers[key].add(worker)
    starts = [name for kind, name, _ in lines if kind == "start"]
    assert starts.count("server") == 1  # the shared server started once
    assert sorted(starts) == sorted(set(starts))  # and each module fixture's parameter once
    assert workers["server"] and len(workers["server"]) == 1
    assert all(len(workers[f"{m}-{p}"]) == 1 for m in ("test_a", "test_b") for p in (1, 2, 3))
    assert {worker for _, _, worker in lines} == {"gw0", "gw1"}  # both workers had work
