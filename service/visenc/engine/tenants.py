"""Tenants: each one's weight and quotas, what it holds now, and who admission sheds (``docs/operations.md``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from visenc.errors import Overloaded
from visenc.metrics import PRIORITY_CLASSES, Metrics
from visenc.tenancy import TenantPolicy

#: tenants with a metric label of their own beyond the configured ones; the rest count as ``other``
LABELLED_TENANTS = 32
#: accounts kept before those holding nothing are forgotten
MAX_ACCOUNTS = 4096


@dataclass(slots=True)
class DeviceClock:
    """When the device holds work (a batch taken, launched or being copied out) and the tokens it forwarded,
    over the last ``window_s``: its busy share and seconds per token. Its jobs move on the event loop and
    the device thread: ``_lock`` guards it."""

    window_s: float = 30.0
    _holding: int = 0
    _since: float = 0.0
    #: (end, seconds) of each stretch the device held work; (when, tokens) of each forward's share
    _busy: deque[tuple[float, float]] = field(default_factory=deque)
    _tokens: deque[tuple[float, int]] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, change: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self._holding == 0 and change > 0:
                self._since = now
            self._holding += change
            if self._holding == 0 and change < 0:
                self._busy.append((now, now - self._since))

    def ran(self, tokens: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), tokens))

    def _busy_s(self, now: float) -> float:
        with self._lock:
            return self._busy_in(now)

    def _busy_in(self, now: float) -> float:
        start = now - self.window_s
        while self._busy and self._busy[0][0] < start:
            self._busy.popleft()
        while self._tokens and self._tokens[0][0] < start:
            self._tokens.popleft()
        held = now - max(self._since, start) if self._holding else 0.0
        return held + sum(min(s, end - start) for end, s in self._busy)

    def busy_share(self) -> float:
        return min(1.0, self._busy_s(time.monotonic()) / self.window_s)

    @property
    def per_token_s(self) -> float:
        """Device seconds a token took over the window (0 before any forward)."""
        with self._lock:
            busy, tokens = self._busy_in(time.monotonic()), sum(t for _, t in self._tokens)
        return busy / tokens if tokens else 0.0


@dataclass(eq=False, slots=True)
class Account:
    """What one tenant holds now; written by its jobs' transitions (the event loop's, and the device thread's
    ``run``) under ``lock``, read on the event loop."""

    tenant: str
    policy: TenantPolicy
    #: images admitted and not finished, wanted by a waiter
    images: int = 0
    #: of those, images not yet on the device, and their tower-input tokens
    queued: int = 0
    tokens: int = 0
    label: str = "other"
    #: where its device work goes: the tier's clock, its counter (``visenc_tenant_device_tokens_total``)
    clock: DeviceClock | None = None
    counter: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def weight(self) -> float:
        return self.policy.weight

    def change(self, now: tuple[int, int, int], before: tuple[int, int, int]) -> None:
        with self.lock:
            self.images += now[0] - before[0]
            self.queued += now[1] - before[1]
            self.tokens += now[2] - before[2]

    def ran(self, tokens: int) -> None:
        """One of its images was forwarded: ``tokens`` tower-input tokens of device work."""
        if self.counter is not None:
            self.counter.inc(tokens)
        if self.clock is not None:
            self.clock.ran(tokens)

    def hold(self, change: int) -> None:
        """One of its images went on the device (+1) or came off it (-1)."""
        if self.clock is not None:
            self.clock.hold(change)


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
            if len(self.accounts) >= MAX_ACCOUNTS:  # namespaces come from callers: forget those holding nothing
                self.accounts = {t: a for t, a in self.accounts.items() if a.images or t in self.policies}
            policy = self.policies.get(tenant, self.default)
            if tenant in self.policies or len(self._labels) < len(self.policies) + LABELLED_TENANTS:
                self._labels.add(tenant)
            label = tenant if tenant in self._labels else "other"
            counter = self.metrics.tenant_device_tokens.labels(label)
            acc = self.accounts[tenant] = Account(tenant, policy, label=label, clock=self.clock, counter=counter)
        return acc

    def admit(self, tenant: str, images: int, tokens: int, exempt: bool = False) -> bool:
        """Refuse (``Overloaded``) ``images`` new images of ``tokens`` tower-input tokens over the tenant's
        quota, or over the queue limit when the tenant holds the most of it for its weight; a tenant holding
        nothing is admitted whatever its quotas, and so are the later waves of its request (``exempt``, what
        this returns)."""
        acc = self.account(tenant)
        exempt = exempt or not acc.images
        if images <= 0:
            return exempt
        p, held = acc.policy, not exempt
        if held and p.max_images is not None and acc.images + images > p.max_images:
            raise self._refuse(acc, "tenant_images", f"tenant {tenant!r} has {acc.images} images in flight "
                               f"(max_images={p.max_images})")  # fmt: skip
        if held and acc.tokens and p.max_queued_tokens is not None and acc.tokens + tokens > p.max_queued_tokens:
            raise self._refuse(acc, "tenant_tokens", f"tenant {tenant!r} has {acc.tokens} tokens queued "
                               f"(max_queued_tokens={p.max_queued_tokens})")  # fmt: skip
        total = sum(a.queued for a in self.accounts.values())
        if total + images <= self.max_queue_images:
            return exempt
        share = (
            self.max_queue_images * acc.weight / sum(a.weight for a in self.accounts.values() if a.queued or a is acc)
        )
        if acc.queued + images > share or total + images > 2 * self.max_queue_images:
            limit = f"max_queue_images={self.max_queue_images}"
            raise self._refuse(acc, "queue_full", f"encoder queue is full ({limit}); tenant {tenant!r} holds "
                               f"{acc.queued} of it")  # fmt: skip
        return exempt

    @contextlib.contextmanager
    def reserved(self, tenant: str, images: int, tokens: int) -> Iterator[None]:
        """Images just admitted, counted against the quotas and the queue limit until their jobs count them:
        a request admitted meanwhile sees them."""
        acc, held = self.account(tenant), (images, images, tokens)
        acc.change(held, (0, 0, 0))
        try:
            yield
        finally:
            acc.change((0, 0, 0), held)

    def precheck(self, tenant: str) -> None:
        """Refuse at once a tenant already at a quota, or holding its share of a full queue: a flood's refusal
        then costs no body read and no inspection (``admit`` still decides for the rest)."""
        acc, p = self.account(tenant), self.account(tenant).policy
        if p.max_images is not None and acc.images >= p.max_images:
            raise self._refuse(acc, "tenant_images", f"tenant {tenant!r} has {acc.images} images in flight "
                               f"(max_images={p.max_images})")  # fmt: skip
        if p.max_queued_tokens is not None and acc.tokens >= p.max_queued_tokens:
            raise self._refuse(acc, "tenant_tokens", f"tenant {tenant!r} has {acc.tokens} tokens queued "
                               f"(max_queued_tokens={p.max_queued_tokens})")  # fmt: skip

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
