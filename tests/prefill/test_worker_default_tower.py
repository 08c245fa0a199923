"""Chunked prefill with image rows from a real ``visenc serve`` (embedded tiny-qwen2-vl tower)
reproduces the full Qwen2-VL model's own forward (its built-in vision path)."""

from __future__ import annotations

import copy

import httpx
import msgpack
import numpy as np
import pytest
import torch
from harness.images import png_bytes
from harness.processes import serve_process
from tests.prefill.reference import (
    ATOL,
    full_model_reference,
    max_abs_diff,
    prompt_and_images,
    splits_an_image,
)
from transformers import Qwen2VLImageProcessor  # the fast (torchvision) processors: the default backend

from examples.qwen2vl_prefill import IMAGE_TOKEN_ID, NoVisionTower, build_tiny_vlm, chunked_prefill
from visenc_client import Client, ImageEncodeError
from visenc_client.prefill import VisencPrefill

CHUNKS = (7, 16, 45)  # every one of them cuts through at least one image


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_process("--max-wait-ms", "2", log=tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def full_model(tiny_tower):
    """The full VLM whose vision tower is exactly the one visenc builds by default."""
    model = build_tiny_vlm(tiny_tower.model.config.to_dict(), seed=1)
    model.model.visual.load_state_dict(tiny_tower.model.state_dict())
    return model


@pytest.fixture(scope="module")
def reference(full_model, tiny_tower):
    processor = Qwen2VLImageProcessor(**tiny_tower.settings.processor_kwargs())
    return full_model_reference(full_model, processor, *prompt_and_images())


@pytest.fixture(scope="module")
def worker_model(full_model):
    """The prefill worker's model: the same language model, no vision tower at all."""
    model = copy.deepcopy(full_model)
    model.model.visual = NoVisionTower()
    assert not [n for n, _ in model.named_parameters() if "visual" in n]
    return model


@pytest.mark.parametrize("chunk", [*CHUNKS, 10_000])
def test_chunked_prefill_equals_full_model_forward(server, worker_model, reference, chunk):
    # a namespace per case: every case encodes its images afresh (laid out while pending)
    with Client(server, namespace=f"chunk-{chunk}") as vc:
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
        layout = prefill.prepare(reference.prompt, reference.images)
        assert np.array_equal(layout.input_ids, reference.input_ids[0].numpy())  # the processor's expansion
        spans = [(p.offset, p.num_tokens) for p in layout.placements]
        assert len({n for _, n in spans}) == 3  # three resolutions, three token counts
        if chunk in CHUNKS:
            assert splits_an_image(spans, chunk)
        logits = chunked_prefill(worker_model, prefill, layout, chunk)
    assert logits.shape == reference.logits.shape
    assert max_abs_diff(logits, reference.logits) <= ATOL


def test_the_comparison_sees_image_rows(server, worker_model, reference):
    """Negative control: leaving the placeholder embeddings in place changes the logits far beyond ATOL."""
    with Client(server) as vc:
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
        layout = prefill.prepare(reference.prompt, reference.images)
        prefill.fill_chunk = lambda *args: None  # type: ignore[method-assign]
        logits = chunked_prefill(worker_model, prefill, layout, 16)
    assert max_abs_diff(logits, reference.logits) > 100 * ATOL


class Recorder(httpx.HTTPTransport):
    """An HTTP transport that keeps (method, path, msgpack body) of every request."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = msgpack.unpackb(request.content) if request.content else {}
        self.calls.append((request.method, request.url.path, body))
        return super().handle_request(request)


def test_one_round_trip_per_chunk_for_the_overlapping_rows_only(server, worker_model, reference):
    recorder = Recorder()
    with Client(server, namespace="recorded", transport=recorder) as vc:
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
        layout = prefill.prepare(reference.prompt, reference.images)
        encodes = [body for _, path, body in recorder.calls if path == "/v1/encode"]
        assert encodes[0]["wait"] is False and all(set(it) == {"hash"} for it in encodes[0]["items"])
        assert all(body["wait"] is False for body in encodes)  # uploads of the misses do not wait either
        recorder.calls.clear()
        chunk = 16
        chunked_prefill(worker_model, prefill, layout, chunk)
    fetches = [body["ranges"] for _, path, body in recorder.calls if path == "/v1/embeddings/fetch"]
    assert len(fetches) == len(recorder.calls)  # nothing but chunk fetches during the prefill
    expected = []
    for start in range(0, layout.num_positions, chunk):
        end = min(start + chunk, layout.num_positions)
        ranges = [  # each read names the lease its handle carries, so that the read releases its pin
            {"hash": p.hash, "start": max(start, p.offset) - p.offset, "end": min(end, p.end) - p.offset}
            | ({"lease": p.image.lease} if getattr(p.image, "lease", None) else {})
            for p in layout.placements
            if p.offset < end and p.end > start
        ]
        if ranges:
            expected.append(ranges)
    assert fetches == expected


def test_fill_through_a_staging_buffer_for_other_dtypes(server, reference):
    """A buffer the fetch cannot write in place (float64 numpy, bfloat16 torch) gets the same rows, converted."""
    with Client(server) as vc:
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
        layout = prefill.prepare(reference.prompt, reference.images)
        start, end = 10, 60
        direct = np.full((end - start, 256), 7.0, dtype=np.float32)
        prefill.fill_chunk(layout, start, end, direct)
        wide = np.full((end - start, 256), 7.0, dtype=np.float64)
        prefill.fill_chunk(layout, start, end, wide)
        half = torch.full((end - start, 256), 7.0, dtype=torch.bfloat16)
        prefill.fill_chunk(layout, start, end, half)
    image = layout.image_positions(start, end)
    text = np.setdiff1d(np.arange(end - start), image)
    assert image.size and text.size
    assert (direct[text] == 7.0).all() and not (direct[image] == 7.0).all()
    np.testing.assert_array_equal(wide, direct.astype(np.float64))
    assert torch.equal(half, torch.from_numpy(direct).to(torch.bfloat16))


def test_a_bad_image_fails_the_request_at_prepare(server):
    with Client(server) as vc:
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID)
        with pytest.raises(ImageEncodeError) as failed:
            prefill.prepare([5, IMAGE_TOKEN_ID, 6], [b"not an image"])
        assert failed.value.reason == "invalid_image"
        with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
            prefill.prepare([IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], [png_bytes(1, 64, 64)])
