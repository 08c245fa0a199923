"""Tenants as settings: a tenant's weight and quotas, from ``--tenant`` lines or the API-keys file's ``tenant``
lines, and the settings that apply to every tenant."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

_QUOTAS = {"weight": float, "max_images": int, "max_queued_tokens": int}


class TenantError(ValueError):
    """A tenant line or setting that does not parse (the message names it)."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's device weight and quotas (``None``: no quota of its own)."""

    weight: float = 1.0
    max_images: int | None = None
    max_queued_tokens: int | None = None


def parse_tenant(line: str, where: str) -> tuple[str, TenantPolicy]:
    """``NAME weight=2 max_images=64 max_queued_tokens=200000`` (any of the three, once each)."""
    name, *pairs = line.split() or [""]
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise TenantError(f"{where}: tenant must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    values: dict[str, float | int] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        if key not in _QUOTAS or key in values:
            raise TenantError(f"{where}: expected weight=, max_images=, max_queued_tokens= once each, got {pair!r}")
        try:
            values[key] = _QUOTAS[key](raw)
        except ValueError:
            raise TenantError(f"{where}: {key} must be a number, got {raw!r}") from None
        if not values[key] > 0 or values[key] == float("inf"):
            raise TenantError(f"{where}: {key} must be a positive number, got {raw!r}")
    return name, TenantPolicy(**values)  # type: ignore[arg-type]


def tenant_policies(lines: Iterable[tuple[str, str]]) -> dict[str, TenantPolicy]:
    """Each ``(line, where)`` parsed; a tenant named twice is refused."""
    policies: dict[str, TenantPolicy] = {}
    for line, where in lines:
        name, policy = parse_tenant(line, where)
        if name in policies:
            raise TenantError(f"{where}: tenant {name!r} is named twice")
        policies[name] = policy
    return policies


class TenantSettings(BaseSettings):
    """The tenancy part of ``config.Settings``."""

    tenant: list[str] = Field(
        default_factory=list,
        description="A tenant's device weight and quotas: 'NAME weight=2 max_images=64 max_queued_tokens=200000' "
        "(any of the three; repeat the flag per tenant). The API-keys file takes the same lines as 'tenant NAME ...'. "
        "Unnamed tenants get weight 1 and the tenant_max_* quotas.",
    )
    tenant_max_images: int | None = Field(
        None, gt=0, description="Most images a tenant may have in flight (admitted, not finished) before 429."
    )
    tenant_max_queued_tokens: int | None = Field(
        None, gt=0, description="Most tower-input tokens a tenant may have queued for the device before 429."
    )
    batch_floor: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Least share of the device's tokens batch-class work gets while interactive work waits too.",
    )
    busy_window_s: float = Field(
        30.0, gt=0, description="Window of visenc_device_busy_ratio, the device's busy share (autoscaling), seconds."
    )

    @field_validator("tenant")
    @classmethod
    def _check_tenants(cls, v: list[str]) -> list[str]:
        try:
            tenant_policies((line, f"tenant {line!r}") for line in v)
        except TenantError as e:
            raise ValueError(str(e)) from None
        return v

    def tenant_lines(self) -> list[tuple[str, str]]:
        return [(line, f"--tenant {line!r}") for line in self.tenant]


def is_tenant_line(line: str) -> bool:
    """A line of the API-keys file that names a tenant's weight and quotas (``tenant NAME ...``)."""
    return line.split(maxsplit=1)[:1] == ["tenant"]


def load_tenants(settings: TenantSettings, keys_file: Path | None) -> dict[str, TenantPolicy]:
    """Every tenant's policy, from ``--tenant`` and the ``tenant`` lines of ``keys_file``. Raises ``TenantError``
    (a tenant named twice, a value that is not a positive number) or ``OSError``."""
    lines = settings.tenant_lines()
    if keys_file is not None:
        for n, raw in enumerate(keys_file.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if is_tenant_line(line):
                lines.append((line.split(maxsplit=1)[1] if " " in line else "", f"{keys_file}, line {n}"))
    return tenant_policies(lines)
