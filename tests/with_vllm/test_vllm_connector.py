"""vLLM with ``visenc_client.vllm.VisencConnector``: token-identical to vLLM alone.

vLLM serves a copy of a tiny Qwen2-VL whose own vision tower is wrong (redrawn from another seed);
visenc serves the right checkpoint's tower. With the connector, vLLM produces the same tokens, and
logprobs within 1e-3, as vLLM alone on the right checkpoint: for prompts of 1 and 2 images, sizes
that need a resize included, with the pixels sent or only their grids, in one process and in
vLLM's default engine (engine core and worker in their own processes). Where the wrong copy encodes
the images itself (the same engine, the same prompts under uuids visenc never saw: ``--control``)
it gives other tokens, so the embeddings did come from visenc.

Runs in the vLLM environment (``make vllm``; ``make test-vllm`` runs this folder); each vLLM run is a
subprocess (``run_vllm.py``), as vLLM keeps process-wide state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.processes import serve_process
from harness.waits import free_port, wait_until
from tests.support import tiny_processors

from visenc_client import Client

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import run_vllm  # noqa: E402
import tiny_vlm  # noqa: E402
from openai_servers import chat  # noqa: E402
from vllm_forks import vllm_process, vllm_run, vllm_runs  # noqa: E402

ROOT = HERE.parent.parent
LOGPROB_ATOL = 1e-3


def same(a: list[dict], b: list[dict]) -> None:
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for ra, rb in zip(a, b):
        assert max(abs(x - y) for x, y in zip(ra["logprobs"], rb["logprobs"])) <= LOGPROB_ATOL


@pytest.fixture(scope="module")
def checkpoints(qwen2_vl) -> tuple[Path, Path]:
    return qwen2_vl


@pytest.fixture(scope="module")
def visenc(right_visenc) -> str:
    return right_visenc


@pytest.fixture(scope="module")
def reference(checkpoints) -> list[dict]:
    right, _ = checkpoints
    return vllm_run(right, "--in-process")


@pytest.fixture(scope="module")
def wrong_with_connector(checkpoints, visenc) -> dict[str, list[dict]]:
    """The wrong copy with the connector: the prompts (``RESULT``), then the same prompts under uuids
    visenc never saw (``CONTROL``: vLLM encodes them with its own, wrong, tower, as alone)."""
    _, wrong = checkpoints
    return vllm_runs(wrong, "--in-process", "--visenc", visenc, "--control")


def test_the_wrong_checkpoint_alone_differs(wrong_with_connector, reference):
    assert [r["tokens"] for r in wrong_with_connector["CONTROL"]] != [r["tokens"] for r in reference]


def test_connector_gives_the_right_checkpoints_tokens(wrong_with_connector, reference):
    same(wrong_with_connector["RESULT"], reference)


def test_grid_only_images_give_the_same_tokens(checkpoints, visenc, reference):
    """No pixels reach vLLM: each image is its ``image_grid_thw`` (from visenc) and its uuid. (The run
    ends with one prompt with pixels, the first prompt's images, in the same engine.)"""
    _, wrong = checkpoints
    got = vllm_run(wrong, "--in-process", "--visenc", visenc, "--grid-only")
    same(got[:-1], reference)
    same(got[-1:], reference[:1])


def test_connector_in_vllms_default_engine(checkpoints, visenc, reference):
    """Scheduler and worker halves of the connector in different processes (vLLM's default)."""
    _, wrong = checkpoints
    same(vllm_run(wrong, "--visenc", visenc), reference)


def test_a_visenc_serving_another_model_is_refused(checkpoints, tmp_path):
    _, wrong = checkpoints
    with serve_process("--model", "tiny-clip") as other:  # rows of 256, the model reads 128
        code, _, stderr = vllm_process(wrong, "--in-process", "--visenc", other)
    assert code != 0 and "serves another model" in stderr


def test_openai_server_behind_visenc_proxy(openai_pair, right_visenc):
    """``vllm serve`` on the wrong copy, with the connector, behind ``visenc proxy`` (which tags the data:
    URL images with their hash and encodes them): the same answers as ``vllm serve`` on the right one.
    (``--encode-first`` and ``wait_for_encoding``: images visenc never saw still come from it.) visenc
    holds no pin afterwards: the proxy's hand-over asks for none, the connector reads what it pinned."""
    alone, proxied = openai_pair
    wait_until(lambda: pinned_bytes(right_visenc) == 0, 60, "no pin held before (a lease lapses in 30 s)")
    fresh = [run_vllm.picture(333, 250, 7), run_vllm.picture(224, 224, 8)]  # never sent to visenc before
    for datas in [fresh, run_vllm.images()[0]]:
        want, got = chat(alone, datas), chat(proxied, datas)
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= LOGPROB_ATOL
        assert pinned_bytes(right_visenc) == 0


def pinned_bytes(url: str) -> int:
    """The bytes the visenc at ``url`` holds pinned for readers (``/readyz``)."""
    index = httpx.get(f"{url}/readyz", timeout=10).json()["index"]
    return int(index.get("memory", index)["pinned_bytes"])


@pytest.mark.timeout(900)  # two vLLM engines and a visenc start here (minutes on a loaded host)
@pytest.mark.parametrize(
    "arch",
    [
        "qwen2_5_vl",
        "qwen3_vl",
        "gemma3",
        "mistral3",
        "internvl",
        "idefics3",
        "smolvlm",
        "llava_onevision",
        "glm4v",
        "gemma4",
    ],
)
def test_other_families_through_the_connector(arch, tmp_path):
    """Qwen2.5-VL (window attention), Qwen3-VL (rows carry the deepstack levels,
    ``[main | ds_1 | ds_2]``, as vLLM's encoder cache does), Gemma 3 (SigLIP, pooled, in a
    Hub-format checkpoint), Mistral 3 (Pixtral, 2-D rotary positions, patches merged 2x2, images
    resized to fit 224 px), InternVL (tiles plus a thumbnail, pixel shuffle), Idefics3 / SmolVLM
    (tiles plus a global image, the rows of each among text tokens) and LLaVA-OneVision (anyres
    tiles, unpadded, a learnt newline row after each row of patches), GLM-4.1V (Qwen-style grid,
    2-D rotary positions) and Gemma 4 (variable-resolution patches pooled to soft tokens): the
    wrong copy with the connector gives the right checkpoint's tokens, and encoding the images
    itself (the same engine, under uuids visenc never saw) it does not."""
    if arch == "gemma3":
        right = tiny_vlm.build_gemma3(tmp_path / "right", seed=0)
        wrong = tiny_vlm.build_gemma3(tmp_path / "wrong", seed=0, vision_seed=1)
    elif arch in tiny_processors.PROCESSORS and arch != "qwen3_vl":
        right = tiny_processors.save_with_processor(arch, tmp_path / "right")
        wrong = tiny_processors.save_with_processor(arch, tmp_path / "wrong", vision_seed=1)
    else:
        right = tiny_vlm.build(tmp_path / "right", seed=0, arch=arch)
        wrong = tiny_vlm.build(tmp_path / "wrong", seed=0, vision_seed=1, arch=arch)
    reference = vllm_run(right, "--in-process")
    with serve_process("--model", str(right), "--max-wait-ms", "1") as url:
        with Client(url) as vc:
            for datas in run_vllm.images():
                assert all(h.status == "ready" for h in vc.encode(datas))
        runs = vllm_runs(wrong, "--in-process", "--visenc", url, "--control")
    same(runs["RESULT"], reference)
    assert differs(runs["CONTROL"], reference)


def differs(got: list[dict], want: list[dict]) -> bool:
    """Whether two runs disagree beyond what ``same`` tolerates tenfold: other tokens, or the same
    tokens with logprobs moved by over ``10 * LOGPROB_ATOL`` (a tiny model can be too flat for its
    greedy tokens to follow the picture; its logprobs still do)."""
    if [r["tokens"] for r in got] != [r["tokens"] for r in want]:
        return True
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g["logprobs"], w["logprobs"])) > 10 * LOGPROB_ATOL


def _scheduler_side(monkeypatch, obtain, defer_timeout_s=0.5):
    """A scheduler-side connector (no vLLM config; its visenc is a closed port) whose fetches are
    ``obtain(wants, wait)`` (rows or ``Absent`` per identifier)."""
    from types import SimpleNamespace

    from visenc_client.vllm import ConnectorStats, VisencConnector

    connector = object.__new__(VisencConnector)
    connector.stats = ConnectorStats()
    connector._hidden = 4
    connector._model, connector._checkpoint = "m", ("m", None, None)
    options = {"url": f"http://127.0.0.1:{free_port()}", "defer_timeout_s": defer_timeout_s}
    connector._start_scheduler_side(SimpleNamespace(get_from_extra_config=lambda k, d=None: options.get(k, d)))
    monkeypatch.setattr(connector, "_obtain", obtain)
    return connector


def _request(rid, *items):
    """A vLLM-like request: ``items`` are ``(identifier, offset, rows, data)``."""
    from types import SimpleNamespace

    features = [
        SimpleNamespace(
            identifier=i,
            data=data,
            mm_position=SimpleNamespace(offset=offset, length=rows, get_num_embeds=lambda rows=rows: rows),
        )
        for i, offset, rows, data in items
    ]
    return SimpleNamespace(request_id=rid, mm_features=features)


A, B = "a" * 64, "b" * 64


def test_rows_are_local_before_an_image_counts_present(monkeypatch):
    """The request is deferred while its rows are fetched; only then is the image present, and the
    rows reach the worker inside the step's metadata (the worker makes no call)."""
    import threading

    import torch

    from visenc_client.vllm import VisencConnector, VisencConnectorMetadata

    release = threading.Event()
    rows = torch.arange(12.0).reshape(3, 4)

    def obtain(wants, wait):
        release.wait(5)
        assert [w.rows for w in wants.values()] == [3] and not wait
        return {A: rows}

    connector = _scheduler_side(monkeypatch, obtain, defer_timeout_s=30)
    request = _request("r1", (A, 10, 3, {"pixel_values": 0}))
    assert not connector.ensure_cache_available(request, 0)  # in flight: deferred
    assert not connector.has_cache_item(A)
    assert connector.ensure_cache_available(request, 13)  # its image lies before the computed tokens
    release.set()
    wait_until(lambda: connector.ensure_cache_available(request, 0))
    assert connector.has_cache_item(A)
    connector.update_state_after_alloc(request, 0)
    meta = connector.build_connector_meta(None)
    assert [i for i, _ in meta.items] == [A] and meta.items[0][1] is rows
    worker = object.__new__(VisencConnector)
    worker.stats, worker._device, worker._dtype = connector.stats, torch.device("cpu"), torch.float32
    worker._connector_metadata = VisencConnectorMetadata(items=meta.items)
    cache = {}
    worker.start_load_caches(cache)
    assert torch.equal(cache[A], rows)
    assert connector.stats.fetches == 1 and connector.stats.hits == 1


@pytest.mark.parametrize("fault", ["absent", "bug", "hang"])
def test_a_failed_fetch_means_vllm_encodes_the_image(monkeypatch, fault):
    """visenc's error, a fetch-path bug, or a hang past ``defer_timeout_s``: the image is simply
    not cached, and the request is scheduled (vLLM encodes it)."""
    import threading

    from visenc_client.vllm import Absent

    never = threading.Event()

    def obtain(wants, wait):
        if fault == "absent":
            return dict.fromkeys(wants, Absent("503: injected"))
        if fault == "bug":
            raise KeyError("rows")
        never.wait(10)
        return dict.fromkeys(wants, Absent("too late"))

    connector = _scheduler_side(monkeypatch, obtain, defer_timeout_s=0.3)
    request = _request("r1", (A, 0, 3, {"pixel_values": 0}))
    assert not connector.ensure_cache_available(request, 0)
    wait_until(lambda: connector.ensure_cache_available(request, 0))
    assert not connector.has_cache_item(A)
    assert connector.take_unavailable_requests() == set()
    never.set()


def test_an_image_without_pixels_fails_its_request_alone(monkeypatch):
    from visenc_client.vllm import Absent

    def obtain(wants, wait):
        return dict.fromkeys(wants, Absent("connection refused"))

    connector = _scheduler_side(monkeypatch, obtain)
    from types import SimpleNamespace

    import torch

    grid_only = _request("r1", (A, 0, 3, {"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 2, 6]))}))
    with_pixels = _request("r2", (B, 0, 3, {"pixel_values": 0}))
    assert not connector.ensure_cache_available(grid_only, 0)
    assert not connector.ensure_cache_available(with_pixels, 0)
    wait_until(lambda: connector.ensure_cache_available(with_pixels, 0))
    assert not connector.ensure_cache_available(grid_only, 0)  # never scheduled for vLLM to encode
    grid = {"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 2, 6]))}
    assert not connector.ensure_cache_available(_request("r3", ("not-a-visenc-hash", 0, 3, grid)), 0)
    assert connector.take_unavailable_requests() == {"r1", "r3"}
    assert connector.take_unavailable_requests() == set()


@pytest.mark.parametrize(
    ("grid", "rows", "fits"),
    [((1, 10, 16), 40, True), ((1, 16, 10), 40, False), ((1, 10, 16), 39, False)],
    ids=["same", "rotated", "resized"],
)
def test_rows_for_another_grid_or_count_are_refused(grid, rows, fits):
    """A picture visenc turned or resized otherwise than vLLM (same row count, other grid; or
    another count) is a miss, never loaded."""
    from visenc_client import Handle
    from visenc_client._sources import check_handle
    from visenc_client.vllm import Mismatch, Want

    handle = Handle(A, "ready", rows, 4, "float32", grid)
    check = lambda: check_handle(handle, Want(40, (1, 10, 16)))  # noqa: E731
    if fits:
        check()
    else:
        with pytest.raises(Mismatch):
            check()


def test_a_requests_images_are_fetched_in_one_look_up(monkeypatch):
    import torch

    calls = []

    def obtain(wants, wait):
        calls.append(sorted(wants))
        return {i: torch.zeros(3, 4) for i in wants}

    connector = _scheduler_side(monkeypatch, obtain, defer_timeout_s=30)
    request = _request("r1", (A, 0, 3, {"pixel_values": 0}), (B, 10, 3, {"pixel_values": 0}))
    assert not connector.ensure_cache_available(request, 0)
    wait_until(lambda: connector.ensure_cache_available(request, 0))
    assert calls == [[A, B]] and connector.has_cache_item(A) and connector.has_cache_item(B)


@pytest.mark.parametrize("params", [{"visenc_absent": [A]}, {"visenc_absent": A}, {"visenc_absent": [1]}, [A]])
def test_images_the_request_says_visenc_lacks_are_not_looked_up(monkeypatch, params):
    """``ec_transfer_params["visenc_absent"]`` (``visenc proxy`` writes it): those images are
    encoded by vLLM at once, without a look-up; an image vLLM cannot encode is looked up whatever
    the request says, and a malformed word says nothing."""
    from types import SimpleNamespace

    import torch

    calls = []

    def obtain(wants, wait):
        calls.append(sorted(wants))
        return {i: torch.zeros(3, 4) for i in wants}

    connector = _scheduler_side(monkeypatch, obtain, defer_timeout_s=30)
    told = params == {"visenc_absent": [A]}
    request = _request("r1", (A, 0, 3, {"pixel_values": 0}), (B, 10, 3, {"pixel_values": 0}))
    request.ec_transfer_params = params
    assert not connector.ensure_cache_available(request, 0)
    wait_until(lambda: connector.ensure_cache_available(request, 0))
    assert calls == [[B] if told else [A, B]] and connector.has_cache_item(A) is not told
    assert connector.stats.told_absent == (1 if told else 0)
    grid_only = _request("r2", (A, 0, 3, {"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 2, 6]))}))
    grid_only.ec_transfer_params = {"visenc_absent": [A]}
    wait_until(lambda: connector.ensure_cache_available(grid_only, 0))
    assert connector.has_cache_item(A) and connector.take_unavailable_requests() == set()


def test_vllm_hands_the_proxys_word_to_the_connector():
    """The body as ``visenc proxy`` ends it reaches the connector's ``Request`` through vLLM's own
    OpenAI request model and sampling parameters (a client's ``ec_transfer_params`` kept)."""
    import asyncio

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.v1.request import Request

    from visenc.proxy.upstream import ending_with_absent
    from visenc_client.vllm import told_absent

    async def body() -> bytes:
        said = asyncio.get_running_loop().create_future()
        said.set_result([A])
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ec_transfer_params": {"x": 1}}
        return b"".join([chunk async for chunk in ending_with_absent(request, said)])

    chat = ChatCompletionRequest.model_validate_json(asyncio.run(body()))
    request = Request("r1", [1, 2, 3], chat.to_sampling_params(8, {}), None)
    assert told_absent(request) == {A} and request.ec_transfer_params["x"] == 1
