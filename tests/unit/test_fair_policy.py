"""The batching policy: tenants share the device by weight, interactive work goes first with a floor for batch
work, a tenant alone gets everything, batches fill across tenants, and accounts follow their jobs."""

from __future__ import annotations

import pytest
from harness.waits import until
from tests.support.stages import forwarded, job, make_scheduler

from visenc.engine.policy import BatchPolicy, SchedulerConfig
from visenc.engine.tenants import Account, DeviceClock, Tenants
from visenc.errors import Overloaded
from visenc.metrics import Metrics
from visenc.tenancy import TenantError, TenantPolicy, tenant_policies


def accounts(**weights: float) -> dict[str, Account]:
    tenants = Tenants({t: TenantPolicy(weight=w) for t, w in weights.items()}, TenantPolicy(), 1000, Metrics())
    return {t: tenants.account(t) for t in weights}


def drain(policy: BatchPolicy, waiting: list, n: int) -> list:
    """The first ``n`` jobs the policy hands to preparation, in order."""
    picked = []
    for _ in range(n):
        j = policy.pick(waiting)
        assert j is not None
        waiting.remove(j)
        policy.charge(j)
        picked.append(j)
    return picked


async def test_tenants_share_the_device_by_weight_not_by_arrival():
    acc = accounts(a=1, b=1, c=2)
    policy = BatchPolicy(SchedulerConfig(100, 8, True))
    # a floods first: 100 jobs before b's and c's arrive
    waiting = [job(10, (0, i), account=acc["a"]) for i in range(100)]
    waiting += [job(10, (1, i), account=acc["b"]) for i in range(100)]
    waiting += [job(10, (2, i), account=acc["c"]) for i in range(100)]
    got = drain(policy, waiting, 80)
    share = {t: sum(j.account is acc[t] for j in got) for t in acc}
    assert share == {"a": 20, "b": 20, "c": 40}


async def test_within_a_tenant_fetch_bumped_then_prompt_order():
    acc = accounts(a=1)
    policy = BatchPolicy(SchedulerConfig(100, 8, True))
    waiting = [job(10, (0, i), account=acc["a"]) for i in range(5)]
    waiting[3].bump()
    assert drain(policy, list(waiting), 5) == [waiting[3], waiting[0], waiting[1], waiting[2], waiting[4]]


async def test_a_tenant_alone_gets_every_turn_and_banks_no_idle_time():
    acc = accounts(a=1, b=1)
    policy = BatchPolicy(SchedulerConfig(100, 8, True))
    waiting = [job(10, (0, i), account=acc["a"]) for i in range(50)]
    assert all(j.account is acc["a"] for j in drain(policy, waiting, 30))
    # b arrives after a ran alone: it shares from now on, it does not get a's 30 turns back first
    waiting += [job(10, (1, i), account=acc["b"]) for i in range(20)]
    got = drain(policy, waiting, 10)
    assert sum(j.account is acc["b"] for j in got) == 5


async def test_interactive_first_and_batch_keeps_its_floor():
    acc = accounts(a=1, b=1)
    floor = 0.1
    policy = BatchPolicy(SchedulerConfig(100, 8, True, batch_floor=floor))
    waiting = [job(10, (0, i), account=acc["a"], priority="batch") for i in range(100)]
    waiting += [job(10, (1, i), account=acc["b"]) for i in range(100)]
    got = drain(policy, waiting, 100)
    assert got[0].priority == "interactive"
    batch = sum(j.priority == "batch" for j in got)
    # the bound: a batch job waits for at most (1 - floor) / floor interactive jobs of its size, plus one
    assert batch == pytest.approx(100 * floor, abs=1)
    gaps = [i for i, j in enumerate(got) if j.priority == "batch"]
    assert max(b - a - 1 for a, b in zip([-1, *gaps], gaps)) <= (1 - floor) / floor + 1
    # with no interactive work waiting, batch work gets the device
    waiting = [j for j in waiting if j.priority == "batch"]
    assert all(j.priority == "batch" for j in drain(policy, waiting, 10))


async def test_batches_fill_across_tenants_interactive_first():
    acc = accounts(a=1, b=1)
    policy = BatchPolicy(SchedulerConfig(60, 8, True))
    ready = [job(10, (0, i), account=acc["a"], priority="batch") for i in range(4)]
    ready += [job(10, (1, i), account=acc["b"]) for i in range(2)]
    for n, j in enumerate(ready, 1):
        j.turn = n
    batch = policy.form_batch(ready)
    assert batch == [*ready[4:], *ready[:4]]  # one full batch, both tenants in it


async def test_accounts_follow_their_jobs_and_a_leaving_waiter_frees_them_at_once():
    acc = accounts(a=1)["a"]
    s = make_scheduler(prefetch=10)
    jobs = [job(10, (0, i), account=acc) for i in range(3)]
    assert (acc.images, acc.queued, acc.tokens) == (3, 0, 0)  # admitted: their tokens count once queued
    for j in jobs:
        s.submit(j)
    assert (acc.images, acc.queued, acc.tokens) == (3, 3, 30)
    await until(lambda: len(s._ready) == 1)
    jobs[2].leave()  # its client went away: it stops counting at once, before the scheduler drops it
    assert (acc.images, acc.queued, acc.tokens) == (2, 2, 20)
    first = s.take_batch()
    assert first == [jobs[0]] and (acc.images, acc.queued, acc.tokens) == (2, 1, 10)
    forwarded(s, first)
    await until(lambda: len(s._ready) == 1)
    assert jobs[2].finished and jobs[2] not in s._waiting
    second = s.take_batch()
    forwarded(s, second)
    for j in jobs[:2]:
        j.finish()
    assert (acc.images, acc.queued, acc.tokens) == (0, 0, 0)


async def test_quotas_refuse_the_offender_only_with_retry_after():
    metrics = Metrics()
    tenants = Tenants({"a": TenantPolicy(max_images=2, max_queued_tokens=1000)}, TenantPolicy(), 10, metrics)
    a, b = tenants.account("a"), tenants.account("b")
    a.change((2, 2, 20), (0, 0, 0))
    with pytest.raises(Overloaded) as refused:
        tenants.admit("a", 1, 10)
    assert "max_images=2" in refused.value.message and int(refused.value.headers["Retry-After"]) >= 1
    tenants.admit("b", 5, 50)  # b has no quota of its own
    b.change((5, 5, 50), (0, 0, 0))
    # the queue is full (7 + 4 > 10): b holds the most, so b is shed, not a
    with pytest.raises(Overloaded, match="queue is full"):
        tenants.admit("b", 4, 40)
    a.change((1, 1, 10), (2, 2, 20))
    tenants.admit("a", 1, 10)  # over the limit, but under its share: a is not the one using the most
    sample = metrics.registry.get_sample_value
    assert sample("visenc_refusals_total", {"tenant": "a", "reason": "tenant_images"}) == 1
    assert sample("visenc_refusals_total", {"tenant": "b", "reason": "queue_full"}) == 1


async def test_a_tenant_holding_nothing_is_admitted_whatever_its_quota():
    tenants = Tenants({}, TenantPolicy(max_images=1), 10, Metrics())
    tenants.admit("a", 3, 30)  # alone over its quota: it still runs


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("a weight=0", "positive"),
        ("a weight=-1", "positive"),
        ("a weight=nan", "positive"),
        ("a max_images=0", "positive"),
        ("a max_queued_tokens=x", "number"),
        ("a priority=batch", "once each"),
        ("a weight=1 weight=2", "once each"),
        ("a/b weight=1", "tenant must be"),
    ],
)
def test_bad_tenant_lines_are_refused_with_their_reason(line: str, why: str):
    with pytest.raises(TenantError, match=why):
        tenant_policies([(line, "here")])


def test_a_tenant_named_twice_is_refused():
    with pytest.raises(TenantError, match="named twice"):
        tenant_policies([("a weight=2", "one"), ("a max_images=3", "two")])


def test_policies_parse():
    assert tenant_policies([("a weight=2.5 max_images=3", "x")]) == {"a": TenantPolicy(2.5, 3, None)}


def test_the_device_clock_counts_the_time_the_device_held_work(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("visenc.engine.tenants.time.monotonic", lambda: now[0])
    clock = DeviceClock(window_s=10.0)
    clock.hold(1)  # two images taken into a batch
    clock.hold(1)
    now[0] += 2.0
    clock.ran(100)
    clock.ran(100)
    clock.hold(-1)
    assert clock.busy_share() == pytest.approx(0.2)  # one still held: the stretch is open
    clock.hold(-1)
    now[0] += 3.0  # idle
    assert clock.busy_share() == pytest.approx(0.2) and clock.per_token_s == pytest.approx(0.01)
    clock.hold(1)
    now[0] += 9.0  # the first stretch left the window: only the open one counts
    assert clock.busy_share() == pytest.approx(0.9)


async def test_interactive_work_is_staged_past_batch_work_that_fills_the_gate():
    """Batch work fills the prefetch gate; an interactive image is prepared at once (one batch past it), so it
    runs in the next batch the device takes, ahead of the batch work staged before it."""
    acc = accounts(a=1, b=1)
    s = make_scheduler(prefetch=20, max_tokens=10, max_images=1)
    flood = [job(10, (0, i), account=acc["a"], priority="batch") for i in range(5)]
    for j in flood:
        s.submit(j)
    await until(lambda: len(s._ready) == 2)
    assert s.staged_tokens == 20 and len(s._waiting) == 3
    b = job(10, (1, 0), account=acc["b"])
    s.submit(b)
    await until(lambda: len(s._ready) == 3)
    assert s.take_batch() == [b]
    another = job(10, (1, 1), account=acc["b"], priority="batch")
    s.submit(another)  # batch work is not staged past the gate
    assert another in s._waiting


def test_accounts_of_tenants_holding_nothing_are_forgotten(monkeypatch):
    monkeypatch.setattr("visenc.engine.tenants.MAX_ACCOUNTS", 3)
    tenants = Tenants({"a": TenantPolicy(weight=2)}, TenantPolicy(), 10, Metrics())
    busy = tenants.account("busy")
    busy.change((1, 1, 10), (0, 0, 0))
    tenants.account("idle")
    tenants.account("a")
    tenants.account("new")  # the fourth: the idle one goes, the configured and the busy ones stay
    assert set(tenants.accounts) == {"a", "busy", "new"} and tenants.account("busy") is busy
