"""Every documented ``visenc serve`` / ``visenc proxy`` that another host or container reaches binds an
address it can reach: its own arguments name another host (a Redis ``cache``, an upstream ``vllm-a``),
or its doc section points a client at visenc by a name other than loopback (``http://visenc:8000``).
Commands for a trial on one's own machine keep the default, 127.0.0.1."""

from __future__ import annotations

import re
import shlex

import pytest
from harness.paths import ROOT

from visenc.cli import build_parser
from visenc.config import Settings
from visenc.proxy.settings import ProxySettings

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
URL_HOST = re.compile(r"\b(?:https?|rediss?)://(?:[^@/\s'\"]*@)?([A-Za-z0-9.\-\[\]:]+?)(?::\d+)?(?=[/\s'\"]|$)")


def sections() -> list[tuple[str, str]]:
    """(doc, section text) for every ``##`` section of every doc."""
    out = []
    for doc in DOCS:
        for part in re.split(r"^(?=## )", doc.read_text(), flags=re.M):
            out.append((doc.name, part))
    return out


def remote_hosts(text: str) -> set[str]:
    return {h for h in URL_HOST.findall(text) if h not in LOOPBACK}


def served_commands() -> list[tuple[str, str, bool]]:
    """(doc, command, whether another host reaches it) for each ``visenc serve|proxy`` of a bash block."""
    out = []
    for doc, section in sections():
        clients_elsewhere = bool(re.search(r"http://visenc[\w-]*:\d+", section))
        for block in re.findall(r"```bash\n(.*?)```", section, re.S):
            for line in block.splitlines():
                command = re.sub(r"\s+#.*$", "", line).strip().rstrip("&").strip()
                if re.match(r"visenc (serve|proxy)\b", command):
                    out.append((doc, command, clients_elsewhere or bool(remote_hosts(command))))
    return out


COMMANDS = served_commands()


def test_the_rule_sees_both_kinds():
    assert any(reached for *_, reached in COMMANDS) and any(not reached for *_, reached in COMMANDS)
    assert remote_hosts("--redis-url redis://:PASSWORD@cache:6379/0 --visenc http://127.0.0.1:8000") == {"cache"}


@pytest.mark.parametrize(("doc", "command"), [(d, c) for d, c, reached in COMMANDS if reached])
def test_a_command_another_host_reaches_binds_a_reachable_address(doc, command):
    args = vars(build_parser().parse_args(shlex.split(command)[1:]))
    default = (Settings if args["command"] == "serve" else ProxySettings).model_fields["host"].default
    host = args.get("host") or default
    assert host not in LOOPBACK, f"{doc}: `{command}` binds {host}: add --host 0.0.0.0 (reached from elsewhere)"
