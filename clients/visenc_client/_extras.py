"""Optional parts: an import that needs an extra fails in one line that names it."""

from __future__ import annotations

import contextlib
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
        raise ModuleNotFoundError(
            f"{what} needs the '{extra}' extra ({package} is not installed): pip install 'visenc-client[{extra}]'",
            name=package,
        ) from None
