"""The prefill layer without a server: placeholder expansion and what it does on each failure."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.prefill.reference import processor_input_ids

from visenc_client import DeadlineError, Handle, ImageEncodeError, NotFoundError, OverloadedError, ProtocolError
from visenc_client.prefill import VisencPrefill, expand_placeholders, tokens_for_grid

PAD = 9


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 8), max_size=4),
            st.tuples(st.just(1), st.integers(1, 6), st.integers(1, 6)).map(lambda g: (g[0], 2 * g[1], 2 * g[2])),
        ),
        max_size=4,
    ),
    st.lists(st.integers(0, 8), max_size=3),
)
def test_expansion_is_the_qwen2_vl_processors(segments, tail):
    prompt = [t for text, _ in segments for t in [*text, PAD]] + tail
    grids = [g for _, g in segments]
    expanded, offsets = expand_placeholders(prompt, PAD, [tokens_for_grid(g, 2) for g in grids])
    expected = processor_input_ids([500 if t == PAD else t for t in prompt], torch.tensor(grids or [[1, 2, 2]]), 2)
    assert expanded.tolist() == [PAD if t == 500 else t for t in expected[0].tolist()]
    placeholders = [i for i, t in enumerate(prompt) if t == PAD]
    shift = 0
    for offset, at, grid in zip(offsets, placeholders, grids):
        n = tokens_for_grid(grid, 2)
        assert offset == at + shift and (expanded[offset : offset + n] == PAD).all()
        shift += n - 1


def test_expansion_rejects_a_placeholder_count_mismatch():
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_placeholders([1, PAD, 2], PAD, [4, 4])


HANDLE = Handle("a" * 64, "pending", num_tokens=6, hidden_size=4, dtype="float32", grid_thw=(1, 4, 6))


class FakeClient:
    """Answers ``encode`` with fixed handles and raises the queued errors from ``fetch_chunk`` first."""

    def __init__(self, handles: list[Handle], fetch_errors: list[Exception] = ()) -> None:  # type: ignore[assignment]
        self.handles = handles
        self.fetch_errors = list(fetch_errors)
        self.encodes = 0
        self.fetches = 0

    def encode(self, images, *, wait=True, hash_first=True):
        assert wait is False and hash_first
        self.encodes += 1
        return list(self.handles)

    def fetch_chunk(self, placements, start, end, *, out=None, dense=False, wait=True):
        self.fetches += 1
        if self.fetch_errors:
            raise self.fetch_errors.pop(0)
        out[:] = 1.0
        return out


def prefill_with(client: FakeClient, **kw) -> VisencPrefill:
    return VisencPrefill(client, image_token_id=PAD, merge_size=2, **kw)  # type: ignore[arg-type]


def test_evicted_image_is_uploaded_again_then_fetched():
    client = FakeClient([HANDLE], [NotFoundError(404, "not_found", "evicted")])
    prefill = prefill_with(client)
    layout = prefill.prepare([1, PAD, 2], [b"png"])
    out = np.zeros((8, 4), np.float32)
    prefill.fill_chunk(layout, 0, 8, out)
    assert client.encodes == 2 and client.fetches == 2 and (out == 1.0).all()


def test_deadline_and_overload_are_retried_up_to_attempts():
    client = FakeClient([HANDLE], [DeadlineError(504, "deadline", "slow"), OverloadedError(429, "full", "x", 0.0)])
    prefill = prefill_with(client, attempts=3)
    layout = prefill.prepare([PAD], [b"png"])
    prefill.fill_chunk(layout, 0, 6, np.zeros((6, 4), np.float32))
    assert client.fetches == 3
    client.fetch_errors = [DeadlineError(504, "deadline", "slow")] * 3
    with pytest.raises(DeadlineError):
        prefill.fill_chunk(layout, 0, 6, np.zeros((6, 4), np.float32))


def test_chunks_without_image_rows_fetch_nothing():
    client = FakeClient([HANDLE])
    prefill = prefill_with(client)
    layout = prefill.prepare([1, 2, 3, PAD], [b"png"])
    prefill.fill_chunk(layout, 0, 3, np.zeros((3, 4), np.float32))
    assert client.fetches == 0
    with pytest.raises(ValueError, match="rows for chunk"):
        prefill.fill_chunk(layout, 0, 3, np.zeros((2, 4), np.float32))


def test_error_handle_and_wrong_merge_fail_prepare():
    with pytest.raises(ImageEncodeError, match="cannot identify"):
        prefill_with(FakeClient([replace(HANDLE, status="error", error="cannot identify image")])).prepare(
            [PAD], [b"x"]
        )
    with pytest.raises(ProtocolError, match="expects 6"):
        prefill_with(FakeClient([replace(HANDLE, num_tokens=24)])).prepare([PAD], [b"x"])
