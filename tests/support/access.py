"""``without_file_access``: a prefix under which a command cannot open a file against its mode."""

from __future__ import annotations

import os
import shutil

import pytest


def without_file_access() -> list[str]:
    """A prefix that runs a command unable to open a file against its mode (root keeps no override)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("as root, needs setpriv(1) to drop the capability that opens any file")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]
