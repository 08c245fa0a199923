"""The client says what to do: an ``error`` handle fails at once with its reason, a hash given to
``encode`` names ``lookup``, a base URL ending in ``/v1`` works, and an optional part that is not
installed fails in one line naming the extra (each without a request)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from harness.paths import ROOT

from visenc_client import AsyncClient, Client, Handle, ImageEncodeError, ImagePlacement, ProtocolError
from visenc_client._extras import needs

FAILED = Handle("b" * 64, "error", error="unsupported or unrecognised image format", reason="invalid_image")


def recorder() -> tuple[list[str], httpx.MockTransport, httpx.AsyncBaseTransport]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"name": "tiny"})

    return seen, httpx.MockTransport(handler), httpx.MockTransport(handler)


def test_fetching_an_error_handle_raises_its_reason_without_a_request() -> None:
    seen, transport, _ = recorder()
    with Client("http://visenc", transport=transport) as vc:
        with pytest.raises(ImageEncodeError) as raised:
            vc.fetch(FAILED)
        with pytest.raises(ImageEncodeError):
            vc.fetch_chunk([ImagePlacement(FAILED, 0, 4)], 0, 4)
    assert raised.value.reason == "invalid_image" and "invalid_image" in str(raised.value)
    assert seen == []


async def test_the_async_twin_raises_it_the_same() -> None:
    seen, _, transport = recorder()
    async with AsyncClient("http://visenc", transport=transport) as vc:
        with pytest.raises(ImageEncodeError, match="invalid_image"):
            await vc.fetch(FAILED)
    assert seen == []


def test_a_hash_given_to_encode_names_lookup(tmp_path, monkeypatch) -> None:
    seen, transport, _ = recorder()
    with Client("http://visenc", transport=transport) as vc:
        with pytest.raises(ValueError, match=r"image hash.*lookup\(\[hash\]\)"):
            vc.encode(["c" * 64])
        assert seen == []
        monkeypatch.chdir(tmp_path)
        (tmp_path / ("c" * 64)).write_bytes(b"x")  # a file of that name is read as one
        with pytest.raises(ProtocolError):  # sent (this mock answers no handles)
            vc.encode(["c" * 64])
    assert seen == ["/v1/encode"]


@pytest.mark.parametrize("base", ["http://visenc:8000/v1", "http://visenc:8000/v1/", "http://visenc:8000"])
def test_a_base_url_ending_in_v1_is_accepted(base: str) -> None:
    seen, transport, _ = recorder()
    with Client(base, transport=transport) as vc:
        assert vc.model() == {"name": "tiny"}
        assert vc.base_url.rstrip("/") == "http://visenc:8000"
    assert seen == ["/v1/model"]


def last_line(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return (r.stdout + r.stderr).strip().splitlines()[-1]


#: imports with ``hidden`` made absent (``sys.modules[name] = None``), and the line each ends in
MISSING = [
    (("torch",), "import visenc_client.vllm", "vllm", "visenc_client.vllm", "torch"),
    (("vllm",), "import visenc_client.vllm", "vllm", "visenc_client.vllm", "vllm"),
    (("redis",), "from visenc_client import RedisRows", "redis", "visenc_client.RedisRows", "redis"),
    (("redis",), "from visenc_client import AsyncRedisRows", "redis", "visenc_client.AsyncRedisRows", "redis"),
]


@pytest.mark.parametrize(("hidden", "code", "extra", "what", "absent"), MISSING, ids=[m[1] for m in MISSING])
def test_an_optional_part_not_installed_is_named_in_one_line(
    hidden: tuple[str, ...], code: str, extra: str, what: str, absent: str
) -> None:
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in hidden)
    assert last_line(f"import sys; {hide}{code}") == (
        f"ModuleNotFoundError: {what} needs the '{extra}' extra ({absent} is not installed): "
        f"pip install 'visenc-client[{extra}]'"
    )


def test_a_module_missing_from_an_installed_package_is_named_as_itself() -> None:
    """An older release without a module (vLLM before its encoder-cache connectors) is not "not installed"."""
    with pytest.raises(ModuleNotFoundError, match=r"needs the 'vllm' extra \(json\.absent is not installed\)"):
        with needs("vllm", "visenc_client.vllm"):
            import json.absent  # noqa: F401


def test_what_needs_no_extra_imports_without_them() -> None:
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in ("torch", "redis", "vllm", "huggingface_hub"))
    code = (
        f"import sys; {hide}import visenc_client, visenc_client.sglang, visenc_client.prefill; "
        "from visenc_client import Client; Client(shared_memory=True).close(); print('ok')"
    )
    assert last_line(code) == "ok"
