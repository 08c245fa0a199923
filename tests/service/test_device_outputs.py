"""Rows made on the simulated device and not yet copied out stay within their bound (the device waits,
and its timeline says why); a hand-over to the outputs that fails answers its jobs; the stand-in's
memory is planned as a GPU's and runs out as one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness.images import png_bytes
from tests.support.api import encode_json, fetch_rows, running_app, sha

from visenc.engine.budget import OUTPUT_SHARE, plan_budget
from visenc.imaging.decode import decode
from visenc.models import sim

pytestmark = pytest.mark.serial

#: 64 tokens an image, 1 KiB a row: 64 KiB of rows an image, copied out at 1 us a byte (65 ms), made in 6.4 ms
SLOW_COPY = "sim:launch_ms=1,token_us=100,patch=16,hidden=256,out_ns_per_byte=1000"
#: the planning budget: 10% of it (100 KiB) for rows not copied out, room for one image's
BUDGET = 1 << 20


async def test_rows_not_copied_out_stay_within_the_budget_and_nothing_is_lost():
    tower = sim.load(SLOW_COPY)
    images = [png_bytes(2900 + i, 128, 128) for i in range(12)]
    async with running_app(tower, max_batch_images=4, memory_budget_bytes=BUDGET) as client:
        outputs = client.app.state.engine.outputs
        assert outputs.max_held_bytes == int(OUTPUT_SHARE * BUDGET)
        r = await encode_json(client, [{"data": d} for d in images])
        assert r.status_code == 200, r.text
        for data in images:
            rows = await fetch_rows(client, sha(data))
            expected = tower.preprocess(decode(data, max_pixels=10**9)).pixels
            np.testing.assert_allclose(rows, np.repeat(expected[:, None], 256, axis=1), rtol=1e-6)
        image_rows = 64 * 256 * 4
        assert image_rows <= outputs.peak_held_bytes <= outputs.max_held_bytes, outputs.peak_held_bytes
        assert outputs.held_bytes == 0
    waits = [w for w in tower.sim.waits if w.wait == "copy-out"]
    assert waits, "the copy out lagged the device 10 to 1, and the device never waited for it"
    assert sum(s.images for s in tower.sim.spans) == len(images)


async def test_a_failing_hand_over_answers_its_jobs(monkeypatch):
    tower = sim.load("sim:launch_ms=1,token_us=100,patch=16,hidden=8")
    async with running_app(tower) as client:
        outputs = client.app.state.engine.outputs

        def refused(forwarded):
            raise RuntimeError("the output thread is gone")

        monkeypatch.setattr(outputs, "submit", refused)
        r = await encode_json(client, [{"data": png_bytes(3900, 64, 64)}])
        (item,) = r.json()["items"]
        assert item["status"] == "error" and item["reason"] == "encode_failed", item
        monkeypatch.undo()
        data = png_bytes(3901, 64, 64)
        r = await encode_json(client, [{"data": data}])
        assert r.json()["items"][0]["status"] == "ready", r.text  # the worker lives on


def test_the_stand_in_plans_its_memory_as_a_gpu():
    """Staged inputs live on the host beside the device's memory, as on a GPU: two or more batches staged,
    and batches not capped at a CPU's packed limit."""
    tower = sim.load("sim:memory_mb=1024,hidden=64")
    budget = plan_budget(tower, tower.runtime.memory_bytes(0.5), max_batch_tokens=16384, workers=2)
    assert budget.max_batch_tokens == 16384
    assert budget.prefetch_tokens >= 2 * budget.max_batch_tokens


def test_the_stand_in_runs_out_of_memory_as_a_gpu():
    tower = sim.load("sim:memory_mb=1,hidden=64,patch=16")
    image = tower.preprocess(decode(png_bytes(4900, 256, 256), max_pixels=10**9))  # 256 tokens, 4 MiB
    with pytest.raises(torch.OutOfMemoryError):
        tower.forward([image])
    assert tower.runtime.is_out_of_memory(torch.OutOfMemoryError("x"))
