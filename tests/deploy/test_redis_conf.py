"""The shipped deploy/redis/redis.conf runs: a real redis-server started with it and a password, as
compose and k8s start it, refuses clients without the password and applies the file's settings."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import redis
from harness.paths import ROOT
from harness.waits import free_port, listening, wait_until


def test_redis_runs_with_the_shipped_file_and_a_password(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port, password = free_port(), "p" * 32
    conf = str(ROOT / "deploy" / "redis" / "redis.conf")
    argv = [exe, conf, "--requirepass", password, "--maxmemory", "64mb", "--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: listening(port), 10, f"redis-server on port {port}", interval_s=0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        r = redis.Redis(port=port, password=password)
        assert r.ping()
        got = {k: r.config_get(k)[k] for k in ("maxmemory-policy", "lazyfree-lazy-eviction", "appendonly", "save")}
        assert got == {
            "maxmemory-policy": "allkeys-lru",
            "lazyfree-lazy-eviction": "yes",
            "appendonly": "no",
            "save": "",
        }
        assert r.config_get("maxmemory")["maxmemory"] == str(64 << 20)
        assert "normal 0 0 0" in r.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
