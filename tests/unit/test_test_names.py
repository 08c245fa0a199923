"""Every test module has a basename of its own: pytest imports them by basename (the test folders
are not packages), so a second file of the same name elsewhere stops collection."""

from __future__ import annotations

from collections import Counter

from harness.paths import ROOT


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
