"""visenc as SGLang's encoder server (``--encoder-urls``), driven and read by SGLang's own code.

A real ``visenc serve`` (tiny Qwen2-VL and Qwen3-VL checkpoints, ``--image-loader sglang``) gets
exactly the requests SGLang 0.5.23's language server makes: ``/encode`` parts from
``MMReceiverHTTP.encode`` (its item split across encoder URLs included) and receive-URL
registrations from ``WaitingZmqRequest.send_encode_request`` (one per tensor-parallel rank).
Each rank's pushes are read as ``WaitingZmqRequest`` reads them: ``safe_pickle_loads`` (SGLang's
restricted unpickler), ``_embedding_part_matches_request``, ``_extract_embedding_from_buffer`` and
``_aggregate_embedding_part``; the request's embedding and grid are what the scheduler then
assembles (``get_embedding(is_concat=True)``, ``get_mm_extra_meta()``).

Checked: the embedding is bit-identical to visenc's own rows for the images, in order; the grid is
the checkpoint's processor's ``image_grid_thw`` for SGLang's loading of each image, and the rows
are as many as SGLang's placeholders; both ranks get it; registrations before and after
``/encode``; a request split into parts over two encoder URLs; an image given by content hash
alone costs no download; errors reach SGLang as it expects (the dispatch error, and an error part
on the ranks). What SGLang code cannot run here: its GPU embedding pool (``embedding_pool=None``,
SGLang's CPU path) and its scheduler loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang", reason="needs SGLang in the engines' environment (make sglang)")

import httpx
import torch
import zmq
from harness.images import noise, save
from harness.processes import serve_subprocess
from harness.waits import metric, until
from PIL import Image
from sglang.srt.disaggregation.encoder.receiver import (
    MMReceiverBase,
    MMReceiverHTTP,
    WaitingZmqRequest,
    _aggregate_embedding_part,
    _embedding_part_matches_request,
)
from sglang.srt.managers.io_struct import EncoderDispatchErrorReq
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.utils.common import safe_pickle_loads
from transformers import AutoImageProcessor

from visenc_client import Client, image_hash

sys.path.insert(0, str(Path(__file__).parent.parent / "with_vllm"))
import tiny_vlm

RNG = np.random.default_rng(23)


def png(width: int, height: int) -> bytes:
    return save(Image.fromarray(noise(RNG, width, height), "RGB"), "PNG")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def encoder(request, tmp_path_factory) -> Any:
    """(visenc's URL, the checkpoint, the model type) for a running ``visenc serve``."""
    path = tiny_vlm.build(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param)
    logs = tmp_path_factory.mktemp("logs")
    args = ("--model", str(path), "--image-loader", "sglang", "--max-wait-ms", "1")
    with serve_subprocess(*args, "--sglang-register-timeout-s", "20", log=logs / "visenc.log") as (url, _):
        yield SimpleNamespace(url=url, path=path, model_type=request.param)


class Rank:
    """One scheduler rank's receive socket, read as ``WaitingZmqRequest`` reads it."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.PULL)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")

    def receive(self, rid: str, model_type: str, timeout_s: float = 60) -> Any:
        """The aggregated embedding data of request ``rid`` once every part arrived, or the first error part."""
        aggregate = None
        while aggregate is None or not aggregate.ready:
            if not self.socket.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no part of {rid} within {timeout_s} s")
            parts = self.socket.recv_multipart(copy=False)
            received = safe_pickle_loads(parts[0])
            assert _embedding_part_matches_request(received, rid)
            if received.error_msg is not None:
                return received
            WaitingZmqRequest._extract_embedding_from_buffer(None, received, parts)
            aggregate = _aggregate_embedding_part(aggregate, received, model_type)
        return aggregate


async def sglang_request(
    urls: list[str], rid: str, items: list[dict], ranks: list[Rank], *, register_first: bool, metrics_url: str
) -> Any:
    """What SGLang's language server does for one request: ``/encode`` its parts and register each
    rank's receive URL (before the parts reach the encoders, or once they wait there). Returns
    ``MMReceiverHTTP.encode``'s result (``None``, or the dispatch error)."""
    mm_data = [{"modality": Modality.IMAGE, **item} for item in items]  # as _extract_url_data makes them
    assigned = MMReceiverBase._assign_items_by_modality(None, mm_data, len(urls), random_shuffle=False)
    registrations: list[asyncio.Future] = []

    async def register() -> None:
        for rank in ranks:  # each rank registers its own receive URL, expecting len(ranks) of them
            waiting = SimpleNamespace(
                num_items_assigned=assigned,
                encoder_urls=urls,
                recv_req=SimpleNamespace(rid=rid),
                receive_count=len(ranks),
                host_name="127.0.0.1",
                embedding_port=rank.port,
                _start_registration=lambda coroutine: registrations.append(asyncio.ensure_future(coroutine)),
            )
            WaitingZmqRequest.send_encode_request(waiting)
        await asyncio.gather(*registrations)

    if register_first:
        await register()
    receiver = SimpleNamespace(host="127.0.0.1", encode_urls=urls)
    encode = asyncio.ensure_future(MMReceiverHTTP.encode(receiver, rid, mm_data, None, "encode", assigned))
    if not register_first:
        await until_waiting(metrics_url, sum(1 for n in assigned[Modality.IMAGE] if n))
        await register()
    return await encode


async def until_waiting(url: str, parts: int) -> None:
    """Until visenc holds ``parts`` encoded parts waiting for their receivers."""
    async with httpx.AsyncClient() as client:

        async def waiting() -> bool:
            return metric((await client.get(url + "/metrics")).text, "visenc_sglang_parts_waiting") >= parts

        await until(waiting, timeout_s=60, what=f"{parts} parts wait for their receivers")


def expected(encoder: Any, datas: list[bytes]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(visenc's own rows for ``datas`` concatenated, the processor's ``image_grid_thw`` for them as
    SGLang loads them, SGLang's placeholder count)."""
    with Client(encoder.url) as client:
        client.encode(datas)
        rows = [torch.from_numpy(np.array(client.fetch(image_hash(d)))) for d in datas]
    processor = AutoImageProcessor.from_pretrained(str(encoder.path))
    images = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
    grid = processor(images=images, return_tensors="pt")["image_grid_thw"]
    tokens = int(grid.prod(-1).sum()) // processor.merge_size**2
    return torch.cat(rows), grid, tokens


@pytest.mark.parametrize("register_first", [True, False], ids=["registered-before", "registered-after"])
def test_two_parts_two_ranks_bit_identical(encoder: Any, register_first: bool) -> None:
    datas = [png(97, 61), png(64, 130), png(200, 90)]
    context = zmq.Context()
    ranks = [Rank(context), Rank(context)]
    rid = f"req-{register_first}"
    try:
        result = asyncio.run(
            sglang_request(
                [encoder.url, encoder.url],  # two encoder URLs: the request is split into two parts
                rid,
                [{"url": data_url(d)} for d in datas],
                ranks,
                register_first=register_first,
                metrics_url=encoder.url,
            )
        )
        assert result is None
        want_rows, want_grid, tokens = expected(encoder, datas)
        for rank in ranks:
            got = rank.receive(rid, encoder.model_type)
            assert got.num_parts == 2 and got.ready
            embedding = got.get_embedding(is_concat=True)[Modality.IMAGE]
            assert embedding.shape == (tokens, want_rows.shape[1]) and embedding.dtype == want_rows.dtype
            assert torch.equal(embedding, want_rows)  # bit for bit, in item order across the parts
            assert torch.equal(got.get_mm_extra_meta()["img_grid_thw"], want_grid)
    finally:
        context.destroy(linger=0)


def test_an_image_given_by_content_hash_is_not_downloaded(encoder: Any) -> None:
    """SGLang's ``mm_content_hashes``: an image visenc holds is served from its hash; the URL (one
    visenc may not fetch) is never read."""
    data = png(77, 55)
    with Client(encoder.url) as client:
        client.encode([data])
    context = zmq.Context()
    rank = Rank(context)
    item = {"url": "http://images.invalid/never-fetched.png", "content_hash": "sha256:" + image_hash(data)}
    try:
        result = asyncio.run(
            sglang_request([encoder.url], "by-hash", [item], [rank], register_first=True, metrics_url=encoder.url)
        )
        assert result is None
        got = rank.receive("by-hash", encoder.model_type)
        want_rows, _, _ = expected(encoder, [data])
        assert torch.equal(got.get_embedding(is_concat=True)[Modality.IMAGE], want_rows)
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}, "unrecognised"),
        ({"url": "http://images.invalid/cat.png"}, "not allowed"),
        (
            {"url": "data:image/png;base64,AAAA", "content_hash": "sha256:" + hashlib.sha256(b"x").hexdigest()},
            "content hash mismatch",
        ),
        ({"url": "data:image/png;base64,AAAA", "detail": "high"}, "per-image options"),
    ],
    ids=["not-an-image", "url-not-allowed", "hash-mismatch", "per-image-option"],
)
def test_a_bad_item_fails_its_request_as_sglang_expects(encoder: Any, item: dict, words: str) -> None:
    context = zmq.Context()
    rank = Rank(context)
    rid = f"bad-{words}"
    try:
        result = asyncio.run(
            sglang_request([encoder.url], rid, [item], [rank], register_first=True, metrics_url=encoder.url)
        )
        assert isinstance(result, EncoderDispatchErrorReq) and result.rid == rid
        assert words in result.error_msg and 400 <= result.error_code < 500
        part = rank.receive(rid, encoder.model_type, timeout_s=10)  # the rank stops waiting too
        assert words in part.error_msg and part.embedding is None
    finally:
        context.destroy(linger=0)
    assert httpx.get(encoder.url + "/health").status_code == 200


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_frame_zero_is_what_sglangs_encoder_pickles(dtype: str) -> None:
    """visenc writes frame 0 itself (no SGLang import): SGLang's unpickler reads it as the object
    its own encoder pickles (``EmbeddingData(...).copy_without_embedding()``), attribute for
    attribute; an error part likewise. A new attribute in SGLang's class fails this."""
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData

    from visenc.epd import embedding_data_frame

    grid = [[1, 4, 6], [1, 8, 2]]
    embedding = torch.zeros(10, 24, dtype=getattr(torch, dtype))
    theirs = EmbeddingData("r_local_part_1", 2, 1, torch.tensor(grid), Modality.IMAGE, embedding)
    ours = embedding_data_frame("r_local_part_1", 2, 1, grid=grid, dtype=dtype, shape=[10, 24])
    got, want = vars(safe_pickle_loads(ours)), vars(safe_pickle_loads(pickle.dumps(theirs.copy_without_embedding())))
    assert list(got) == list(want)
    assert torch.equal(torch.as_tensor(got.pop("grid_dim")), want.pop("grid_dim"))
    assert got == want
    error = EmbeddingData("r", 1, 0, None, Modality.IMAGE, error_msg="bad image", error_code=400)
    got = vars(safe_pickle_loads(embedding_data_frame("r", 1, 0, error_msg="bad image", error_code=400)))
    assert got == vars(safe_pickle_loads(pickle.dumps(error.copy_without_embedding())))


def test_qwen3_vl_rows_hold_the_deepstack_features_as_sglang_splits_them(encoder: Any) -> None:
    """SGLang's Qwen3-VL vision model concatenates ``[main] + deepstack`` on the last dimension and
    ``separate_deepstack_embeds`` splits it at the text hidden size: the width visenc sends."""
    if encoder.model_type != "qwen3_vl":
        pytest.skip("deepstack rows are Qwen3-VL's")
    import json

    config = json.loads((encoder.path / "config.json").read_text())
    vision = config["vision_config"]
    with Client(encoder.url) as client:
        width = client.model()["hidden_size"]
    assert vision["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert width == vision["out_hidden_size"] * (1 + len(vision["deepstack_visual_indexes"]))


def test_the_prefix_cache_keys_an_image_by_its_visenc_hash(encoder: Any) -> None:
    """SGLang's prefix-cache key of an image (its ``MultimodalDataItem`` pad values), both ways SGLang
    makes it: from the caller's ``mm_hashes`` (``request_fields``: visenc's hash, of which SGLang
    keeps the low 64 bits), and from the rows visenc pushed (the ``zmq_to_scheduler`` path: a hash
    of the embedding, equal for every delivery of an image)."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.schedule_batch import MultimodalDataItem

    from visenc_client.sglang import request_fields

    a, b = png(50, 40), png(40, 50)
    fields = request_fields([a, b])
    request = GenerateReqInput(text="<image><image>", image_data=[data_url(a), data_url(b)], **fields)
    request.normalize_batch_and_arguments()  # SGLang accepts the fields as given
    assert request.mm_content_hashes == ["sha256:" + image_hash(a), "sha256:" + image_hash(b)]

    def keyed(hex_hash: str) -> tuple[int, ...]:
        item = MultimodalDataItem(modality=Modality.IMAGE)
        item.set_hash(int(hex_hash, 16))  # as tokenizer_manager applies mm_hashes
        return item.padding_values()

    assert fields["mm_hashes"] == [image_hash(a), image_hash(b)]
    assert keyed(fields["mm_hashes"][0]) == keyed(request_fields([a])["mm_hashes"][0]) != keyed(fields["mm_hashes"][1])
    assert keyed(image_hash(a)) == keyed(image_hash(a)[-16:])  # SGLang's key: the hash's low 64 bits

    def delivered(data: bytes, rid: str) -> tuple[int, ...]:
        context = zmq.Context()
        rank = Rank(context)
        try:
            asyncio.run(
                sglang_request(
                    [encoder.url], rid, [{"url": data_url(data)}], [rank], register_first=True, metrics_url=encoder.url
                )
            )
            rows = rank.receive(rid, encoder.model_type).get_embedding(is_concat=True)[Modality.IMAGE]
        finally:
            context.destroy(linger=0)
        item = MultimodalDataItem(modality=Modality.IMAGE, precomputed_embeddings=rows)
        item.set_pad_value()
        return item.padding_values()

    assert delivered(a, "turn-1") == delivered(a, "turn-2") != delivered(b, "turn-3")
