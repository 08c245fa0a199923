"""Hub ids and ranged fetches, piece by piece: which specs are hub ids, which byte ranges a vision file
is made of (adjacent tensors in one range, large ranges in parts), and that a vision-only file read
back holds each tensor's bytes as its shard does."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from visenc.errors import ModelUnavailable
from visenc.models import hub_fetch
from visenc.models.hub import parse_spec
from visenc.models.hub_fetch import RemoteFile, Span, parts, plan, size_text


@pytest.mark.parametrize(
    ("spec", "revision", "want"),
    [
        ("Qwen/Qwen2.5-VL-7B-Instruct", None, ("Qwen/Qwen2.5-VL-7B-Instruct", None)),
        ("Qwen/Qwen2.5-VL-7B-Instruct@v1.0", None, ("Qwen/Qwen2.5-VL-7B-Instruct", "v1.0")),
        ("google/gemma-3-4b-it", "a" * 40, ("google/gemma-3-4b-it", "a" * 40)),
        ("org/name@main", "main", ("org/name", "main")),
        ("/models/Qwen2.5-VL", None, None),
        ("./models/x", None, None),
        ("tiny-qwen2-vl", None, None),
        ("org/name@", None, None),
        ("a/b/c", None, None),
    ],
)
def test_hub_ids(spec: str, revision: str | None, want: tuple[str, str | None] | None) -> None:
    assert parse_spec(spec, revision) == want


def test_two_different_revisions_are_refused() -> None:
    with pytest.raises(ModelUnavailable, match="two revisions"):
        parse_spec("org/name@v1", "v2")


class LocalRemote(RemoteFile):
    """A ``RemoteFile`` whose ranged reads come from a local file (the plan and the writer, without HTTP)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path.name, str(path), {}, path.stat().st_size)
        self.path = path
        self.asked: list[tuple[int, int]] = []

    def stream(self, start: int, end: int) -> Any:
        self.asked.append((start, end))
        with self.path.open("rb") as f:
            f.seek(start)
            yield f.read(end - start)


def shard(path: Path, **tensors: torch.Tensor) -> LocalRemote:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return LocalRemote(path)


def test_adjacent_tensors_are_one_range_and_gaps_split_them(tmp_path: Path) -> None:
    # safetensors orders a file by dtype alignment, then by name: a.0 a.1 | b (skipped) | c.0
    one = shard(
        tmp_path / "1.safetensors",
        **{"a.0": torch.ones(3), "a.1": torch.zeros(5), "b": torch.ones(7), "c.0": torch.ones(2)},
    )
    two = shard(tmp_path / "2.safetensors", d=torch.arange(4.0))
    entries, spans = plan({one: ["a.0", "a.1", "c.0"], two: ["d"]})
    data = one.header()[1]
    assert [(s.source, s.start - data, s.end - data, s.dest) for s in spans if s.source is one] == [
        (one, 0, 32, 0),
        (one, 60, 68, 32),
    ]
    assert [(s.start, s.end, s.dest) for s in spans if s.source is two] == [(two.header()[1], two.header()[1] + 16, 40)]
    assert [e["data_offsets"] for e in entries.values()] == [[0, 12], [12, 32], [32, 40], [40, 56]]
    cut = parts([Span(one, 100, 350, 7)], size=100)
    assert [(p.start, p.end, p.dest) for p in cut] == [(100, 200, 7), (200, 300, 107), (300, 350, 207)]


def test_a_vision_file_holds_the_tensors_as_their_shards_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_fetch, "PART_BYTES", 16)  # several parts a range, written out of order
    big = torch.arange(40, dtype=torch.bfloat16).reshape(5, 8)
    one = shard(tmp_path / "1.safetensors", **{"lm": torch.ones(9), "vis.w": big, "vis.b": torch.arange(3.0)})
    dest = tmp_path / "out" / "vision.safetensors"
    done = hub_fetch.fetch_tensors(dest, {one: ["vis.b", "vis.w"]}, {"repo": "org/name"}, "test")
    assert done.tensor_bytes == 80 + 12 and done.shards == 1
    with safe_open(str(dest), framework="pt") as f:
        assert sorted(f.keys()) == ["vis.b", "vis.w"]
        assert torch.equal(f.get_tensor("vis.w"), big) and torch.equal(f.get_tensor("vis.b"), torch.arange(3.0))
        metadata = f.metadata()
    (length,) = struct.unpack("<Q", dest.read_bytes()[:8])
    assert (8 + length) % 8 == 0 and json.loads(dest.read_bytes()[8 : 8 + length])["__metadata__"] == metadata
    data = hashlib.sha256(dest.read_bytes()[8 + length :]).hexdigest()
    assert metadata == {"repo": "org/name", "data_sha256": data}  # the checksum of what was written
    assert not list(dest.parent.glob("*.incomplete"))
    head, data = one.header()
    begin, end = (data + o for o in head["lm"]["data_offsets"])  # the language-model tensor: never asked for
    assert all(e <= begin or s >= end for s, e in one.asked if s >= data)


def test_sizes_for_people() -> None:
    assert [size_text(n) for n in (0, 1023, 1024, 3 << 20, 1.3 * (1 << 30))] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "3.0 MiB",
        "1.3 GiB",
    ]


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str], None]:
    """Point this process's huggingface_hub at a hub URL, with a cache under ``tmp_path``."""
    from tests.support.hub import point_hub_at

    def use(url: str) -> None:
        point_hub_at(monkeypatch, tmp_path, url)

    return use


def test_a_hub_that_lists_files_only_in_its_tree_and_serves_lfs_itself(
    hub_env: Callable[[str], None], tmp_path: Path
) -> None:
    """A more minimal hub than the real one (repo info without ``siblings``, LFS files answered at
    their resolve URL, no CDN): the same tower, the same bytes fetched."""
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import SHARDS, hub_layout, safetensors_header, vision_ranges

    from visenc.models.loading import load_tower

    folder = hub_layout("internvl", tmp_path / "internvl")
    with LoopbackHub(siblings=False, cdn=False) as hub:
        hub.publish("acme/internvl", folder)
        hub_env(hub.url)
        tower = load_tower("acme/internvl", image_backend="pil")
        assert tower.name == "acme/internvl"
        assert tower.fingerprint == load_tower(str(folder), image_backend="pil").fingerprint
        assert hub.served(SHARDS[1]) == [] and any("/tree/" in r.path for r in hub.served())
        vision = sum(e - s for s, e in vision_ranges("internvl", folder)[SHARDS[0]])
        header = safetensors_header(folder / SHARDS[0])[1]
        assert 0 < hub.bytes_sent(SHARDS[0]) <= vision + header


def test_a_transfer_cut_short_resumes_where_it_stopped(
    hub_env: Callable[[str], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops in the middle of the vision tensors' range: the fetch asks for the rest
    only, so every byte still crosses once, and the tower is the local folder's."""
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import SHARDS, hub_layout, safetensors_header, vision_ranges

    from visenc.models.loading import load_tower

    monkeypatch.setattr(hub_fetch, "RETRY_PAUSE_S", 0.0)
    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    with LoopbackHub() as hub:
        hub.publish("acme/q", folder)
        hub.cuts[SHARDS[0]] = 5000  # past the header (two short reads): the vision tensors' range
        hub_env(hub.url)
        tower = load_tower("acme/q")
        assert SHARDS[0] not in hub.cuts  # it was cut
        got = sorted(r.byte_range for r in hub.served(SHARDS[0], origin="cdn") if r.byte_range)
    assert tower.fingerprint == load_tower(str(folder)).fingerprint
    header = safetensors_header(folder / SHARDS[0])[1]
    ranges = vision_ranges("qwen2_5_vl", folder)[SHARDS[0]]
    first, last = min(s for s, _ in ranges), max(e for _, e in ranges)
    assert got == [(0, 8), (8, header), (first, first + 5000), (first + 5000, last)]


@pytest.mark.parametrize("damage", ["cut short", "a flipped bit", "cut in its header"])
def test_a_damaged_vision_file_is_never_read(damage: str, hub_env: Callable[[str], None], tmp_path: Path) -> None:
    """A vision file damaged after it was written (a full disk, a copy cut short, a bad sector) is
    neither read nor a crash: without the hub, one line says so; with it, the file is fetched again."""
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import SHARDS, hub_layout

    from visenc.models.loading import load_tower

    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    want = load_tower(str(folder)).fingerprint
    with LoopbackHub() as hub:
        hub.publish("acme/q", folder)
        hub_env(hub.url)
        assert load_tower("acme/q").fingerprint == want
        (vision,) = (tmp_path / "hf" / "visenc").rglob("vision.safetensors")
        whole = vision.read_bytes()
        damaged = {
            "cut short": whole[:-100],
            "a flipped bit": whole[:-1] + bytes([whole[-1] ^ 1]),
            "cut in its header": whole[:40],
        }[damage]
        vision.write_bytes(damaged)
        hub.stop()
        try:
            with pytest.raises(ModelUnavailable, match=r"is unreachable.*vision file .* is damaged"):
                load_tower("acme/q", hub_wait_s=0)
        finally:
            hub.start()
        hub.reset()
        assert load_tower("acme/q").fingerprint == want
        assert hub.served(SHARDS[0]) and vision.read_bytes() == whole  # fetched again


def test_a_hub_that_stops_answering_ends_the_fetch(
    hub_env: Callable[[str], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub that takes the connection and then sends nothing (a hung CDN) is asked ``STALLED_TRIES``
    times, each ending after ``HF_HUB_DOWNLOAD_TIMEOUT``: start-up ends with one line within a minute
    (2 x 10 s by default), where resuming a transfer that does progress takes up to ``PART_TRIES``."""
    from huggingface_hub import constants
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import SHARDS, hub_layout, vision_ranges

    from visenc.models.loading import load_tower

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    monkeypatch.setattr(hub_fetch, "RETRY_PAUSE_S", 0.0)
    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    with LoopbackHub() as hub:
        hub.publish("acme/q", folder)
        hub.stalls[SHARDS[0]] = min(s for s, _ in vision_ranges("qwen2_5_vl", folder)[SHARDS[0]])
        hub_env(hub.url)
        with pytest.raises(ModelUnavailable, match="is unreachable"):
            load_tower("acme/q", hub_wait_s=0)
        unanswered = [r for r in hub.served(SHARDS[0]) if r.status == 0]
    assert hub_fetch.STALLED_TRIES * constants.DEFAULT_DOWNLOAD_TIMEOUT < 60
    assert len(unanswered) == hub_fetch.STALLED_TRIES < hub_fetch.PART_TRIES


@pytest.mark.parametrize("layout", ["sharded", "single file"])
def test_a_hub_that_ignores_ranges_gets_the_vision_shards_whole(
    layout: str, hub_env: Callable[[str], None], tmp_path: Path
) -> None:
    """A mirror or proxy that answers a ranged GET with the whole file (200): the shards that hold
    vision weights are downloaded whole into the hub cache (as vLLM would download them) and read
    there; the language-model-only shard is still never asked for."""
    from harness.tiny_families import save_family
    from huggingface_hub import try_to_load_from_cache
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import SHARDS, hub_layout

    from visenc.models.loading import load_tower

    folder = hub_layout("gemma3", tmp_path / "g") if layout == "sharded" else save_family("gemma3", tmp_path / "g")
    vision_shard = SHARDS[0] if layout == "sharded" else "model.safetensors"
    want = load_tower(str(folder), image_backend="pil").fingerprint
    with LoopbackHub(ranges=False) as hub:
        hub.publish("acme/g", folder)
        hub_env(hub.url)
        assert load_tower("acme/g", image_backend="pil").fingerprint == want
        assert layout == "single file" or hub.served(SHARDS[1]) == []
        assert all(r.status == 200 for r in hub.served(vision_shard) if r.method == "GET")
        cached = try_to_load_from_cache("acme/g", vision_shard, revision="main")
        assert isinstance(cached, str) and Path(cached).read_bytes() == (folder / vision_shard).read_bytes()
        assert not list((tmp_path / "hf" / "visenc").rglob("vision.safetensors"))
        hub.stop()
        assert load_tower("acme/g", image_backend="pil").fingerprint == want  # read there later, hub or none


def test_a_single_file_checkpoint_fetches_only_its_vision_bytes(hub_env: Callable[[str], None], tmp_path: Path) -> None:
    """A repository with one ``model.safetensors`` and no index (CLIP, SigLIP, small VLMs): its header
    is read with two ranged GETs, then only the vision tensors' bytes; a restart needs no hub."""
    from harness.tiny_families import save_family
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import safetensors_header

    from visenc.models.loading import load_tower

    folder = save_family("gemma3", tmp_path / "g")
    assert not (folder / "model.safetensors.index.json").exists()
    head, data = safetensors_header(folder / "model.safetensors")
    vision = [head[n]["data_offsets"] for n in head if n.startswith(("vision_tower.", "multi_modal_projector."))]
    language = [head[n]["data_offsets"] for n in head if n.startswith("language_model.")]
    assert vision and language, sorted(head)[:4]
    want = load_tower(str(folder), image_backend="pil").fingerprint
    with LoopbackHub() as hub:
        hub.publish("acme/g", folder)
        hub_env(hub.url)
        assert load_tower("acme/g", image_backend="pil").fingerprint == want
        got = [r.byte_range for r in hub.served("model.safetensors") if r.byte_range]
        hub.stop()
        assert load_tower("acme/g", image_backend="pil").fingerprint == want
    assert got[:2] == [(0, 8), (8, data)]
    assert sum(e - s for s, e in got[2:]) == sum(e - s for s, e in vision)
    assert all(e <= data + b or s >= data + e2 for s, e in got[2:] for b, e2 in language)  # no language byte


def test_every_revision_form_is_served_from_the_cache(hub_env: Callable[[str], None], tmp_path: Path) -> None:
    """A branch, a tag or a commit, as ``hf download --revision`` (or visenc itself) left it in the
    cache: served with the hub stopped, through the cache's ``refs/`` files or its snapshot folder."""
    from huggingface_hub import snapshot_download
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import hub_layout

    from visenc.models.loading import load_tower

    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    want = load_tower(str(folder)).fingerprint
    with LoopbackHub() as hub:
        commit = hub.publish("acme/q", folder, tag="v1")
        hub_env(hub.url)
        snapshot_download("acme/q", revision="v1")  # every file, as an engine or `hf download` fetches them
        assert load_tower("acme/q").fingerprint == want  # main: resolved now, read from the hub cache
        hub.stop()
        for spec in ("acme/q@v1", f"acme/q@{commit}", "acme/q"):
            assert load_tower(spec).fingerprint == want, spec
    assert not (tmp_path / "hf" / "visenc").exists()  # nothing fetched: the engine's shards were read


def test_a_whole_vision_file_that_lacks_a_tensor_is_fetched_again(
    hub_env: Callable[[str], None], tmp_path: Path
) -> None:
    """A whole vision file that holds fewer tensors than the tower now takes (written for another
    selection): fetched again where the hub answers; without it, one line says the file lacks some."""
    from safetensors.torch import load_file
    from tests.support.hub import LoopbackHub
    from tests.support.hub_checkpoints import hub_layout

    from visenc.models.loading import load_tower

    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    with LoopbackHub() as hub:
        hub.publish("acme/q", folder)
        hub_env(hub.url)
        want = load_tower("acme/q").fingerprint
        (vision,) = (tmp_path / "hf" / "visenc").rglob("vision.safetensors")
        with safe_open(str(vision), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(vision))
        del tensors[sorted(tensors)[-1]]
        save_file(tensors, str(vision), metadata=metadata)
        (length,) = struct.unpack("<Q", vision.read_bytes()[:8])
        metadata["data_sha256"] = hashlib.sha256(vision.read_bytes()[8 + length :]).hexdigest()
        save_file(tensors, str(vision), metadata=metadata)  # whole: the checksum of what it now holds
        hub.stop()
        try:
            with pytest.raises(ModelUnavailable, match="lacks some of them"):
                load_tower("acme/q", hub_wait_s=0)
        finally:
            hub.start()
        assert load_tower("acme/q").fingerprint == want
        assert len(load_file(str(vision))) == len(tensors) + 1
