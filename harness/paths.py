"""Where the repository is: ``ROOT``, for the tests and benches that read its files or start its processes."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
