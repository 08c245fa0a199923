"""``visenc serve --model ORG/NAME`` against a hub on loopback (``tests/support/hub.py``, ``HF_ENDPOINT``).

Checkpoints laid out as real repositories (``hub_layout``: vision tensors beside language-model ones in
shard 1, a language-model-only shard 2, the index). Everything is asserted from what the hub served:
the rows equal, bit for bit, those of the same checkpoint served from a local folder; the bytes
fetched are the vision tensors, the shard headers and the config files; the language-model-only shard
is never asked for; a restart with the hub stopped serves from the cache; each failure is one line,
a non-zero exit within 60 s, and no traceback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_subprocess, stop_process
from harness.waits import free_port, wait_ready, wait_until
from tests.support.hub import LoopbackHub
from tests.support.hub_checkpoints import SHARDS, hub_layout, safetensors_header, vision_ranges
from tests.support.hub_repos import Busy

from visenc.models.resume import BLOCKS, INCOMPLETE, block_bytes
from visenc_client import Client

TOKEN = "hf_loopback_token"
IMAGES = [png_bytes(1, 120, 90), png_bytes(2, 230, 64)]
KINDS = ["qwen2_5_vl", "gemma3"]  # a Qwen2.5-VL layout (visual.*) and one named otherwise (vision_tower.*, ...)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: hub_layout(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def hub(folders: dict[str, Path]) -> Iterator[LoopbackHub]:
    with LoopbackHub(tokens=(TOKEN,)) as h:
        for kind, folder in folders.items():
            h.publish(f"acme/{kind}", folder)
        yield h


def served_rows(model: str, env: dict[str, str], log: Path, *args: str) -> tuple[str, list[np.ndarray]]:
    """(fingerprint, rows of ``IMAGES``) from a ``visenc serve --model model`` process."""
    with serve_subprocess("--model", model, "--torch-threads", "1", *args, env=env, log=log) as (url, _):
        with Client(url) as vc:
            fingerprint = vc.model()["fingerprint"]
            return fingerprint, [vc.fetch(h) for h in vc.encode(IMAGES)]


def cannot_serve(model: str, env: dict[str, str], *args: str) -> str:
    """The one line a ``visenc serve`` that cannot serve ``model`` ends with (asserted: non-zero exit
    within 60 s, no traceback)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "visenc", "serve", "--port", str(free_port()), "--model", model, *args],
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}:{ROOT}", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - started < 60
    output = done.stdout + done.stderr
    assert done.returncode == 4, output
    assert "Traceback" not in output, output
    lines = [line for line in done.stderr.splitlines() if line.startswith("visenc: cannot serve")]
    assert len(lines) == 1 and lines[0].startswith(f"visenc: cannot serve {model}"), output
    return lines[0]


def assert_fetched_only_vision_bytes(hub: LoopbackHub, kind: str, folder: Path) -> None:
    """What the hub sent: nothing of the language-model-only shard; of shard 1 its header and its
    vision tensors' bytes, each byte at most once; besides that only config files."""
    assert hub.served(SHARDS[1]) == []
    _, data_start = safetensors_header(folder / SHARDS[0])
    allowed = [(0, data_start), *vision_ranges(kind, folder)[SHARDS[0]]]
    got = [r for r in hub.served(SHARDS[0]) if r.method == "GET" and r.origin == "cdn"]
    assert got and all(r.status == 206 and r.byte_range is not None for r in got)
    spans = sorted(r.byte_range for r in got if r.byte_range is not None)
    for span in spans:
        assert covered(span, allowed), (span, allowed)
    assert all(a[1] <= b[0] for a, b in pairwise(spans)), spans  # each byte fetched once
    target = sum(end - start for start, end in allowed)
    assert hub.bytes_sent(SHARDS[0]) <= target
    configs = sum(f.stat().st_size for f in folder.glob("*.json"))
    files = sum(r.sent for r in hub.served() if r.file is not None)
    assert files <= target + configs


def covered(span: tuple[int, int], allowed: list[tuple[int, int]]) -> bool:
    """Whether ``span`` lies within the union of ``allowed`` ranges."""
    at = span[0]
    for start, end in sorted(allowed):
        if start <= at < end:
            at = end
    return at >= span[1]


@pytest.mark.parametrize("kind", KINDS)
def test_hub_id_serves_the_local_rows_from_vision_bytes_then_without_the_hub(
    kind: str, hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = folders[kind]
    local = served_rows(str(folder), hub.env(tmp_path / "unused"), tmp_path / "local.log")

    hub.reset()
    home = tmp_path / "hf"
    fetched = served_rows(f"acme/{kind}", hub.env(home), tmp_path / "fetch.log")
    assert fetched[0] == local[0]  # the same fingerprint: the same index keys as the local folder
    for a, b in zip(fetched[1], local[1], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit for bit
    assert_fetched_only_vision_bytes(hub, kind, folder)
    log = (tmp_path / "fetch.log").read_text()
    assert f"acme/{kind}: fetched" in log and "of vision weights" in log
    vision_files = list((home / "visenc").rglob("vision.safetensors"))
    assert len(vision_files) == 1 and not list((home / "visenc").rglob("*.incomplete"))
    assert not list((home / "hub").rglob("*.safetensors"))  # no shard in the hub cache

    hub.stop()
    try:
        again = served_rows(f"acme/{kind}", hub.env(home), tmp_path / "offline.log")
    finally:
        hub.start()
    assert again[0] == local[0] and all(np.array_equal(a, b) for a, b in zip(again[1], local[1], strict=True))
    log = (tmp_path / "offline.log").read_text()
    assert "is unreachable" in log and "from the cache" in log and "nothing fetched" in log

    if kind != KINDS[0]:
        return
    hub.reset()  # HF_HUB_OFFLINE: the hub is not even asked
    served_rows(f"acme/{kind}", hub.env(home, HF_HUB_OFFLINE="1"), tmp_path / "hf-offline.log")
    assert hub.requests == [] and "HF_HUB_OFFLINE is set" in (tmp_path / "hf-offline.log").read_text()


@contextmanager
def serving(model: str, env: dict[str, str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``visenc serve --model model`` process, not waited for (``serve_subprocess`` waits until it
    is ready); stopped after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "visenc", "serve", "--port", str(port), "--model", model, "--torch-threads", "1"],
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}:{ROOT}", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            stop_process(proc)


def first_vision_byte(folder: Path) -> int:
    return min(s for s, _ in vision_ranges("qwen2_5_vl", folder)[SHARDS[0]])


def test_a_fetch_killed_midway_resumes_in_the_next_process(
    hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path
) -> None:
    """A replica killed while it fetches (SIGKILL, as a failed startup probe ends it): the next one
    checks the blocks the first logged and asks only for the bytes from its last whole block on."""
    folder, home = folders["qwen2_5_vl"], tmp_path / "hf"
    header = safetensors_header(folder / SHARDS[0])[1]
    first = first_vision_byte(folder)
    last = max(e for _, e in vision_ranges("qwen2_5_vl", folder)[SHARDS[0]])
    block = block_bytes(last - first)
    hub.reset()
    hub.cuts[SHARDS[0]] = 3 * block + 100  # the connection drops mid-body, then the hub hangs
    hub.stalls[SHARDS[0]] = first + 3 * block + 100
    try:
        with serving("acme/qwen2_5_vl", hub.env(home), tmp_path / "killed.log") as (_, proc):
            logs = lambda: list(home.glob(f"visenc/*/*/*{INCOMPLETE}{BLOCKS}"))  # noqa: E731
            wait_until(lambda: logs() and len(logs()[0].read_text().splitlines()) == 4, 120, "3 blocks logged")
            proc.kill()
            proc.wait()
    finally:
        del hub.stalls[SHARDS[0]]
    hub.reset()
    served_rows("acme/qwen2_5_vl", hub.env(home), tmp_path / "next.log")
    got = [r.byte_range for r in hub.served(SHARDS[0], origin="cdn") if r.byte_range]
    assert got == [(0, 8), (8, header), (first + 3 * block, last)]
    assert not list(home.glob("visenc/*/*/*.incomplete*"))
    assert "kept from an earlier fetch (checked)" in (tmp_path / "next.log").read_text()


def test_a_rate_limited_hub_is_waited_out_or_the_cache_served(hub: LoopbackHub, tmp_path: Path) -> None:
    """Replicas restarting together draw 429s: with nothing cached, the start asks again after each
    Retry-After and serves; with the commit cached, it serves that at once."""
    env, log = hub.env(tmp_path / "hf", VISENC_HUB_WAIT_S="60"), tmp_path / "first.log"
    hub.busy = [Busy(429, "1"), Busy(503, "1", origin="cdn")]
    served_rows("acme/qwen2_5_vl", env, log)
    assert not hub.busy and log.read_text().count("asking again after the hub's Retry-After: 1 s") == 2
    hub.reset()
    hub.busy = [Busy(429, "600") for _ in range(20)]
    served_rows("acme/qwen2_5_vl", env, tmp_path / "again.log")
    assert [r.status for r in hub.served() if r.path != "/api/agent-harnesses"] == [429]
    assert "answered 429; serving commit" in (tmp_path / "again.log").read_text()
    hub.busy.clear()


def test_replicas_sharing_a_cache_fetch_once(hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path) -> None:
    """Two replicas started on one cache (a shared volume): the second waits for the first's fetch,
    says so, and reads the file it wrote; every vision byte crosses once, and both serve the same rows."""
    folder, env = folders["qwen2_5_vl"], hub.env(tmp_path / "hf")
    first = first_vision_byte(folder)
    hub.reset()
    hub.stalls[SHARDS[0]] = first  # the first replica's fetch holds in the vision bytes
    try:
        with ExitStack() as replicas:
            url_a, proc_a = replicas.enter_context(serving("acme/qwen2_5_vl", env, tmp_path / "a.log"))
            wait_until(lambda: list((tmp_path / "hf").glob("visenc/*/*/*.incomplete")), 120, "a fetch under way")
            url_b, proc_b = replicas.enter_context(serving("acme/qwen2_5_vl", env, tmp_path / "b.log"))
            wait_until(lambda: "waiting for it" in (tmp_path / "b.log").read_text(), 120, "the second replica waits")
            del hub.stalls[SHARDS[0]]
            rows = []
            for url, proc in ((url_a, proc_a), (url_b, proc_b)):
                wait_ready(url, proc)
                with Client(url) as vc:
                    rows.append((vc.model()["fingerprint"], [vc.fetch(h) for h in vc.encode(IMAGES)]))
    finally:
        hub.stalls.pop(SHARDS[0], None)
    assert rows[0][0] == rows[1][0] and all(np.array_equal(a, b) for a, b in zip(rows[0][1], rows[1][1], strict=True))
    data = [r for r in hub.served(SHARDS[0]) if r.status == 206 and r.byte_range and r.byte_range[0] >= first]
    vision = sum(e - s for s, e in vision_ranges("qwen2_5_vl", folder)[SHARDS[0]])
    assert sum(r.sent for r in data) == vision  # fetched once, by the first replica
    assert "fetched by another process meanwhile" in (tmp_path / "b.log").read_text()


def test_a_checkpoint_in_the_hub_cache_is_read_there(hub: LoopbackHub, tmp_path: Path) -> None:
    """A checkpoint an engine already downloaded (vLLM: ``snapshot_download`` of the safetensors and
    the index) is read from the hub cache: no weight byte is fetched, no vision file written."""
    from huggingface_hub import snapshot_download

    home = tmp_path / "hf"
    snapshot_download(
        "acme/qwen2_5_vl",
        cache_dir=home / "hub",
        endpoint=hub.url,
        allow_patterns=["*.safetensors", "model.safetensors.index.json"],
        token=False,
    )
    hub.reset()
    served_rows("acme/qwen2_5_vl", hub.env(home), tmp_path / "serve.log")
    assert [r for r in hub.served() if r.file is not None and r.file.endswith(".safetensors")] == []
    assert not (home / "visenc").exists()
    assert "read from the hub cache" in (tmp_path / "serve.log").read_text()


def test_a_revision_is_pinned_by_name_or_flag(hub: LoopbackHub, tmp_path: Path) -> None:
    from visenc.models.loading import load_tower

    v1 = hub_layout("qwen2_5_vl", tmp_path / "v1", seed=0)
    v2 = hub_layout("qwen2_5_vl", tmp_path / "v2", seed=1)
    hub.publish("acme/pinned", v1, tag="v1")
    second = hub.publish("acme/pinned", v2)
    want = {n: load_tower(str(p)).fingerprint for n, p in (("v1", v1), ("v2", v2))}
    assert want["v1"] != want["v2"]
    env = hub.env(tmp_path / "hf")
    assert served_rows("acme/pinned@v1", env, tmp_path / "a.log")[0] == want["v1"]
    assert served_rows("acme/pinned", env, tmp_path / "b.log", "--revision", second)[0] == want["v2"]
    assert "no revision 'v9'" in cannot_serve("acme/pinned@v9", env)


def test_a_gated_repository_needs_a_token(hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path) -> None:
    hub.publish("acme/gated", folders["gemma3"], gated=True)
    with ThreadPoolExecutor(3) as pool:  # independent starts: side by side
        no_token = pool.submit(cannot_serve, "acme/gated", hub.env(tmp_path / "a"))
        served = pool.submit(served_rows, "acme/gated", hub.env(tmp_path / "b", HF_TOKEN=TOKEN), tmp_path / "b.log")
        # a token the hub does not know (mistyped, revoked) is refused on any repository, gated or not
        revoked = pool.submit(cannot_serve, "acme/qwen2_5_vl", hub.env(tmp_path / "c", HF_TOKEN="hf_revoked"))
    assert "gated repository" in no_token.result() and "HF_TOKEN" in no_token.result()
    assert served.result()[0]
    assert "does not accept HF_TOKEN" in revoked.result()


def test_each_failure_is_one_line(hub: LoopbackHub, folders: dict[str, Path], tmp_path: Path) -> None:
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text('{"model_type": "llama"}')
    hub.publish("acme/text-only", text_only)
    no_vision = tmp_path / "no-vision"
    no_vision.mkdir()
    for f in folders["qwen2_5_vl"].glob("*.json"):
        (no_vision / f.name).write_bytes(f.read_bytes())
    (no_vision / "model.safetensors.index.json").unlink()
    (no_vision / "model.safetensors").write_bytes((folders["qwen2_5_vl"] / SHARDS[1]).read_bytes())
    hub.publish("acme/no-vision", no_vision)
    hub.publish("acme/private", folders["gemma3"], private=True)
    torn = tmp_path / "torn"
    shutil.copytree(folders["qwen2_5_vl"], torn)
    (torn / "preprocessor_config.json").write_text('{"patch_size": 14,')  # a file that does not parse
    hub.publish("acme/torn", torn)
    env = hub.env(tmp_path / "hf")
    expected = {
        "acme/missing": "no such repository",
        "acme/private": "private: set HF_TOKEN",
        "acme/text-only": "unsupported model_type 'llama'",
        "acme/no-vision": "vision tensors do not match",
        "acme/torn": "JSONDecodeError",
    }
    with ThreadPoolExecutor(len(expected)) as pool:  # independent starts: side by side
        lines = dict(zip(expected, pool.map(lambda model: cannot_serve(model, env), expected)))
    for model, words in expected.items():
        assert words in lines[model], lines[model]
    hub.reset()
    hub.stop()
    try:
        line = cannot_serve("acme/qwen2_5_vl", hub.env(tmp_path / "empty", VISENC_HUB_WAIT_S="0"))
    finally:
        hub.start()
    assert "is unreachable" in line and "does not hold main" in line


class _Failing(BaseHTTPRequestHandler):
    """A hub whose every answer is 503 (down for maintenance, an overloaded proxy)."""

    def do_GET(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_hub_that_hangs_or_fails_ends_start_up_with_one_line(tmp_path: Path) -> None:
    """A hub that takes connections and never answers (a black-holed proxy: every request ends at its
    timeout), or answers every request with a 5xx, and nothing cached: asked again for ``hub_wait_s``,
    then one line that says so, exit 4 (``cannot_serve``)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
        hung_hub = f"http://127.0.0.1:{hung.getsockname()[1]}"
        env = LoopbackHub().env(tmp_path / "a", HF_ENDPOINT=hung_hub, VISENC_HUB_WAIT_S="0")
        line = cannot_serve("acme/anything", env)
    assert "is unreachable (timed out)" in line and "does not hold main" in line
    failing = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    try:
        failing_hub = f"http://127.0.0.1:{failing.server_address[1]}"
        env = LoopbackHub().env(tmp_path / "b", HF_ENDPOINT=failing_hub, VISENC_HUB_WAIT_S="3")
        line = cannot_serve("acme/anything", env)
    finally:
        failing.shutdown()
        failing.server_close()
    assert "answered 503" in line and "does not hold main" in line and "hub_wait_s=3)" in line
