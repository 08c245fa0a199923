"""Optional API keys: bearer tokens, each mapped to a tenant namespace."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from visenc.api.codec import error_response
from visenc.config import Settings
from visenc.errors import Unauthorized
from visenc.metrics import Metrics
from visenc.tenancy import TenantError, is_tenant_line, load_tenants

_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: routes that need a key when auth is on
PROTECTED_PREFIX = "/v1/"


class ApiKeyError(ValueError):
    """The configured keys do not parse (the message never contains a key)."""


def _parse(text: str, where: str, separator: str) -> list[tuple[str, str]]:
    pairs = []
    for n, raw in enumerate(text.split(separator), 1):
        line = raw.split("#", 1)[0].strip() if separator == "\n" else raw.strip()
        if not line or (separator == "\n" and is_tenant_line(line)):
            continue
        key, sep, tenant = line.rpartition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key:
            raise ApiKeyError(f"{where}, entry {n}: expected 'key:tenant'")
        if len(key) < 16:
            raise ApiKeyError(f"{where}, entry {n}: keys must be at least 16 characters")
        if not _TENANT_RE.fullmatch(tenant):
            raise ApiKeyError(f"{where}, entry {n}: tenant must be 1-64 characters of [A-Za-z0-9_.-]")
        pairs.append((key, tenant))
    return pairs


def load_api_keys(settings: Settings) -> dict[bytes, str]:
    """SHA-256 digest of each key → its tenant (empty: auth off). Raises ``ApiKeyError``."""
    pairs: list[tuple[str, str]] = []
    if settings.api_key is not None:
        pairs += _parse(f"{settings.api_key.get_secret_value()}:{settings.namespace}", "api_key", "\x00")
    if settings.api_keys is not None:
        pairs += _parse(settings.api_keys.get_secret_value(), "api_keys", ",")
    if settings.api_keys_file is not None:
        try:
            text = Path(settings.api_keys_file).read_text()
        except OSError as e:
            raise ApiKeyError(f"api_keys_file {settings.api_keys_file}: {e.strerror}") from e
        pairs += _parse(text, f"api_keys_file {settings.api_keys_file}", "\n")
    try:
        load_tenants(settings, settings.api_keys_file)
    except TenantError as e:
        raise ApiKeyError(str(e)) from None
    keys: dict[bytes, str] = {}
    for key, tenant in pairs:
        digest = hashlib.sha256(key.encode()).digest()
        if keys.get(digest, tenant) != tenant:
            raise ApiKeyError("the same key is given for two tenants")
        keys[digest] = tenant
    if (settings.api_keys is not None or settings.api_keys_file is not None) and not keys:
        raise ApiKeyError("api_keys / api_keys_file are set but hold no key")
    return keys


def tenant_of(keys: dict[bytes, str], presented: str) -> str | None:
    """The tenant of ``presented``, or None; the time taken does not depend on which key matched."""
    digest = hashlib.sha256(presented.encode()).digest()
    found = None
    for known, tenant in keys.items():
        if hmac.compare_digest(digest, known):  # no early exit: every key is compared
            found = tenant
    return found


class AuthMiddleware:
    """Checks the bearer key of ``/v1/`` requests and sets ``scope['state']['namespace']``."""

    def __init__(self, app: ASGIApp, keys: dict[bytes, str], metrics: Metrics) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        tenant = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    tenant = tenant_of(self.keys, token.strip())
                break
        if tenant is None:
            error = Unauthorized(
                "a valid API key is required: Authorization: Bearer <key>",
                **{"WWW-Authenticate": 'Bearer realm="visenc"'},
            )
            self.metrics.errors.labels(error.kind).inc()
            await error_response(error)(scope, receive, send)
            return
        scope.setdefault("state", {})["namespace"] = tenant
        await self.app(scope, receive, send)
