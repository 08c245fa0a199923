"""The ``--uds`` socket is its owner's only (0600) unless ``--uds-mode`` says otherwise, whatever the umask;
a socket left by a killed visenc is replaced, one a live visenc listens on is not."""

from __future__ import annotations

import os
import stat

import pytest
from pydantic import ValidationError

from visenc import preflight
from visenc.cli import build_parser
from visenc.config import Settings


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the loosest umask: the mode must not come from it
    yield
    os.umask(old)


def mode_of(path) -> int:
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


@pytest.mark.parametrize(("asked", "mode"), [(None, 0o600), ("0660", 0o660), ("0o640", 0o640), ("600", 0o600)])
def test_the_socket_gets_the_mode_asked(tmp_path, open_umask, asked, mode):
    path = tmp_path / "v.sock"
    settings = Settings(uds=path) if asked is None else Settings(uds=path, uds_mode=asked)
    sock = preflight.listen(settings)
    try:
        assert mode_of(path) == mode
    finally:
        sock.close()
    again = preflight.listen(settings)  # the file of a closed (killed) one is stale: replaced
    again.close()


def test_the_flag_and_its_refusals():
    args = vars(build_parser().parse_args(["serve", "--uds-mode", "0660"]))
    assert args.pop("command") == "serve" and Settings(**args).uds_mode == 0o660
    for bad in ("rw-rw----", "0999", "01777"):
        with pytest.raises(ValidationError, match="uds_mode"):
            Settings(uds_mode=bad)
