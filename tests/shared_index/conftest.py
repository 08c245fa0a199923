"""Fixtures for the shared-index tests: a local Redis Cluster, metric readers, settings.

Every test here runs against real ``redis-server`` processes on free loopback
ports (``tests/conftest.py: redis_process`` for single servers)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import free_port
from tests.support.waits import listening, wait_until


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@contextlib.contextmanager
def redis_cluster(workdir: Path, nodes: int = 3) -> Iterator[list[int]]:
    """``nodes`` masters (``--cluster-enabled yes``) joined by ``redis-cli --cluster create``; their ports."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail("redis-server / redis-cli are not installed (make test installs them)")
    ports = [_cluster_port() for _ in range(nodes)]
    procs = []
    try:
        for port in ports:
            d = workdir / str(port)
            d.mkdir(parents=True, exist_ok=True)
            procs.append(
                subprocess.Popen(
                    [
                        server,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(d / "nodes.conf"),
                        "--dir",
                        str(d),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--cluster-node-timeout",
                        "2000",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
        for port in ports:
            wait_until(lambda port=port: listening(port), 10, f"redis on port {port}", 0.05)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

        def cluster_ok() -> bool:  # every node must agree the cluster is up before a client connects
            info = (
                subprocess.run([cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True, timeout=5)
                for p in ports
            )
            return all("cluster_state:ok" in done.stdout for done in info)

        wait_until(cluster_ok, 20, "the local redis cluster reaches cluster_state:ok", 0.1)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
