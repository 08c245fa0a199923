"""Videos through the real app (tiny Qwen2-VL tower): encoded tube by tube, cached per tube.

- a video's rows (fetched by its hash, or tube by tube) equal its tubes' forwards, which
  ``tests/golden/test_video_tubes.py`` shows equal transformers' whole-video ``get_video_features``;
- a clip that overlaps one already encoded (a sliding window advanced by a tube, the same clip
  grown by two frames) encodes only its new tubes; a clip re-asked encodes nothing;
- a video is found by its hash alone (``video_hash`` of its frames' hashes), as an engine asks;
- a bad video is that item's error, with a reason; the service stays healthy.
"""

from __future__ import annotations

import hashlib

import httpx
import msgpack
import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import metric
from tests.support.api import MSGPACK, running_app

from visenc.engine import videos
from visenc.imaging.decode import decode
from visenc.models.base import VisionTower
from visenc.models.loading import load_tower
from visenc_client import AsyncClient, ImagePlacement, RowRange, Video, plan_chunk
from visenc_client.format import video_hash

W, H = 120, 90


def frames(first: int, count: int, width: int = W, height: int = H) -> list[bytes]:
    """Frames ``first ...`` of one synthetic stream (frame ``i`` is always the same picture)."""
    return [png_bytes(1000 + i, width, height) for i in range(first, first + count)]


def vid(fs: list[bytes]) -> str:
    return video_hash([hashlib.sha256(f).hexdigest() for f in fs])


def reference(tower: VisionTower, fs: list[bytes]) -> np.ndarray:
    """The tower's rows for the clip, tube by tube (equal to the whole-video forward: golden tests)."""
    assert tower.video is not None
    clip = np.stack([np.asarray(decode(f, max_pixels=10**9)) for f in fs])
    tubes, grid = tower.video.tubes(clip)
    return np.concatenate([tower.forward([tower.tube_input(x, grid[1:])])[0].numpy() for x in tubes])


async def encode(client, items: list[dict], wait: bool = True, include_rows: bool = False) -> dict:
    body = msgpack.packb({"items": items, "wait": wait, "include_rows": include_rows})
    r = await client.post("/v1/encode", content=body, headers=MSGPACK)
    assert r.status_code == 200, r.text
    return msgpack.unpackb(r.content)


async def fetch(client, h: str, start: int | None = None, end: int | None = None) -> np.ndarray:
    params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    r = await client.get(f"/v1/embeddings/{h}", params=params)
    assert r.status_code == 200, r.text
    rows, hidden = map(int, r.headers["x-visenc-shape"].split(","))
    return np.frombuffer(r.content, dtype="<f4").reshape(rows, hidden)


async def encoded(client) -> float:
    return metric((await client.get("/metrics")).text, "visenc_encoded_images_total")


@pytest.mark.parametrize("count", [4, 5])
async def test_a_video_is_its_tubes_rows(service, tiny_tower, count):
    fs = frames(0, count)
    (item,) = (await encode(service, [{"frames": fs}]))["items"]
    grid = tiny_tower.video.grid(count, H, W)
    assert item["status"] == "ready" and item["hash"] == vid(fs)
    assert tuple(item["grid_thw"]) == grid and len(item["tubes"]) == grid[0] == (count + 1) // 2
    ref = reference(tiny_tower, fs)
    assert item["num_tokens"] == ref.shape[0]
    np.testing.assert_array_equal(await fetch(service, item["hash"]), ref)
    per_tube = ref.shape[0] // grid[0]
    for i, tube in enumerate(item["tubes"]):
        np.testing.assert_array_equal(await fetch(service, tube), ref[i * per_tube : (i + 1) * per_tube])
    np.testing.assert_array_equal(
        await fetch(service, item["hash"], per_tube - 3, per_tube + 5), ref[per_tube - 3 : per_tube + 5]
    )


async def test_overlapping_clips_encode_only_their_new_tubes(service, tiny_tower):
    await encode(service, [{"frames": frames(0, 8)}])
    before = await encoded(service)
    slid = frames(2, 8)  # the window advanced by one tube: three tubes shared, one new
    (item,) = (await encode(service, [{"frames": slid}]))["items"]
    assert (await encoded(service)) - before == 1
    np.testing.assert_array_equal(await fetch(service, item["hash"]), reference(tiny_tower, slid))
    grown = frames(0, 10)  # the first clip grown by two frames
    (item,) = (await encode(service, [{"frames": grown}]))["items"]
    assert (await encoded(service)) - before == 1  # frames 8-9 are the window's new tube
    again = (await encode(service, [{"frames": frames(0, 8)}]))["items"][0]
    assert again["status"] == "ready" and (await encoded(service)) - before == 1
    odd = frames(1, 8)  # an odd shift pairs other frames: nothing shared
    await encode(service, [{"frames": odd}])
    assert (await encoded(service)) - before == 5


async def test_a_video_is_found_by_its_hash_alone(service, tiny_tower):
    """Missing before, then pending (at once, without waiting) or ready: a look-up that waits gets
    it ready, as the connector's waiting look-up must (it then loads the rows)."""
    fs = frames(20, 4)
    (missing,) = (await encode(service, [{"hash": vid(fs)}]))["items"]
    assert missing["status"] == "missing"
    (started,) = (await encode(service, [{"frames": fs}], wait=False))["items"]
    (asked,) = (await encode(service, [{"hash": vid(fs)}], wait=False))["items"]  # tubes may be encoding
    assert asked["status"] in ("pending", "ready") and asked["num_tokens"] == started["num_tokens"]
    assert asked["grid_thw"] == started["grid_thw"]
    waited = (await encode(service, [{"hash": vid(fs)}], wait=True))["items"][0]  # waits for the tubes
    assert waited["status"] == "ready" and waited["num_tokens"] == started["num_tokens"]
    (hit,) = (await encode(service, [{"hash": vid(fs)}], include_rows=True))["items"]
    assert hit["status"] == "ready" and tuple(hit["grid_thw"]) == tiny_tower.video.grid(4, H, W)
    rows = np.frombuffer(hit["rows"], dtype="<f4").reshape(hit["num_tokens"], -1)
    np.testing.assert_array_equal(rows, reference(tiny_tower, fs))


async def test_a_video_and_its_frames_as_images_do_not_share_rows(service, tiny_tower):
    fs = frames(40, 2)
    items = (await encode(service, [{"frames": fs}, {"data": fs[0]}, {"frames": [fs[0], fs[0]]}]))["items"]
    assert [it["status"] for it in items] == ["ready"] * 3
    video, image, still = items
    assert image["hash"] not in video["tubes"]
    # a still clip is sized by the video processor's settings, not the image processor's: its own key
    assert still["hash"] != image["hash"] and still["tubes"][0] != image["hash"]
    np.testing.assert_array_equal(await fetch(service, still["hash"]), reference(tiny_tower, [fs[0], fs[0]]))


async def test_bad_videos_are_per_item_errors(service):
    big = frames(60, 1, 64, 64)
    cases = {
        "two sizes": ({"frames": [*frames(50, 1), *big]}, "invalid_video"),
        "no frames": ({"frames": []}, "invalid_video"),
        "both": ({"frames": frames(50, 2), "data": big[0]}, "invalid_video"),
        "corrupt frame": ({"frames": [frames(50, 1)[0], b"not an image"]}, "invalid_image"),
        "wrong hash": ({"frames": frames(50, 2), "hash": "0" * 64}, "hash_mismatch"),
    }
    items = (await encode(service, [c for c, _ in cases.values()]))["items"]
    for name, ((_, reason), item) in zip(cases, zip(cases.values(), items)):
        assert item["status"] == "error" and item["reason"] == reason, (name, item)
    assert (await service.get("/readyz")).status_code == 200
    (ok,) = (await encode(service, [{"frames": frames(50, 2)}]))["items"]
    assert ok["status"] == "ready"


async def test_video_limits(tiny_tower):
    async with running_app(tiny_tower, max_video_frames=4, max_video_pixels=3 * W * H) as client:
        items = (await encode(client, [{"frames": frames(0, 5)}, {"frames": frames(0, 4)}]))["items"]
        assert [it.get("reason") for it in items] == ["image_too_large", "image_too_large"]
        assert "max_video_frames=4" in items[0]["error"] and "max_video_pixels" in items[1]["error"]


async def test_a_tower_without_a_video_processor_refuses_videos():
    async with running_app(load_tower("tiny-clip")) as client:
        (item,) = (await encode(client, [{"frames": frames(0, 2)}]))["items"]
        assert item["status"] == "error" and item["reason"] == "invalid_video"


async def test_the_client_encodes_videos_hash_first(service, tiny_tower):
    fs = frames(70, 6)
    transport = httpx.ASGITransport(app=service.app)
    async with AsyncClient("http://visenc", transport=transport) as vc:
        (first,) = await vc.encode([Video(fs)])
        assert first.status == "ready" and first.hash == vid(fs) and first.tubes is not None
        before = await encoded(service)
        (again,) = await vc.encode([Video(fs)])  # the hash alone answers: nothing is uploaded
        assert again.status == "ready" and await encoded(service) == before
        ref = reference(tiny_tower, fs)
        np.testing.assert_array_equal(await vc.fetch(first), ref)
        per_tube = first.num_tokens // len(first.tubes)
        parts = await vc.fetch_many([RowRange(t) for t in first.tubes[1:]])
        np.testing.assert_array_equal(np.concatenate(parts), ref[per_tube:])
        placement = ImagePlacement.of(first, offset=3)
        end = 3 + per_tube + 5  # a prefill chunk over the first tube and part of the second
        plan = plan_chunk([placement], 0, end)
        assert [(p.hash, p.start, p.end) for p in plan.pieces] == [
            (first.tubes[0], 0, per_tube),
            (first.tubes[1], 0, 5),
        ]
        np.testing.assert_array_equal(await vc.fetch_chunk([placement], 0, end), ref[: per_tube + 5])
        later = await vc.fetch_chunk([placement], end, 3 + first.num_tokens)  # the next chunk: the rest
        np.testing.assert_array_equal(later, ref[per_tube + 5 :])


async def test_videos_through_shared_memory(tiny_tower, tmp_path):
    """Same-host segments: a video by its hash, and a prefill chunk over it (tube by tube)."""
    async with running_app(tiny_tower, shm_enabled=True, shm_dir=str(tmp_path)) as client:
        fs = frames(80, 4)
        transport = httpx.ASGITransport(app=client.app)
        async with AsyncClient("http://visenc", transport=transport, shared_memory=True) as vc:
            (h,) = await vc.encode([Video(fs)])
            ref = reference(tiny_tower, fs)
            np.testing.assert_array_equal(await vc.fetch(h), ref)
            chunk = await vc.fetch_chunk([ImagePlacement.of(h, 0)], 0, h.num_tokens)
            np.testing.assert_array_equal(chunk, ref)


async def test_a_request_of_images_never_touches_video_code(service, monkeypatch):
    """Every entry into video code trips a wire: images encoded (bytes, then hashes), waited for or not,
    and fetched never touch it; a video request (the control) does."""
    touched: list[str] = []

    def wire(name: str):
        def tripped(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"{name} ran")

        return tripped

    for owner, name in [
        (videos.Videos, "request"),
        (videos, "expand"),
        (videos, "fold"),
        (videos, "manifests"),
        (videos.Videos, "outcome"),
        (videos.Videos, "tubes"),
        (videos.Videos, "joined"),
        (videos, "tube_hashes"),
        (videos.Joins, "rows"),
    ]:
        monkeypatch.setattr(owner, name, wire(name))
    datas = [png_bytes(1500 + i, 64 + 28 * i, 64) for i in range(3)]
    first = await encode(service, [{"data": d} for d in datas])
    assert [it["status"] for it in first["items"]] == ["ready"] * 3
    for wait in (False, True):
        again = await encode(service, [{"hash": it["hash"]} for it in first["items"]], wait=wait)
        assert [it["status"] for it in again["items"]] == ["ready"] * 3
    for it in first["items"]:
        assert (await fetch(service, it["hash"])).shape[0] == it["num_tokens"]
    assert touched == []
    with pytest.raises(AssertionError):
        await encode(service, [{"frames": frames(0, 4)}])
    assert touched == ["request"]
