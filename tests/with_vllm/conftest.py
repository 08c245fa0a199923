"""The vLLM suite's shared parts: one fork server for every ``run_vllm.py`` run (``vllm_forks``), and,
once a session, what several modules read without changing it: the tiny Qwen2-VL pair (the right
checkpoint and a copy whose vision tower is wrong), a visenc on the right one, and ``vllm serve``
alone on the right one beside ``vllm serve`` on the wrong one behind ``visenc proxy``. A test that
kills, faults or reconfigures a server starts its own.

On two workers (``make test-vllm``: ``-n 2 --dist loadgroup``) the tests that read ``right_visenc``
or ``openai_pair`` run on one worker, so their servers start once; a module's tests that share a
module fixture run on one worker, one group per parameter (``tests/support/xdist_groups.py``);
every other test goes where there is room. Each worker has its own fork server, ports and
temporary folders.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support import xdist_groups

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

#: session fixtures that start servers: their tests form one group, run by one worker
SHARED = ("right_visenc", "openai_pair")
#: the limit of a test whose setup starts a group's servers (a vLLM server may take minutes to answer)
GROUP_TIMEOUT_S = 900


def pytest_configure(config: pytest.Config) -> None:
    xdist_groups.name_the_file(config)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    yield
    xdist_groups.ordered(items, HERE, SHARED)  # after pytest keeps each module fixture's parameters together
    xdist_groups.write(config, items, HERE, SHARED)
    xdist_groups.slow_setup(items, HERE, SHARED, GROUP_TIMEOUT_S)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return xdist_groups.scheduler(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_unconfigure(config: pytest.Config) -> None:
    xdist_groups.forget_the_file(config)


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[None]:
    """vLLM imported once for the session's ``run_vllm.py`` runs (at the first of them)."""
    from vllm_forks import SERVER

    SERVER.enabled = True
    try:
        yield
    finally:
        SERVER.stop()


@pytest.fixture(scope="session")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(right, wrong): a tiny Qwen2-VL, and a copy whose vision tower is redrawn from another seed."""
    import tiny_vlm

    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    return tiny_vlm.build(folder / "right", seed=0), tiny_vlm.build(folder / "wrong", seed=0, vision_seed=1)


@pytest.fixture(scope="session")
def right_visenc(qwen2_vl: tuple[Path, Path]) -> Iterator[str]:
    """visenc on the right checkpoint, holding the images of ``run_vllm``'s prompts (the connector
    never uploads)."""
    import run_vllm
    from harness.processes import serve_process

    from visenc_client import Client

    with serve_process("--model", str(qwen2_vl[0]), "--max-wait-ms", "1") as url:
        with Client(url) as vc:
            for datas in run_vllm.images():
                assert all(h.status == "ready" for h in vc.encode(datas, pin=False))  # nothing read here
        yield url


@pytest.fixture(scope="session")
def openai_pair(qwen2_vl: tuple[Path, Path], right_visenc: str) -> Iterator[tuple[str, str]]:
    """``(alone, proxied)``: ``openai_servers.alone_and_behind_proxy`` on the pair and ``right_visenc``,
    one video a prompt allowed."""
    from openai_servers import alone_and_behind_proxy

    with alone_and_behind_proxy(*qwen2_vl, right_visenc, videos=1) as urls:
        yield urls
