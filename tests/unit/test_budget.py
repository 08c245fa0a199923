"""Memory budget arithmetic: per-tower estimates and the batch plan derived from a budget."""

from __future__ import annotations

import pytest
import torch
from harness.images import jpeg_bytes

from visenc.engine.budget import (
    CPU_PACKED_BATCH_TOKENS,
    RESERVE,
    STAGED_LINE_FACTOR,
    STAGING_SHARE,
    plan_budget,
)
from visenc.engine.prepare import ImagePrep
from visenc.models import memory
from visenc.models.loading import load_tower

MiB = 1 << 20


@pytest.fixture
def qwen(tiny_tower):
    return tiny_tower


@pytest.fixture(scope="module")
def clip():
    return load_tower("tiny-clip")


def test_attention_scores_are_quadratic_only_when_materialised():
    assert memory.attention_score_bytes(4, 100, 4, materialised=True) == 2 * 4 * 100 * 100 * 4
    assert memory.attention_score_bytes(4, 200, 4, materialised=True) == 4 * memory.attention_score_bytes(
        4, 100, 4, materialised=True
    )
    assert memory.attention_score_bytes(4, 200, 4, materialised=False) == 0

    class Config:
        _attn_implementation = "eager"

    assert memory.materialises_scores(Config())
    Config._attn_implementation = "sdpa"
    assert not memory.materialises_scores(Config())


def test_qwen_estimate_is_linear_in_patches_plus_one_image_of_attention(qwen, monkeypatch):
    small, big = qwen.layout(448, 448), qwen.layout(896, 896)
    per_token = qwen.activation_bytes_per_token()
    assert per_token > qwen.input_bytes_per_token() == 4 * 3 * 2 * 14 * 14
    # the varlen kernels (the default): no seq² term
    assert qwen.forward_bytes([small, big]) == per_token * (qwen.input_tokens(small) + qwen.input_tokens(big))
    # the model's own path, eager: one image's scores at a time
    monkeypatch.setattr(qwen, "varlen", False)
    assert qwen.forward_bytes([small, big]) == per_token * (qwen.input_tokens(small) + qwen.input_tokens(big))
    monkeypatch.setattr(qwen.model.config, "_attn_implementation", "eager")
    heads, seq_big = qwen.model.config.num_heads, qwen.input_tokens(big)
    scores = int(memory.SAFETY * memory.attention_score_bytes(heads, seq_big, 4, materialised=True))
    linear = per_token * (qwen.input_tokens(small) + seq_big)
    # images are attended one at a time: the largest image's scores, not the sum
    assert qwen.forward_bytes([small, big]) == linear + scores
    assert qwen.forward_bytes([big, big]) == 2 * per_token * seq_big + scores


def test_clip_estimate_counts_every_stacked_image(clip, monkeypatch):
    lay = clip.layout(640, 480)
    assert clip.input_tokens(lay) == 1  # the budget unit of a fixed-resolution tower is the image
    one = clip.forward_bytes([lay])
    assert clip.forward_bytes([lay] * 8) == 8 * one
    monkeypatch.setattr(clip.model.config, "_attn_implementation", "eager")
    assert clip.forward_bytes([lay]) > one  # 197² scores per image, all live at once


def test_bf16_halves_activations_but_not_the_float32_inputs():
    f32 = load_tower("tiny-clip")
    bf16 = load_tower("tiny-clip", dtype="bfloat16")
    assert bf16.input_bytes_per_token() == f32.input_bytes_per_token()
    assert bf16.activation_bytes_per_token() < f32.activation_bytes_per_token()


@pytest.mark.parametrize("budget_mib", [16, 64, 512, 8192])
def test_cpu_plan_fits_two_staged_batches_and_one_forward(qwen, budget_mib):
    budget = budget_mib * MiB
    plan = plan_budget(qwen, budget, max_batch_tokens=16384)
    a, p = qwen.activation_bytes_per_token(), qwen.input_bytes_per_token()
    t = plan.max_batch_tokens
    assert 1 <= t <= CPU_PACKED_BATCH_TOKENS
    assert plan.prefetch_tokens == max(1, t // 4)  # on a CPU the forward shares the cores: a quarter batch
    assert 2 * t * p + plan.max_batch_bytes <= (1 - RESERVE) * budget
    assert plan.max_batch_bytes >= t * a  # a full-token batch of small images always fits
    if t < CPU_PACKED_BATCH_TOKENS:  # the budget, not the cap, is binding: it is nearly used up
        assert 2 * (t + 1) * p + (t + 1) * a > (1 - RESERVE) * budget


def test_plan_never_raises_the_token_cap_and_honours_prefetch_override(qwen):
    plan = plan_budget(qwen, 1 << 40, max_batch_tokens=2048, prefetch_tokens=1000)
    assert plan.max_batch_tokens == 2048 and plan.prefetch_tokens == 1000


def test_tiny_budget_still_lets_one_image_through(qwen):
    plan = plan_budget(qwen, 1 * MiB, max_batch_tokens=16384)
    assert plan.max_batch_tokens >= 1 and plan.prefetch_tokens >= 1
    with pytest.raises(ValueError):
        plan_budget(qwen, 0, max_batch_tokens=16384)


def test_cuda_plan_keeps_staged_inputs_out_of_device_memory(qwen, monkeypatch):
    monkeypatch.setattr(qwen, "device", torch.device("cuda"))
    budget = 256 * MiB
    plan = plan_budget(qwen, budget, max_batch_tokens=1 << 30)
    assert plan.max_batch_tokens == int((1 - RESERVE) * budget) // qwen.activation_bytes_per_token()
    assert plan.prefetch_tokens == 2 * plan.max_batch_tokens


def test_cuda_staging_bound_grows_with_the_preprocessing_pool_within_the_process_budget(qwen, monkeypatch):
    monkeypatch.setattr(qwen, "device", torch.device("cuda"))
    big_host = 1 << 40
    plan = plan_budget(qwen, 1 << 40, max_batch_tokens=16384, workers=16, process_memory_bytes=big_host)
    assert plan.prefetch_tokens == (2 + 16) * plan.max_batch_tokens  # two batches ready, one per worker
    line = STAGED_LINE_FACTOR * qwen.input_bytes_per_token()
    small_host = 4096 * MiB
    capped = plan_budget(qwen, 1 << 40, max_batch_tokens=16384, workers=16, process_memory_bytes=small_host)
    assert 2 * 16384 < capped.prefetch_tokens == int(STAGING_SHARE * small_host) // line < plan.prefetch_tokens
    tiny_host = 1 * MiB  # never below the two batches that keep the device fed
    assert plan_budget(
        qwen, 1 << 40, max_batch_tokens=16384, workers=16, process_memory_bytes=tiny_host
    ).prefetch_tokens == (2 * 16384)


def test_cuda_staging_bound_lets_the_pool_make_several_screenshots_at_once(qwen, monkeypatch):
    """A 1080p screenshot's staged line (its input and its decode) exceeds a 16k-token batch: with two
    batches as the bound, one is made at a time whatever the pool's width; one batch per worker lets
    many be made at once (the gate admits a job while the staged total stays within the bound)."""
    prep = ImagePrep(qwen, max_image_bytes=1 << 30, max_image_pixels=1 << 30)
    _, shot = prep.inspect(jpeg_bytes(0, 1920, 1080), None)
    line = shot.cost + shot.decode_cost
    monkeypatch.setattr(qwen, "device", torch.device("cuda"))
    two_batches = plan_budget(qwen, 1 << 40, max_batch_tokens=16384).prefetch_tokens
    wide = plan_budget(qwen, 1 << 40, max_batch_tokens=16384, workers=16, process_memory_bytes=1 << 40).prefetch_tokens
    assert two_batches // line == 1
    assert wide // line >= 8
