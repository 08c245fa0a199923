"""Odd but valid images decode to exactly what the serving engine's loader hands its processor,
and the service's rows for them equal the tower's forward of that image.

vLLM 0.32's loader (the default): RGB as it is, every image with transparency (RGBA, LA, a palette
or gray image with a ``transparency`` entry) pasted onto white through its alpha, other modes
through ``convert("RGB")``, the first frame of an animation, the EXIF orientation applied. SGLang
drops every alpha; a bare transformers processor composites every transparency onto white.
(``tests/with_vllm/test_vllm_images.py`` checks the vLLM loader against vLLM's own code.)"""

from __future__ import annotations

import io

import numpy as np
import pytest
import transformers
from harness.images import noise as random_pixels
from harness.images import save
from PIL import Image
from tests.support.api import encode_json, fetch_rows, running_app, sha
from tests.support.odd_images import corpus as odd_corpus
from transformers.image_transforms import convert_to_rgb

from visenc.errors import VisencError
from visenc.imaging.decode import LOADERS, decode
from visenc.models.loading import load_tower

LIMIT = 1 << 26
RNG = np.random.default_rng(7)


def noise(width: int, height: int, channels: int = 3) -> np.ndarray:
    return random_pixels(RNG, width, height, channels)


def rgba_image() -> Image.Image:
    rgba = noise(60, 44, 4)
    rgba[:10, :, 3] = 0  # fully transparent band
    rgba[10:20, :, 3] = 128  # half transparent band
    return Image.fromarray(rgba, "RGBA")


def la_image() -> Image.Image:
    la = noise(50, 40, 2)
    la[:, :10, 1] = 0
    return Image.fromarray(la, "LA")


def palette_with_transparency() -> Image.Image:
    p = Image.fromarray(noise(48, 36, 1).squeeze() % 16, "L").convert("P")
    p.putpalette([v for i in range(16) for v in (i * 15, 255 - i * 15, (i * 40) % 256)])
    p.info["transparency"] = 3
    return p


def animation(fmt: str) -> bytes:
    frames = [Image.new("RGB", (40, 30), color) for color in ((200, 20, 20), (20, 20, 200))]
    return save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def corpus() -> dict[str, tuple[bytes, np.ndarray]]:
    """name -> (file bytes, the RGB array vLLM's loader makes of it), built independently of visenc."""
    rgb = Image.fromarray(noise(64, 48), "RGB")
    gray16 = Image.fromarray(noise(40, 30, 1).squeeze().astype(np.uint16) * 257)  # mode I;16
    rgba, la, pal = rgba_image(), la_image(), palette_with_transparency()
    cmyk = Image.fromarray(noise(40, 32, 4), "CMYK")
    files = {
        "png-rgb": save(rgb, "PNG"),
        "png-16bit-gray": save(gray16, "PNG"),
        "png-rgba": save(rgba, "PNG"),
        "png-la": save(la, "PNG"),
        "png-palette-transparency": save(pal, "PNG", transparency=3),
        "jpeg-cmyk": save(cmyk, "JPEG", quality=95),
        "jpeg-progressive": save(rgb, "JPEG", quality=90, progressive=True),
        "jpeg-gray": save(Image.fromarray(noise(50, 30, 1).squeeze(), "L"), "JPEG"),
        "webp-lossless": save(rgb, "WEBP", lossless=True),
        "bmp": save(rgb, "BMP"),
        "tiff": save(rgb, "TIFF"),
        "tall-200-to-1": save(Image.fromarray(noise(2, 400), "RGB"), "PNG"),
        "wide-200-to-1": save(Image.fromarray(noise(400, 2), "RGB"), "PNG"),
        "one-pixel": save(Image.fromarray(noise(1, 1), "RGB"), "PNG"),
        "gif-animated": animation("GIF"),
        "webp-animated": animation("WEBP"),
    }
    expected = {}
    for name, data in files.items():
        image = Image.open(io.BytesIO(data))
        if image.mode in ("RGBA", "LA") or "transparency" in image.info:  # onto white: src*a + 255*(1-a)
            arr = np.asarray(image.convert("RGBA")).astype(np.float64)
            a = arr[..., 3:] / 255
            want = np.rint(arr[..., :3] * a + 255 * (1 - a))
        else:
            want = np.asarray(image.convert("RGB")).astype(np.float64)
        expected[name] = (data, want)
    return expected


CORPUS = corpus()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_equals_the_vllm_loader(name):
    data, want = CORPUS[name]
    got = np.asarray(decode(data, max_pixels=LIMIT)).astype(np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1, rtol=0)  # PIL's paste rounds its blend (±1 level)


ODD = odd_corpus()


def test_the_transformers_loader_names_the_installed_transformers():
    assert transformers.__version__.startswith(LOADERS["transformers"].version + ".")


@pytest.mark.parametrize("name", sorted(ODD))
def test_decode_equals_transformers_convert_to_rgb(name):
    """``--image-loader transformers``: what a processor given ``Image.open(file)`` makes of it (its
    ``convert_to_rgb``, the installed transformers' own code), pixel for pixel; a broken file refused."""
    data = ODD[name]
    try:
        want = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    except Exception:  # Pillow cannot open or decode it (a broken file, EPS without Ghostscript)
        with pytest.raises(VisencError):
            decode(data, max_pixels=LIMIT, loader="transformers")
        return
    got = np.asarray(decode(data, max_pixels=LIMIT, loader="transformers"))
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_alpha_semantics_per_loader():
    la = save(la_image(), "PNG")
    rgba = save(rgba_image(), "PNG")
    pal = save(palette_with_transparency(), "PNG", transparency=3)
    # vLLM: every transparency onto white (LA, RGBA, the palette's transparent colour)
    assert (np.asarray(decode(la, max_pixels=LIMIT))[:, :10] == 255).all()
    assert (np.asarray(decode(rgba, max_pixels=LIMIT))[:10] == 255).all()
    p_rgb = np.asarray(decode(pal, max_pixels=LIMIT))
    index = np.asarray(Image.open(io.BytesIO(pal)))
    colours = np.asarray(Image.open(io.BytesIO(pal)).convert("RGB"))
    assert (p_rgb[index == 3] == 255).all() and (p_rgb[index != 3] == colours[index != 3]).all()
    # SGLang keeps the palette's colour where vLLM shows white
    assert not (np.asarray(decode(pal, max_pixels=LIMIT, loader="sglang"))[index == 3] == 255).all()
    # SGLang: RGBA's alpha dropped too
    src = np.asarray(Image.open(io.BytesIO(rgba)))
    np.testing.assert_array_equal(np.asarray(decode(rgba, max_pixels=LIMIT, loader="sglang")), src[..., :3])
    # transformers: LA composited onto white where transparent
    assert (np.asarray(decode(la, max_pixels=LIMIT, loader="transformers"))[:, :10] == 255).all()


def test_animations_give_their_first_frame():
    for name in ("gif-animated", "webp-animated"):
        rgb = np.asarray(decode(CORPUS[name][0], max_pixels=LIMIT))
        assert np.abs(rgb.reshape(-1, 3).mean(0) - (200, 20, 20)).max() < 4, name


def test_the_loader_is_part_of_the_fingerprint():
    fingerprints = {load_tower("tiny-qwen2-vl", image_loader=loader).fingerprint for loader in ("vllm", "sglang")}
    assert len(fingerprints) == 2


async def test_service_rows_for_odd_images_equal_the_forward_of_the_loaded_image(tiny_tower):
    names = sorted(CORPUS)
    async with running_app(tiny_tower, max_image_pixels=LIMIT) as client:
        r = await encode_json(client, [{"data": CORPUS[n][0]} for n in names])
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        for name, item in zip(names, items):
            assert item["status"] == "ready", (name, item)
            data, _ = CORPUS[name]
            image = decode(data, max_pixels=LIMIT)
            prepared = tiny_tower.preprocess(image)
            assert item["num_tokens"] == prepared.layout.num_tokens == tiny_tower.layout(*image.size).num_tokens
            want = tiny_tower.forward([prepared])[0].numpy()
            np.testing.assert_allclose(await fetch_rows(client, sha(data)), want, atol=1e-5, rtol=0, err_msg=name)


async def test_a_size_the_processor_refuses_is_an_item_error(tiny_tower):
    over = save(Image.fromarray(noise(2, 500), "RGB"), "PNG")  # aspect ratio 250: Qwen refuses over 200
    async with running_app(tiny_tower) as client:
        r = await encode_json(client, [{"data": over}, {"data": CORPUS["png-rgb"][0]}])
        bad, good = r.json()["items"]
        assert bad["status"] == "error" and bad["reason"] == "invalid_image" and "aspect ratio" in bad["error"]
        assert good["status"] == "ready"
