"""``visenc serve`` and ``visenc proxy`` take their flags from their settings, one way: a flag and a
variable per field, the flag winning; list fields repeat, a bool flag alone means true."""

from __future__ import annotations

import pytest

from visenc.cli import build_parser, main
from visenc.config import Settings
from visenc.proxy.settings import ProxySettings


def flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    return {a.dest for a in sub._actions if a.dest != "help"}


@pytest.mark.parametrize(("command", "model"), [("serve", Settings), ("proxy", ProxySettings)])
def test_every_field_is_a_flag(command: str, model: type) -> None:
    assert flags(command) == set(model.model_fields)


def test_proxy_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["proxy", "--upstream", "http://a/", "--upstream", "http://b", "--encode-first", "--affinity-size", "7"]
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    monkeypatch.setenv("VISENC_PROXY_ABSENT_TIMEOUT_S", "0.2")
    monkeypatch.setenv("VISENC_PROXY_AFFINITY_SIZE", "9")  # the flag wins
    monkeypatch.setenv("VISENC_API_KEY", "k1")  # the service's own variable serves the proxy too
    s = ProxySettings(**args)
    assert s.upstream == ["http://a", "http://b"] and s.encode_first is True and s.affinity_size == 7
    assert s.absent_timeout_s == 0.2 and s.visenc_api_key is not None
    assert s.visenc_api_key.get_secret_value() == "k1"
    monkeypatch.setenv("VISENC_PROXY_UPSTREAM", '["http://c"]')
    assert ProxySettings().upstream == ["http://c"]


def test_invalid_proxy_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["proxy", "--upstream", "http://a", "--video-num-frames", "0"]) == 2
    assert "video_num_frames" in capsys.readouterr().err
    assert main(["proxy"]) == 2  # no upstream
