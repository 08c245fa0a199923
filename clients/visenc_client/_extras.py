"""Optional parts: an import that needs an extra fails in one line that names it."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator


@contextlib.contextmanager
def needs(extra: str, what: str) -> Iterator[None]:
    """Imports of ``what`` that need ``pip install 'visenc-client[extra]'``."""
    try:
        yield
    except ModuleNotFoundError as e:
        package = (e.name or "").split(".")[0]
        if package in ("", "visenc_client"):
            raise
        missing = e.name if _installed(package) else package  # an older release's gap is not "not installed"
        raise ModuleNotFoundError(
            f"{what} needs the '{extra}' extra ({missing} is not installed): pip install 'visenc-client[{extra}]'",
            name=missing,
        ) from None


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
