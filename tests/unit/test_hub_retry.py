"""A hub that says "try later" (429, 408, 5xx with or without ``Retry-After``), and fetches that stop
midway: the cached commit is served at once, else the hub is asked again within ``hub_wait_s``, its
``Retry-After`` honoured; a fetch resumes at its last logged block, the kept bytes checked first."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tests.support.hub import LoopbackHub, point_hub_at
from tests.support.hub_checkpoints import SHARDS, hub_layout, safetensors_header, vision_ranges
from tests.support.hub_repos import Busy

from visenc.errors import ModelUnavailable
from visenc.models import hub_errors, hub_fetch, resume
from visenc.models.hub_fetch import RemoteFile
from visenc.models.loading import load_tower


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str], None]:
    """Point this process's huggingface_hub at a hub URL, with a cache under ``tmp_path``; pauses short."""
    monkeypatch.setattr(hub_errors, "FIRST_PAUSE_S", 0.05, raising=False)
    monkeypatch.setattr(hub_fetch, "RETRY_PAUSE_S", 0.0)

    def use(url: str) -> None:
        point_hub_at(monkeypatch, tmp_path, url)

    return use


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hub_layout("qwen2_5_vl", tmp_path_factory.mktemp("q") / "q")


@pytest.fixture(scope="module")
def want(folder: Path) -> str:
    return load_tower(str(folder)).fingerprint


@pytest.fixture
def hub(folder: Path, hub_env: Callable[[str], None]) -> Iterator[LoopbackHub]:
    with LoopbackHub() as h:
        h.publish("acme/q", folder)
        hub_env(h.url)
        yield h


def asked(hub: LoopbackHub) -> list[Any]:
    return [r for r in hub.served() if r.path != "/api/agent-harnesses"]


@pytest.mark.parametrize(("status", "retry_after"), [(429, "60"), (408, None), (503, "60"), (502, None)])
def test_try_later_serves_the_cached_commit_at_once(
    status: int, retry_after: str | None, hub: LoopbackHub, want: str
) -> None:
    """Replicas restarting together draw 429s: the commit the cache holds is served, the hub asked once."""
    assert load_tower("acme/q").fingerprint == want
    hub.reset()
    hub.busy = [Busy(status, retry_after) for _ in range(20)]
    assert load_tower("acme/q", hub_wait_s=300).fingerprint == want
    assert [r.status for r in asked(hub)] == [status]


def test_try_later_without_the_cache_is_asked_again_after_its_retry_after(hub: LoopbackHub, want: str) -> None:
    hub.busy = [Busy(429, "1"), Busy(503, "1"), Busy(500, None)]
    assert load_tower("acme/q", hub_wait_s=60).fingerprint == want
    answers = asked(hub)
    assert [r.status for r in answers[:4]] == [429, 503, 500, 200]
    assert answers[1].at - answers[0].at >= 1 and answers[2].at - answers[1].at >= 1  # Retry-After honoured
    assert not hub.busy


def test_a_retry_after_past_the_limit_ends_the_start_at_once(hub: LoopbackHub) -> None:
    hub.busy = [Busy(429, "600")]
    with pytest.raises(ModelUnavailable, match=r"answered 429, and the hub cache .* does not hold main \(asked 1 "):
        load_tower("acme/q", hub_wait_s=30)
    assert [r.status for r in asked(hub)] == [429]


def test_a_fetch_cut_then_rate_limited_resumes_at_its_last_block(hub: LoopbackHub, folder: Path, want: str) -> None:
    """The connection drops midway through the vision bytes, the hub then answers 429: after its
    Retry-After the fetch asks for the bytes from its last whole block on, not for those it kept."""
    header = safetensors_header(folder / SHARDS[0])[1]
    ranges = vision_ranges("qwen2_5_vl", folder)[SHARDS[0]]
    first, last = min(s for s, _ in ranges), max(e for _, e in ranges)
    block = resume.block_bytes(last - first)
    cut = 3 * block + 100
    hub.cuts[SHARDS[0]] = cut
    hub.busy = [Busy(429, "1", origin="cdn", file=SHARDS[0], from_byte=first + cut)]
    assert load_tower("acme/q", hub_wait_s=60).fingerprint == want
    got = [(r.status, r.byte_range) for r in hub.served(origin="cdn") if r.status in (206, 429)]
    assert got == [
        (206, (0, 8)),
        (206, (8, header)),
        (206, (first, first + cut)),
        (429, None),
        (206, (first + 3 * block, last)),
    ]


class LocalRemote(RemoteFile):
    """A shard read from a local file, its ranged reads recorded; ``fails_at``: a source byte where
    the transfer dies (a process killed there)."""

    def __init__(self, path: Path, etag: str = "e1", fails_at: int | None = None) -> None:
        super().__init__(path.name, str(path), {}, path.stat().st_size, etag)
        self.path, self.fails_at = path, fails_at
        self.asked: list[tuple[int, int]] = []

    def stream(self, start: int, end: int) -> Any:
        self.asked.append((start, end))
        data = self.path.read_bytes()
        stop = end if self.fails_at is None else min(end, max(start, self.fails_at))
        for at in range(start, stop, 100):
            yield data[at : min(stop, at + 100)]
        if stop < end:
            raise RuntimeError("killed")


@pytest.mark.parametrize("change", ["none", "a torn log line", "a kept block damaged", "another version of the shard"])
def test_a_resumed_fetch_keeps_only_the_blocks_it_checked(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resume, "MIN_BLOCK_BYTES", 256)
    path = tmp_path / "1.safetensors"
    save_file({"lm": torch.ones(300), "vis": torch.arange(2000.0)}, str(path), metadata={"format": "pt"})
    head, data = LocalRemote(path).header()
    begin, end = (data + o for o in head["vis"]["data_offsets"])
    block = resume.block_bytes(end - begin)
    assert block == 256
    clean = tmp_path / "clean" / "vision.safetensors"
    hub_fetch.fetch_tensors(clean, {LocalRemote(path): ["vis"]}, {"repo": "r"}, "clean")
    dest = tmp_path / "out" / "vision.safetensors"
    with pytest.raises(RuntimeError, match="killed"):
        hub_fetch.fetch_tensors(
            dest, {LocalRemote(path, fails_at=begin + 10 * block + 50): ["vis"]}, {"repo": "r"}, "t"
        )
    partial = dest.with_name(dest.name + resume.INCOMPLETE)
    logged = partial.with_name(partial.name + resume.BLOCKS).read_text().splitlines()[1:]
    assert len(logged) == 10  # the blocks whole when it died
    if change == "a torn log line":  # killed while it appended: the line is not whole
        with partial.with_name(partial.name + resume.BLOCKS).open("a") as f:
            f.write(f"{10 * block} {11 * block} 0f")
    if change == "a kept block damaged":
        raw = bytearray(partial.read_bytes())
        raw[len(raw) - (end - begin) + 4 * block + 7] ^= 1
        partial.write_bytes(bytes(raw))
    again = LocalRemote(path, etag="e2" if change == "another version of the shard" else "e1")
    done = hub_fetch.fetch_tensors(dest, {again: ["vis"]}, {"repo": "r"}, "t")
    assert dest.read_bytes() == clean.read_bytes()
    assert not partial.exists() and not list(dest.parent.glob("*.blocks"))
    tensor_asks = [a for a in again.asked if a[0] >= data]
    if change in ("none", "a torn log line"):
        assert tensor_asks == [(begin + 10 * block, end)] and done.kept_bytes == 10 * block
    elif change == "a kept block damaged":
        assert tensor_asks == [(begin + 4 * block, begin + 5 * block), (begin + 10 * block, end)]
        assert done.kept_bytes == 9 * block
    else:
        assert tensor_asks == [(begin, end)] and done.kept_bytes == 0
