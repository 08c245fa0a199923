"""``visenc proxy``: an OpenAI-compatible front for vLLM replicas that use visenc as their encoder."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from visenc.proxy.app import create_proxy_app
    from visenc.proxy.core import Proxy
    from visenc.proxy.errors import ProxyError
    from visenc.proxy.settings import ProxySettings

__all__ = ["Proxy", "ProxyError", "ProxySettings", "create_proxy_app"]
#: imported on first use: ``visenc serve`` reads the proxy's settings without its server (aiohttp, FastAPI)
_HOMES = {"Proxy": "core", "ProxyError": "errors", "ProxySettings": "settings", "create_proxy_app": "app"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'visenc.proxy' has no attribute {name!r}")
    return getattr(importlib.import_module(f"visenc.proxy.{_HOMES[name]}"), name)
