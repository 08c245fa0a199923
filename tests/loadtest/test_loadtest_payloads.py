"""The load test's payload checks and chunk planner (pure functions, no Locust)."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from loadtest.payloads import (
    PayloadError,
    check_handles,
    check_rows_body,
    check_rows_get,
    image_hash,
    parse_stages,
    parse_timespan,
    plan_chunks,
    screenshot_png,
    timing_headers,
)

HIDDEN = 8
HANDLE = {"status": "ready", "num_tokens": 10, "hidden_size": HIDDEN, "dtype": "float32"}


@given(st.lists(st.integers(0, 50), max_size=8), st.integers(1, 40))
def test_chunks_cover_every_row_once_in_order(num_tokens: list[int], chunk: int) -> None:
    chunks = plan_chunks(num_tokens, chunk)
    flat = [(r.index, row) for c in chunks for r in c for row in range(r.start, r.end)]
    assert flat == [(i, row) for i, n in enumerate(num_tokens) for row in range(n)]
    assert all(r.end > r.start for c in chunks for r in c)
    sizes = [sum(r.end - r.start for r in c) for c in chunks]
    assert all(s == chunk for s in sizes[:-1]) and (not sizes or 0 < sizes[-1] <= chunk)


def test_screenshots_are_deterministic_distinct_pngs() -> None:
    a, b = screenshot_png(1, 96, 64), screenshot_png(2, 96, 64)
    assert a == screenshot_png(1, 96, 64) and a != b
    assert a[:8] == b"\x89PNG\r\n\x1a\n" and image_hash(a) != image_hash(b)


def _encode_answer(items: list[dict]) -> bytes:
    return msgpack.packb({"model": "m", "items": items})


def test_check_handles_accepts_the_right_answer_and_rejects_wrong_ones() -> None:
    hashes = ["a" * 64, "b" * 64]
    ok = [{"hash": h, **HANDLE} for h in hashes]
    assert check_handles(_encode_answer(ok), hashes, frozenset({"ready"})) == ok
    wrong = {  # error message it must raise -> the wrong answer
        "answered 1 items for 2": ok[:1],
        "is not the one sent": ok[::-1],
        "status 'error'": [ok[0], {**ok[1], "status": "error", "error": "boom"}],
        "num_tokens 0": [ok[0], {**ok[1], "num_tokens": 0}],
        "unknown dtype": [ok[0], {**ok[1], "dtype": "int7"}],
    }
    for message, items in wrong.items():
        with pytest.raises(PayloadError, match=message):
            check_handles(_encode_answer(items), hashes, frozenset({"ready"}))
    with pytest.raises(PayloadError, match="status 'missing'"):  # allowed only in the hash round
        check_handles(_encode_answer([ok[0], {"hash": hashes[1], "status": "missing"}]), hashes, frozenset({"ready"}))
    with pytest.raises(PayloadError, match="unreadable"):
        check_handles(b"\xc1", hashes, frozenset({"ready"}))


def _rows_answer(
    ranges: list[tuple[str, int, int]], short: int = 0, nan: bool = False, shape_rows: int | None = None
) -> bytes:
    meta, data = [], b""
    for h, s, e in ranges:
        rows = np.arange((e - s) * HIDDEN, dtype="<f4")
        if nan:
            rows[0] = np.nan
        buf = rows.tobytes()[: len(rows) * 4 - short]
        meta.append(
            {
                "hash": h,
                "start": s,
                "end": e,
                "shape": [shape_rows or e - s, HIDDEN],
                "dtype": "float32",
                "offset": len(data),
                "nbytes": len(buf),
            }
        )
        data += buf
    header = msgpack.packb({"items": meta})
    return struct.pack("<I", len(header)) + header + data


def test_check_rows_body() -> None:
    ranges = [("a" * 64, 0, 6), ("b" * 64, 2, 5)]
    handles = [HANDLE, HANDLE]
    assert check_rows_body(_rows_answer(ranges), ranges, handles) == 9 * HIDDEN * 4
    with pytest.raises(PayloadError, match="bytes for 6 rows"):
        check_rows_body(_rows_answer(ranges, short=4), ranges, handles)
    with pytest.raises(PayloadError, match="NaN"):
        check_rows_body(_rows_answer(ranges, nan=True), ranges, handles)
    with pytest.raises(PayloadError, match="shape"):
        check_rows_body(_rows_answer(ranges, shape_rows=2), ranges, handles)
    with pytest.raises(PayloadError, match="answered 1 ranges"):
        check_rows_body(_rows_answer(ranges[:1]), ranges, handles)
    with pytest.raises(PayloadError, match="hidden/dtype"):
        check_rows_body(_rows_answer(ranges), ranges, [HANDLE, {**HANDLE, "hidden_size": 16}])
    with pytest.raises(PayloadError, match="account for"):
        check_rows_body(_rows_answer(ranges) + b"extra", ranges, handles)


def test_check_rows_get() -> None:
    content = np.zeros((3, HIDDEN), "<f4").tobytes()
    check_rows_get({"X-Visenc-Shape": f"3,{HIDDEN}", "X-Visenc-Dtype": "float32"}, content, 2, 5, HANDLE)
    with pytest.raises(PayloadError, match="X-Visenc-Shape"):
        check_rows_get({"X-Visenc-Shape": f"4,{HIDDEN}", "X-Visenc-Dtype": "float32"}, content, 2, 5, HANDLE)
    with pytest.raises(PayloadError, match="bytes for 3 rows"):
        check_rows_get({"X-Visenc-Shape": f"3,{HIDDEN}", "X-Visenc-Dtype": "float32"}, content[:-4], 2, 5, HANDLE)


def test_timing_headers_seconds_to_ms_and_absent_ones_left_out() -> None:
    assert timing_headers({"X-Visenc-Queue-Time": "0.002500", "X-Visenc-Encode-Time": "0.1"}) == {
        "queue": pytest.approx(2.5),
        "encode": pytest.approx(100.0),
    }
    assert timing_headers({}) == {}


def test_stages_and_timespans() -> None:
    assert parse_stages("3:1:1, 7:2:2") == [(3.0, 1, 1.0), (7.0, 2, 2.0)]
    for bad in ("7:1:1,3:2:2", "0:1:1", "3:1", "x"):
        with pytest.raises(ValueError):
            parse_stages(bad)
    assert [parse_timespan(t) for t in ("90", "30s", "2m", "1h20m")] == [90, 30, 120, 4800]
    with pytest.raises(ValueError):
        parse_timespan("soon")


def test_row_ledger_catches_a_row_that_changes_between_reads():
    from loadtest.payloads import PayloadError, RowLedger

    ledger = RowLedger()
    rows = np.arange(12, dtype="<f4").reshape(4, 3)
    ledger.check("a" * 64, 0, rows.tobytes(), 4)
    ledger.check("a" * 64, 2, rows[2:].tobytes(), 2)  # same rows again: fine
    ledger.check("b" * 64, 0, (rows + 1).tobytes(), 4)  # another image: its own rows
    bad = rows.copy()
    bad[3, 1] += 1
    with pytest.raises(PayloadError, match="row 3"):
        ledger.check("a" * 64, 1, bad[1:].tobytes(), 3)
