"""An item's state moves only along ``items.ITEM_EDGES``, as a job's does along ``job.EDGES``."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from visenc.engine.items import (
    HASH_ONLY,
    ITEM_EDGES,
    MISSING,
    Encodable,
    Failed,
    Found,
    Frames,
    Item,
    Pending,
    Tubes,
    Upload,
    VideoPending,
)
from visenc.engine.job import IllegalTransition, Job
from visenc.errors import InvalidHash
from visenc_client.format import Entry


def _samples() -> list:
    entry = Entry(b"", 1, 1, "float32", (1, 1, 1), "fp", "h")
    loop = asyncio.new_event_loop()
    job = Job(key="k", image_hash="h", order=(0, 0), future=loop.create_future(), admitted_at=0.0)
    loop.close()
    return [
        HASH_ONLY,
        Upload(b"x"),
        Encodable(b"x", None),
        Frames([b"x"]),
        Tubes(None),
        Failed(InvalidHash("bad")),
        Found(entry),
        Pending(job),
        VideoPending(entry),
        MISSING,
    ]


SAMPLES = _samples()


def test_every_state_has_its_edges():
    assert {type(s) for s in SAMPLES} == set(ITEM_EDGES)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(SAMPLES) - 1), st.lists(st.integers(0, len(SAMPLES) - 1), max_size=8))
def test_legal_moves_pass_and_illegal_ones_raise(first: int, moves: list[int]):
    item = Item("a" * 64, SAMPLES[first])
    for m in moves:
        before, target = item.state, SAMPLES[m]
        if type(target) in ITEM_EDGES[type(before)]:
            item.to(target)
            assert item.state is target
        else:
            with pytest.raises(IllegalTransition):
                item.to(target)
            assert item.state is before


def test_an_item_has_no_key_until_looked_up():
    item = Item("a" * 64, HASH_ONLY)
    assert item.key is None
    with pytest.raises(IllegalTransition):
        _ = item.looked_up
    item.key = "ns:fp:" + "a" * 64
    assert item.looked_up == item.key
