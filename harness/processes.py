"""Real processes on free loopback ports: ``visenc serve`` and ``redis-server`` (single, or a local
Cluster), each ready before it is yielded and ended after (terminated, then killed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from harness.paths import ROOT
from harness.waits import free_port, listening, wait_ready, wait_until


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """Terminate a process we started, then kill it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_subprocess(
    *args: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    launcher: tuple[str, ...] = ("-m", "visenc", "serve"),
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``visenc serve`` subprocess (``python LAUNCHER``) on a free loopback port, ready; yields
    (url, process); terminated (then killed) after, unless it already exited."""
    port = free_port()
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, *launcher, "--host", "127.0.0.1", "--port", str(port), *args],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)]),
            **(env or {}),
        },
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc
    finally:
        stop_process(proc)
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[str]:
    """``serve_subprocess`` when only the URL is needed."""
    with serve_subprocess(*args, env=env, log=log) as (url, _):
        yield url


@contextlib.contextmanager
def redis_process(port: int | None = None, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real redis-server on a free loopback port, no persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make test installs it)")
    port = port or free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    wait_until(lambda: listening(port), 10, f"redis-server on port {port}", interval_s=0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
        raise RuntimeError("redis-server / redis-cli are not installed (make test installs them)")
    ports = [_cluster_port() for _ in range(nodes)]
    procs = []
    try:
        for port in ports:
            d = workdir / str(port)
            d.mkdir(parents=True, exist_ok=True)
            node = ["--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
            files = ["--cluster-config-file", str(d / "nodes.conf"), "--dir", str(d)]
            cmd = [server, *node, *files, "--save", "", "--appendonly", "no", "--cluster-node-timeout", "2000"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for port in ports:
            wait_until(lambda port=port: listening(port), 10, f"redis on port {port}", 0.05)
        create = ["--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run([cli, *create], check=True, capture_output=True, timeout=30)

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
