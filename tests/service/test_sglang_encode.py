"""SGLang's encoder endpoints (``/encode``, ``/scheduler_receive_url``, ``/health``), in-process:
what the receivers get, every refusal in SGLang's error shape, the service healthy after each.

Frame 0 is read here with a stand-in of SGLang's restricted unpickler (the three globals it names,
mapped to local classes); ``tests/with_sglang/test_sglang_epd.py`` reads it with SGLang's own code.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from harness.images import png_bytes
from tests.support.api import fetch_rows, running_app

from visenc.epd import EMBEDDING_DATA, MODALITY
from visenc_client.format import image_hash


class _Unpickler(pickle.Unpickler):
    """Admits only what SGLang's ``safe_pickle_loads`` admits of frame 0: the part, the modality, dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == EMBEDDING_DATA:
            return SimpleNamespace
        if (module, name) == MODALITY:
            return lambda value: {1: "IMAGE", 2: "VIDEO", 3: "AUDIO"}[value]
        if module == "torch" and name in ("float32", "float16", "bfloat16"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not admitted")


def frame0(data: bytes) -> SimpleNamespace:
    return _Unpickler(io.BytesIO(data)).load()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def part(req_id: str, items: list[Any], **extra: Any) -> dict[str, Any]:
    return {"req_id": req_id, "num_parts": 1, "part_idx": 0, "mm_items": items, "modality": "IMAGE", **extra}


class Receiver:
    """A scheduler rank's PULL socket."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.PULL)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"127.0.0.1:{self.port}"

    async def next(self, timeout_s: float = 30) -> list[bytes]:
        return await asyncio.wait_for(self.socket.recv_multipart(), timeout_s)


@pytest.fixture
async def zmq_context():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_a_part_reaches_every_registered_rank(tiny_tower, zmq_context):
    images = [png_bytes(950, 70, 50), png_bytes(951, 40, 90)]
    ranks = [Receiver(zmq_context), Receiver(zmq_context)]
    async with running_app(tiny_tower) as client:
        await client.post(
            "/scheduler_receive_url", json={"req_id": "a", "receive_count": 2, "receive_url": ranks[0].url}
        )
        encode = asyncio.ensure_future(client.post("/encode", json=part("a", [data_url(d) for d in images])))
        r = await client.post(
            "/scheduler_receive_url", json={"req_id": "a", "receive_count": 2, "receive_url": ranks[1].url}
        )
        assert r.status_code == 200 and r.json() is None
        r = await encode
        assert r.status_code == 200 and r.json() is None
        for rank in ranks:
            header, body = await rank.next()
            got = frame0(header)
            assert (got.req_id, got.num_parts, got.part_idx, got.modality) == ("a", 1, 0, "IMAGE")
            assert got.error_msg is None and got.dtype == "float32"
            handles = (
                await client.post("/v1/encode", json={"items": [{"hash": image_hash(d)} for d in images]})
            ).json()
            assert got.grid_dim == [h["grid_thw"] for h in handles["items"]]
            assert got.shape == [sum(h["num_tokens"] for h in handles["items"]), tiny_tower.hidden_size]
            want = np.concatenate([await fetch_rows(client, image_hash(d)) for d in images])
            np.testing.assert_array_equal(np.frombuffer(body, np.float32).reshape(want.shape), want)


async def test_an_embedding_port_names_the_receiver(tiny_tower, zmq_context):
    """``zmq_to_tokenizer``: the part goes to ``prefill_host:embedding_port``, no registration."""
    rank = Receiver(zmq_context)
    async with running_app(tiny_tower) as client:
        body = part("t", [data_url(png_bytes(952, 30, 30))], prefill_host="127.0.0.1", embedding_port=rank.port)
        assert (await client.post("/encode", json=body)).status_code == 200
        header, _ = await rank.next()
        assert frame0(header).req_id == "t"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not valid JSON"),
        (part("p", []), 400, "mm_items"),
        ({**part("p", ["AAAA"]), "part_idx": 1}, 400, "part_idx must be in [0, 1)"),
        (part("p", ["AAAA"], modality="VIDEO"), 400, "visenc encodes images"),
        (part("p", ["file:///etc/passwd"]), 400, "must be a data: URL"),
        (part("p", ["https://example.com/cat.png"]), 400, "not allowed"),
        (part("p", [{"url": "AAAA", "content_hash": "sha256:xyz"}]), 400, "content_hash must use"),
        (part("p", ["%%%"]), 400, "not valid base64"),
        (part("p", [data_url(b"GIF89a but not really")]), 400, "image 0 of the part"),
    ],
    ids=["json", "no-items", "part-idx", "video", "file", "url", "hash-form", "base64", "not-an-image"],
)
async def test_bad_parts_get_sglangs_error_shape_and_the_service_stays_healthy(tiny_tower, body, status, words):
    async with running_app(tiny_tower) as client:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await client.post("/encode", **kwargs)
        assert r.status_code == status
        answer = r.json()
        assert answer["status"] == "error" and words in answer["message"]
        assert answer["req_id"] == (None if isinstance(body, bytes) else body["req_id"])
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200


async def test_a_failed_part_tells_its_registered_ranks(tiny_tower, zmq_context):
    rank = Receiver(zmq_context)
    async with running_app(tiny_tower) as client:
        await client.post("/scheduler_receive_url", json={"req_id": "e", "receive_count": 1, "receive_url": rank.url})
        r = await client.post("/encode", json=part("e", [data_url(b"not an image")]))
        assert r.status_code == 400
        (header,) = await rank.next()
        got = frame0(header)
        assert got.error_code == 400 and "image 0 of the part" in got.error_msg and got.shape is None


async def test_receivers_that_never_register_end_the_part_with_504(tiny_tower, zmq_context):
    rank = Receiver(zmq_context)
    async with running_app(tiny_tower, sglang_register_timeout_s=0.3) as client:
        await client.post("/scheduler_receive_url", json={"req_id": "w", "receive_count": 2, "receive_url": rank.url})
        r = await client.post("/encode", json=part("w", [data_url(png_bytes(953, 20, 20))]))
        assert r.status_code == 504 and "1 receiver(s) registered" in r.json()["message"]
        (header,) = await rank.next()  # the rank that did register hears of it
        assert frame0(header).error_code == 504
        metrics = (await client.get("/metrics")).text
        assert 'visenc_sglang_parts_total{outcome="failed"} 1.0' in metrics


async def test_an_inconsistent_receive_count_is_refused(tiny_tower):
    async with running_app(tiny_tower) as client:
        ok = {"req_id": "c", "receive_count": 2, "receive_url": "127.0.0.1:1"}
        assert (await client.post("/scheduler_receive_url", json=ok)).status_code == 200
        r = await client.post("/scheduler_receive_url", json={**ok, "receive_count": 3, "receive_url": "127.0.0.1:2"})
        assert r.status_code == 400 and "inconsistent receive_count" in r.json()["message"]


async def test_a_receiver_that_is_gone_fails_delivery_not_the_service(tiny_tower):
    async with running_app(tiny_tower) as client:
        epd = client.app.state.epd  # type: ignore[attr-defined]
        epd.pusher.timeout_s = 0.3
        body = part("g", [data_url(png_bytes(954, 20, 20))], prefill_host="127.0.0.1", embedding_port=9)
        r = await client.post("/encode", json=body)
        assert r.status_code == 502 and "could not deliver" in r.json()["message"]
        assert (await client.get("/health")).status_code == 200


async def test_with_api_keys_sglang_is_served_only_in_a_named_namespace(tiny_tower, zmq_context):
    key = "k" * 20
    body = part("n", [data_url(png_bytes(955, 20, 20))])
    async with running_app(tiny_tower, api_keys=f"{key}:team") as client:
        r = await client.post("/encode", json=body)
        assert r.status_code == 403 and "--sglang-namespace" in r.json()["message"]
    rank = Receiver(zmq_context)
    async with running_app(tiny_tower, api_keys=f"{key}:team", sglang_namespace="team") as client:
        body = {**body, "prefill_host": "127.0.0.1", "embedding_port": rank.port}
        assert (await client.post("/encode", json=body)).status_code == 200
        await rank.next()
        auth = {"Authorization": f"Bearer {key}"}  # the entry is the tenant's
        h = image_hash(base64.b64decode(body["mm_items"][0].split(",", 1)[1]))
        assert (await client.get(f"/v1/embeddings/{h}", headers=auth)).status_code == 200


async def test_a_part_over_max_items_is_refused(tiny_tower):
    async with running_app(tiny_tower, max_items=2) as client:
        r = await client.post("/encode", json=part("m", ["AAAA"] * 3))
        assert r.status_code == 413 and "max_items=2" in r.json()["message"]


@pytest.mark.parametrize("loader", ["vllm", "sglang"])
async def test_an_image_sglang_loads_otherwise_is_refused_unless_visenc_loads_as_sglang(
    tiny_tower, zmq_context, loader
):
    """With another ``--image-loader`` than ``sglang``, a rotated photo (its rows would be of the
    upright picture, SGLang's of the stored one) is refused, even by hash; an ordinary one is served."""
    from tests.support.odd_images import corpus

    from visenc.models.loading import load_tower

    files = corpus()
    rotated, plain = files["jpeg-exif-orientation-6"], files["jpeg-exif-orientation-1"]
    rank = Receiver(zmq_context)
    where = {"prefill_host": "127.0.0.1", "embedding_port": rank.port}
    tower = tiny_tower if loader == "vllm" else load_tower("tiny-qwen2-vl", image_loader=loader)
    async with running_app(tower, image_loader=loader) as client:
        await client.post("/v1/encode", json={"items": [{"data": base64.b64encode(rotated).decode()}]})
        by_hash = {"url": data_url(rotated), "content_hash": "sha256:" + image_hash(rotated)}
        for item in (data_url(rotated), by_hash):
            r = await client.post("/encode", json=part("x", [item], **where))
            if loader == "vllm":
                assert r.status_code == 400 and "--image-loader sglang" in r.json()["message"]
            else:
                assert r.status_code == 200
                await rank.next()
        assert (await client.post("/encode", json=part("y", [data_url(plain)], **where))).status_code == 200
        await rank.next()
