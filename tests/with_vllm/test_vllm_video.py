"""Videos against vLLM's own code: visenc's tubes are what vLLM's processor makes of the clip, and
vLLM consumes visenc's video rows through ``VisencConnector`` token-identically.

- For tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints, clips that need a resize, odd frame
  counts and a frame under the patch grid: visenc's tubes, concatenated, equal vLLM's
  ``pixel_values_videos`` bit for bit, its grid equals ``video_grid_thw`` and its row count the
  placeholder's embeddings (the rows of equal inputs are pinned in ``tests/golden/test_video_tubes.py``
  against transformers and here below against vLLM's tokens).
- vLLM serves a Qwen2-VL, Qwen2.5-VL or Qwen3-VL copy whose vision tower is wrong; visenc serves the
  right one. With the connector (each video's uuid its visenc video hash), vLLM gives the right
  checkpoint's tokens, and logprobs within 1e-3, for video prompts of 4, 5 and 6 frames (Qwen3-VL's
  deepstack rows included); alone, the copy differs.
  Where visenc cannot give a video's rows (unreachable, or never sent the video), vLLM encodes
  it itself and answers as alone.

This runs vLLM's installed code, so it fails when a vLLM upgrade changes how videos are processed.
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.processes import serve_process
from harness.waits import free_port, wait_until
from PIL import Image

from visenc_client import Client, Video, image_hash, video_hash

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import run_vllm  # noqa: E402
import tiny_vlm  # noqa: E402
from openai_servers import chat  # noqa: E402
from test_vllm_connector import pinned_bytes, same  # noqa: E402
from vllm_forks import vllm_run, vllm_runs  # noqa: E402

CLIPS = [(4, 120, 200), (5, 61, 97), (3, 20, 30), (6, 90, 300), (2, 448, 448)]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tubes_equal_vllms_video_inputs(arch, tmp_path):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from visenc.models.loading import load_tower

    path = tiny_vlm.build(tmp_path / arch, seed=0, arch=arch)
    config = ModelConfig(model=str(path), dtype="float32", mm_device_do_normalize=False)
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    tower = load_tower(str(path))
    assert tower.video is not None
    rng = np.random.default_rng(0)
    for t, h, w in CLIPS:
        frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
        # frames the caller sampled: vLLM samples none of its own (its metadata says so)
        meta = {"fps": 2.0, "duration": t / 2, "total_num_frames": t, "frames_indices": list(range(t))}
        meta |= {"video_backend": "opencv", "do_sample_frames": False}
        out = processor(
            "<|vision_start|><|video_pad|><|vision_end|>", processor.info.parse_mm_data({"video": [(frames, meta)]})
        )
        (placeholder,) = out["mm_placeholders"]["video"]
        (item,) = out["mm_kwargs"]["video"]
        tubes, grid = tower.video.tubes(frames)
        assert grid == tuple(int(x) for x in item["video_grid_thw"].data.tolist()), (arch, (t, h, w))
        assert placeholder.get_num_embeds() == grid[0] * tower.video.tube_tokens(grid)
        want = item["pixel_values_videos"].data.float().numpy()
        np.testing.assert_array_equal(np.concatenate(tubes), want, err_msg=f"{arch} {(t, h, w)}")


def pair(folder: Path, arch: str) -> tuple[Path, Path]:
    """(right, wrong): a tiny checkpoint of ``arch``, and a copy whose vision tower is wrong."""
    right = tiny_vlm.build(folder / "right", seed=0, arch=arch)
    return right, tiny_vlm.build(folder / "wrong", seed=0, vision_seed=1, arch=arch)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def checkpoints(request, tmp_path_factory) -> tuple[Path, Path]:
    return pair(tmp_path_factory.mktemp(f"tiny-vlm-video-{request.param}"), request.param)


@pytest.fixture(scope="module")
def reference(checkpoints) -> list[dict]:
    return vllm_run(checkpoints[0], "--in-process", "--video")


@pytest.fixture(scope="module")
def wrong_alone(checkpoints) -> list[dict]:
    return vllm_run(checkpoints[1], "--in-process", "--video")


def test_the_wrong_checkpoint_alone_differs_on_video(wrong_alone, reference):
    assert [r["tokens"] for r in wrong_alone] != [r["tokens"] for r in reference]


@pytest.fixture(scope="module")
def with_connector(checkpoints) -> dict[str, list[dict]]:
    """The wrong copy with the connector of a visenc on the right checkpoint that holds the videos
    (``RESULT``), then the same prompts under video hashes visenc never saw (``CONTROL``)."""
    right, wrong = checkpoints
    with serve_process("--model", str(right), "--max-wait-ms", "1") as url:
        with Client(url) as vc:  # the videos, encoded once; the connector never uploads
            handles = vc.encode([Video(frames) for frames in run_vllm.videos()])
            assert all(h.status == "ready" for h in handles)
        return vllm_runs(wrong, "--in-process", "--visenc", url, "--video", "--control")


def test_videos_visenc_cannot_give_are_encoded_by_vllm(checkpoints, wrong_alone, with_connector):
    """visenc unreachable, or up without these videos (the control: hashes it never saw): vLLM
    encodes them itself (its own answer)."""
    _, wrong = checkpoints
    same(vllm_run(wrong, "--in-process", "--visenc", f"http://127.0.0.1:{free_port()}", "--video"), wrong_alone)
    same(with_connector["CONTROL"], wrong_alone)


def test_connector_gives_the_right_checkpoints_tokens_for_videos(with_connector, reference):
    same(with_connector["RESULT"], reference)


def jpeg_frames(frames: list[bytes]) -> list[bytes]:
    """The frames as JPEG files (what a ``data:video/jpeg`` URL carries)."""
    out = []
    for f in frames:
        buf = io.BytesIO()
        Image.open(io.BytesIO(f)).convert("RGB").save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def test_the_proxy_takes_the_frames_vllm_takes():
    """``visenc proxy``'s frames of a ``data:video/jpeg`` URL are the ones vLLM's own media
    connector loads (the first 32 by default; the option's default is read from vLLM's code)."""
    import inspect

    from vllm.multimodal.media.connector import MediaConnector
    from vllm.multimodal.media.video import VideoMediaIO

    from visenc.imaging.decode import decode
    from visenc.proxy import Proxy, ProxySettings

    frames = jpeg_frames([run_vllm.picture(64, 48, 3000 + i) for i in range(40)])
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    (clip, _) = MediaConnector().fetch_video(url).media
    default = inspect.signature(VideoMediaIO.__init__).parameters["num_frames"].default
    assert ProxySettings.model_fields["video_num_frames"].default == default == clip.shape[0]
    video = Proxy(ProxySettings(upstream=["http://x"], visenc="http://y")).images._video(url)
    assert isinstance(video.source, Video) and len(video.source.frames) == clip.shape[0]
    for got, want in zip(video.source.frames, clip):
        np.testing.assert_array_equal(np.asarray(decode(got, max_pixels=10**8)), want)


def test_openai_server_behind_visenc_proxy_for_videos(openai_pair, right_visenc):
    """``vllm serve`` on the wrong copy with the connector, behind ``visenc proxy --encode-first``
    (which tags the video parts with their video hash and hands them to visenc): the same answers as
    ``vllm serve`` alone on the right checkpoint, for videos visenc never saw before. visenc holds no
    pin afterwards: the connector's read of the video released its tubes."""
    alone, proxied = openai_pair
    wait_until(lambda: pinned_bytes(right_visenc) == 0, 60, "no pin held before (a lease lapses in 30 s)")
    for frames in run_vllm.videos()[:2]:
        clip = jpeg_frames(frames)
        with Client(right_visenc) as vc:  # never sent to visenc before
            (h,) = vc.lookup([video_hash([image_hash(f) for f in clip])], pin=False)
            assert h.status == "missing"
        want, got = chat(alone, [], videos=[clip]), chat(proxied, [], videos=[clip])
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= 1e-3
        assert pinned_bytes(right_visenc) == 0
        with Client(right_visenc) as vc:  # the rows did come from visenc: it holds the video
            (h,) = vc.lookup([video_hash([image_hash(f) for f in clip])], pin=False)
            assert h.status == "ready"
