"""The vLLM commands the docs give parse with vLLM's own parser, and the module the docs name for the
environment ``make vllm`` builds is one vLLM runs as a program and does not mark deprecated."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
from tests.docs.test_docs_commands import COMMANDS

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

VLLM = [(doc, c) for doc, c in COMMANDS if c.startswith(("vllm serve", ".venv-vllm/bin/python -m vllm."))]


def test_the_docs_give_both_commands():
    assert {c.split()[0] for _, c in VLLM} == {"vllm", ".venv-vllm/bin/python"}


@pytest.mark.parametrize(("doc", "command"), VLLM)
def test_vllm_commands_parse(doc, command):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(command)
    if argv[0] == "vllm":
        args = argv[2:]
    else:
        module = argv[argv.index("-m") + 1]
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, f"{doc}: no module {module}"
        source = Path(spec.origin).read_text()
        assert 'if __name__ == "__main__":' in source and "deprecated" not in source, f"{doc}: {module}"
        args = argv[argv.index("-m") + 2 :]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    if "--ec-transfer-config" in args:
        assert parsed.ec_transfer_config.ec_connector == "VisencConnector"
