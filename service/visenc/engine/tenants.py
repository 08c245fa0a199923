"""Tenants: each one's weight and quotas, what it holds now, and who admission sheds (``docs/operations.md``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from visenc.errors import Overloaded
from visenc.metrics import PRIORITY_CLASSES, Metrics
from visenc.tenancy import TenantPolicy

#: tenants with a metric label of their own beyond the configured ones; the rest count as ``other``
LABELLED_TENANTS = 32


@dataclass(slots=True)
class DeviceClock:
    """Device seconds by tenant, the busy share over ``window_s``, seconds per token (event loop only)."""

    window_s: float = 30.0
    per_token_s: float = 0.0
    _ran: deque[tuple[float, float]] = field(default_factory=deque)

    def ran(self, seconds: float, tokens: int) -> None:
        now = time.monotonic()
        self._ran.append((now, seconds))
        if tokens > 0:
            rate = seconds / tokens
            self.per_token_s = rate if self.per_token_s == 0 else 0.8 * self.per_token_s + 0.2 * rate

    def busy_share(self) -> float:
        now = time.monotonic()
        while self._ran and self._ran[0][0] < now - self.window_s:
            self._ran.popleft()
        return min(1.0, sum(s for _, s in self._ran) / self.window_s)


@dataclass(eq=False, slots=True)
class Account:
    """What one tenant holds now; written by its jobs on the event loop (``Job``'s transitions)."""

    tenant: str
    policy: TenantPolicy
    #: images admitted and not finished, wanted by a waiter
    images: int = 0
    #: of those, images not yet on the device, and their tower-input tokens
    queued: int = 0
    tokens: int = 0
    label: str = "other"
    #: where its device time goes: the tier's clock, its counter (``visenc_tenant_device_seconds_total``)
    clock: DeviceClock | None = None
    counter: Any = None

    @property
    def weight(self) -> float:
        return self.policy.weight

    def change(self, now: tuple[int, int, int], before: tuple[int, int, int]) -> None:
        self.images += now[0] - before[0]
        self.queued += now[1] - before[1]
        self.tokens += now[2] - before[2]

    def ran(self, seconds: float, tokens: int) -> None:
        """Its share of a forward: ``seconds`` of device time for ``tokens`` tower-input tokens."""
        if self.counter is not None:
            self.counter.inc(seconds)
        if self.clock is not None:
            self.clock.ran(seconds, tokens)


class Tenants:
    """Every tenant's account; admission by quota and by the global queue limit (event loop only)."""

    def __init__(
        self,
        policies: Mapping[str, TenantPolicy],
        default: TenantPolicy,
        max_queue_images: int,
        metrics: Metrics,
        window_s: float = 30.0,
    ) -> None:
        self.policies, self.default, self.max_queue_images = dict(policies), default, max_queue_images
        self.metrics = metrics
        self.accounts: dict[str, Account] = {}
        self.clock = DeviceClock(window_s)
        self._labels = set(policies)

    def account(self, tenant: str) -> Account:
        if (acc := self.accounts.get(tenant)) is None:
            policy = self.policies.get(tenant, self.default)
            if tenant in self.policies or len(self._labels) < len(self.policies) + LABELLED_TENANTS:
                self._labels.add(tenant)
            label = tenant if tenant in self._labels else "other"
            counter = self.metrics.tenant_device_seconds.labels(label)
            acc = self.accounts[tenant] = Account(tenant, policy, label=label, clock=self.clock, counter=counter)
        return acc

    def admit(self, tenant: str, images: int, tokens: int) -> None:
        """Refuse (``Overloaded``) ``images`` new images of ``tokens`` tower-input tokens over the tenant's
        quota, or over the queue limit when the tenant holds the most of it for its weight; a tenant holding
        nothing is admitted whatever its quotas."""
        acc = self.account(tenant)
        if images <= 0:
            return
        p = acc.policy
        if acc.images and p.max_images is not None and acc.images + images > p.max_images:
            raise self._refuse(acc, "tenant_images", f"tenant {tenant!r} has {acc.images} images in flight "
                               f"(max_images={p.max_images})")  # fmt: skip
        if acc.tokens and p.max_queued_tokens is not None and acc.tokens + tokens > p.max_queued_tokens:
            raise self._refuse(acc, "tenant_tokens", f"tenant {tenant!r} has {acc.tokens} tokens queued "
                               f"(max_queued_tokens={p.max_queued_tokens})")  # fmt: skip
        total = sum(a.queued for a in self.accounts.values())
        if total + images <= self.max_queue_images:
            return
        share = (
            self.max_queue_images * acc.weight / sum(a.weight for a in self.accounts.values() if a.queued or a is acc)
        )
        if acc.queued + images > share or total + images > 2 * self.max_queue_images:
            limit = f"max_queue_images={self.max_queue_images}"
            raise self._refuse(acc, "queue_full", f"encoder queue is full ({limit}); tenant {tenant!r} holds "
                               f"{acc.queued} of it")  # fmt: skip

    def _refuse(self, acc: Account, reason: str, message: str) -> Overloaded:
        active = sum(a.weight for a in self.accounts.values() if a.queued or a is acc)
        wait_s = acc.tokens * self.clock.per_token_s * active / acc.weight
        self.metrics.refusals.labels(acc.label, reason).inc()
        return Overloaded(message, retry_after_s=min(60.0, max(1.0, wait_s)))


def export_backlog(metrics: Metrics, backlog: Iterable[tuple[str, int, float]], clock: DeviceClock) -> None:
    """The autoscaling gauges: the busy share, and per class the queued device-seconds and the oldest wait, from
    the ``(priority, tokens, admitted_at)`` of each image waiting for the device."""
    metrics.device_busy.set(clock.busy_share())
    now = time.monotonic()
    tokens, oldest = dict.fromkeys(PRIORITY_CLASSES, 0), dict.fromkeys(PRIORITY_CLASSES, now)
    for priority, cost, admitted_at in backlog:
        tokens[priority] += cost
        oldest[priority] = min(oldest[priority], admitted_at)
    for c in PRIORITY_CLASSES:
        metrics.queued_device_seconds.labels(c).set(tokens[c] * clock.per_token_s)
        metrics.oldest_waiting.labels(c).set(now - oldest[c])
