"""A real ``visenc serve`` whose process the test controls (signals, exit status, log)."""

from __future__ import annotations

from tests.conftest import serve_subprocess as server_process

__all__ = ["server_process"]
