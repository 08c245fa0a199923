"""The wire format is defined once (``visenc_client.format``): the handle's fields, the rows frame and
the media types; the service's schemas and every reader follow those definitions."""

from __future__ import annotations

import re

import msgpack
import numpy as np
import pytest
from harness.paths import ROOT

from visenc.api.schemas import HandleOut
from visenc_client.format import (
    FRAME_PREFIX_BYTES,
    HANDLE_FIELDS,
    ROWS_MEDIA_TYPE,
    STATUSES,
    CorruptFrame,
    Handle,
    frame_head,
    split_frame,
)


def test_the_documented_handle_is_the_wire_handle():
    """The OpenAPI schema's handle (``HandleOut``) has exactly the wire fields, plus the inline rows."""
    assert tuple(HandleOut.model_fields) == (*HANDLE_FIELDS, "rows")
    assert set(Handle(hash="h" * 64, status="error", error="x", reason="invalid_image").to_wire()) == set(HANDLE_FIELDS)


@pytest.mark.parametrize(
    "handle",
    [
        Handle("a" * 64, "ready", 4, 8, "float32", (1, 4, 4)),
        Handle("b" * 64, "pending", 16, 8, "bfloat16", (1, 8, 8)),
        Handle("c" * 64, "missing"),
        Handle("d" * 64, "error", error="not an image", reason="invalid_image"),
    ],
)
def test_a_handle_survives_the_wire(handle: Handle):
    wire = msgpack.unpackb(msgpack.packb(handle.to_wire()))
    assert set(wire) <= set(HANDLE_FIELDS)
    assert Handle.from_wire(wire) == handle


def test_a_handle_with_an_unknown_status_is_refused():
    assert "done" not in STATUSES
    with pytest.raises(ValueError, match="status"):
        Handle.from_wire({"hash": "a" * 64, "status": "done"})
    with pytest.raises(KeyError):
        Handle.from_wire({"status": "ready"})


def _frame(items: list[dict], rows: list[bytes]) -> bytes:
    return frame_head(items) + b"".join(rows)


def test_a_frame_splits_into_its_items_rows():
    a = np.arange(6, dtype="<f4").tobytes()
    b = np.arange(4, dtype="<f4").tobytes()
    items = [
        {"hash": "a", "offset": 0, "nbytes": len(a)},
        {"hash": "x", "status": 404, "error": "missing"},
        {"hash": "b", "offset": len(a), "nbytes": len(b)},
    ]
    pieces = split_frame(_frame(items, [a, b]))
    assert [item["hash"] for item, _ in pieces] == ["a", "x", "b"]
    assert bytes(pieces[0][1]) == a and pieces[1][1] is None and bytes(pieces[2][1]) == b


@pytest.mark.parametrize(
    "body",
    [
        b"",  # no length prefix
        b"\x01\x00",  # a short one
        b"\xff\xff\x00\x00" + b"x" * 10,  # a header longer than the body
        FRAME_PREFIX_BYTES.to_bytes(4, "little") + b"\xc1\xc1\xc1\xc1",  # not msgpack
        frame_head([{"hash": "a", "offset": 0, "nbytes": 64}]) + b"short",  # rows past the end
        frame_head([{"hash": "a", "offset": -8, "nbytes": 4}]) + b"rowsrows",  # rows before the rows
        frame_head([{"hash": "a", "offset": "zero", "nbytes": 4}]) + b"rows",  # not a number
        frame_head([]).replace(b"items", b"itemz"),  # no item list
    ],
)
def test_a_malformed_frame_is_refused(body: bytes):
    with pytest.raises(CorruptFrame):
        split_frame(body)


#: where the media types and the frame are defined (``visenc_client.format``'s frame module)
FRAME_MODULE = ROOT / "clients" / "visenc_client" / "format" / "frame.py"


def test_media_types_and_the_frame_are_spelt_in_one_module():
    """No other module of the service, the client or the load tests spells the rows media type or
    packs the frame's length prefix itself."""
    spelt = re.compile(r"[\"']" + re.escape(ROWS_MEDIA_TYPE) + r"[\"']|struct\.(un)?pack(_from)?\(\"<I\"")
    offenders = []
    for folder in ("service/visenc", "clients/visenc_client", "loadtest"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != FRAME_MODULE and spelt.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    # SGLang's frame 0 is SGLang's own pickle format (a u32 inside its opcodes), not visenc's rows frame
    assert set(offenders) <= {"service/visenc/epd/wire.py"}, offenders


def test_a_video_manifest_round_trips_and_is_never_rows():
    from visenc_client.format import (
        CorruptEntry,
        manifest_tubes,
        pack_entry,
        pack_manifest,
        unpack_entry,
        video_hash,
    )

    tubes = [f"{i:064x}" for i in (1, 2, 3)]
    video = video_hash(["ab" * 32, "cd" * 32])
    manifest = pack_manifest(tubes, grid_thw=(3, 4, 6), fingerprint="f" * 32, video=video)
    read = unpack_entry(bytes(manifest.blob), fingerprint="f" * 32, hash=video)
    assert read.kind == "video" and manifest_tubes(read) == tubes and read.grid_thw == (3, 4, 6)
    rows = pack_entry(np.zeros((3, 8), "<f4"), dtype="float32", grid_thw=(3, 4, 6), fingerprint="f" * 32, hash=video)
    assert unpack_entry(bytes(rows.blob)).kind == "rows" and b"kind" not in bytes(rows.blob)  # rows' values unchanged
    with pytest.raises(CorruptEntry):
        manifest_tubes(rows)  # same shape, but rows
    assert video != video_hash(["cd" * 32, "ab" * 32])  # frame order is part of a video
