"""The loopback hub (``tests/support/hub.py``) answers as huggingface_hub's own code expects the hub to:
downloads into the standard cache layout, repo info, tree, paths-info, ranged reads (``HfFileSystem``),
``snapshot_download`` (what vLLM downloads with), and each refusal raised as the error class the real hub's
answer becomes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi, HfFileSystem, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import RepoFile, RepoFolder
from tests.support.hub import LoopbackHub

TOKEN = "hf_loopback_token"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repo")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("hello")
    return folder


@pytest.fixture(scope="module")
def hub(repo: Path) -> Iterator[LoopbackHub]:
    with LoopbackHub(tokens=(TOKEN,)) as h:
        h.publish("acme/open", repo, tag="v1")
        h.publish("acme/gated", repo, gated=True)
        h.publish("acme/private", repo, private=True)
        yield h


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_downloads_land_in_the_standard_cache_layout(hub: LoopbackHub, repo: Path, tmp_path: Path) -> None:
    config = Path(hf_hub_download("acme/open", "config.json", endpoint=hub.url, cache_dir=tmp_path))
    weights = Path(hf_hub_download("acme/open", "model.safetensors", endpoint=hub.url, cache_dir=tmp_path))
    storage = tmp_path / repo_folder_name(repo_id="acme/open", repo_type="model")
    commit = (storage / "refs" / "main").read_text()
    assert config == storage / "snapshots" / commit / "config.json" and config.is_symlink()
    assert weights.read_bytes() == (repo / "model.safetensors").read_bytes()
    # the LFS file came from the CDN origin, redirected by the hub with its sha256 as the linked ETag
    meta = get_hf_file_metadata(hf_hub_url("acme/open", "model.safetensors", endpoint=hub.url))
    assert meta.location.startswith(f"http://127.0.0.1:{hub.cdn_port}/cdn/") and meta.size == 10240
    assert meta.commit_hash == commit and meta.etag is not None and len(meta.etag) == 64
    assert [r.origin for r in hub.served("model.safetensors") if r.method == "GET"][-1] == "cdn"


def test_repo_info_tree_and_paths_info(hub: LoopbackHub) -> None:
    api = HfApi(endpoint=hub.url)
    info = api.model_info("acme/open", files_metadata=True)
    assert {s.rfilename for s in info.siblings or []} == {"config.json", "model.safetensors", "sub/notes.txt"}
    lfs = next(s for s in info.siblings or [] if s.rfilename == "model.safetensors")
    assert lfs.lfs is not None and lfs.size == 10240
    assert api.model_info("acme/open", revision="v1").sha == info.sha
    top = list(api.list_repo_tree("acme/open"))
    assert {(type(e), e.path) for e in top} == {
        (RepoFolder, "sub"),
        (RepoFile, "config.json"),
        (RepoFile, "model.safetensors"),
    }
    deep = [e.path for e in api.list_repo_tree("acme/open", recursive=True) if isinstance(e, RepoFile)]
    assert "sub/notes.txt" in deep
    paths = api.get_paths_info("acme/open", ["config.json", "sub", "missing"])
    assert [p.path for p in paths] == ["config.json", "sub"]


def test_ranged_reads_and_snapshot_download(hub: LoopbackHub, repo: Path, tmp_path: Path) -> None:
    hub.reset()
    fs = HfFileSystem(endpoint=hub.url)
    assert sorted(fs.ls("acme/open", detail=False)) == [
        "acme/open/config.json",
        "acme/open/model.safetensors",
        "acme/open/sub",
    ]
    with fs.open("acme/open/model.safetensors", "rb", block_size=512) as f:  # ranged GETs
        f.seek(1000)
        assert f.read(300) == (repo / "model.safetensors").read_bytes()[1000:1300]
    ranges = [r.byte_range for r in hub.served("model.safetensors", origin="cdn")]
    assert ranges and all(b is not None and b[0] <= 1000 and 1300 <= b[1] < 10240 for b in ranges)
    hub.reset()
    folder = Path(
        snapshot_download("acme/open", endpoint=hub.url, cache_dir=tmp_path, allow_patterns=["*.safetensors"])
    )
    assert (folder / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()
    assert not (folder / "config.json").exists()
    assert [r.file for r in hub.served() if r.method == "GET" and r.file] == ["model.safetensors"]


def test_ranges_as_the_cdn_answers_them(hub: LoopbackHub) -> None:
    from huggingface_hub.utils import get_session

    url = get_hf_file_metadata(hf_hub_url("acme/open", "model.safetensors", endpoint=hub.url)).location
    r = get_session().get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.headers["Content-Range"] == "bytes 10-19/10240" and len(r.content) == 10
    assert get_session().get(url, headers={"Range": "bytes=-4"}).content == bytes(range(252, 256))
    assert get_session().get(url, headers={"Range": "bytes=10240-"}).status_code == 416


def test_refusals_become_the_hub_error_classes(hub: LoopbackHub, tmp_path: Path) -> None:
    def get(repo_id: str, filename: str = "config.json", **kw: object) -> object:
        return hf_hub_download(repo_id, filename, endpoint=hub.url, cache_dir=tmp_path, **kw)  # type: ignore[arg-type]

    with pytest.raises(RepositoryNotFoundError):
        get("acme/missing")
    with pytest.raises(RepositoryNotFoundError):
        get("acme/private")
    assert Path(str(get("acme/private", token=TOKEN))).is_file()
    with pytest.raises(GatedRepoError):
        get("acme/gated")
    assert HfApi(endpoint=hub.url).model_info("acme/gated").gated == "auto"  # its card is public
    assert Path(str(get("acme/gated", token=TOKEN))).is_file()
    with pytest.raises(RevisionNotFoundError):
        get("acme/open", revision="v9")
    with pytest.raises(RemoteEntryNotFoundError):
        get("acme/open", "nothing.json")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("acme/missing")


def test_a_stopped_hub_answers_nothing_until_started(hub: LoopbackHub, tmp_path: Path) -> None:
    import httpx2

    hub.stop()
    try:
        with pytest.raises(httpx2.ConnectError):
            HfApi(endpoint=hub.url).model_info("acme/open")
    finally:
        hub.start()
    assert HfApi(endpoint=hub.url).model_info("acme/open").id == "acme/open"


def test_busy_answers_try_later_once_each(hub: LoopbackHub) -> None:
    """``busy`` entries: a 429 or 503 with ``Retry-After`` (as ``HfHubHTTPError``), each to the next
    request it matches, a file's ranged GET only from its byte on; then the usual answers."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import get_session
    from tests.support.hub_repos import Busy

    api = HfApi(endpoint=hub.url)
    url = get_hf_file_metadata(hf_hub_url("acme/open", "model.safetensors", endpoint=hub.url)).location
    hub.busy = [Busy(429, "7"), Busy(503, None, origin="cdn", file="model.safetensors", from_byte=100)]
    with pytest.raises(HfHubHTTPError) as e:
        api.model_info("acme/open")
    assert e.value.response.status_code == 429 and e.value.response.headers["Retry-After"] == "7"
    assert api.model_info("acme/open").id == "acme/open"
    assert get_session().get(url, headers={"Range": "bytes=0-9"}).status_code == 206
    busy = get_session().get(url, headers={"Range": "bytes=100-109"})
    assert busy.status_code == 503 and "Retry-After" not in busy.headers
    assert get_session().get(url, headers={"Range": "bytes=100-109"}).status_code == 206
    assert not hub.busy
