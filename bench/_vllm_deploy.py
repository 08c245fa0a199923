"""The deployment ``bench_vllm`` measures: visenc, vLLMs with and without the connector, and
``visenc proxy``, each a subprocess; the systems not measured paused."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import _common as c

SYSTEMS = {"alone": ["alone"], "twin": ["twin"], "cold": ["visenc", "behind", "proxy"]}

#: the longest prompt the vLLMs take (``--max-model-len``; real row sizes need more)
MAX_MODEL_LEN = {"value": 4096}


def vllm_cmd(model: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN["value"]), "--seed", "0"),
        *("--limit-mm-per-prompt", json.dumps({"image": 8, "video": 0})),
        *extra,
    ]


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}


@contextlib.contextmanager
def deployment(model: Path, logs: Path) -> Iterator[tuple[dict[str, str], dict]]:
    """visenc, vLLM alone, vLLM with the connector and ``visenc proxy`` in front of it. The
    processes of the system not being measured are paused (``only``), as they share the cores."""
    from openai_servers import connector_config

    ports = {k: c.free_port() for k in ("visenc", "alone", "twin", "behind", "proxy")}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs = {}
    with contextlib.ExitStack() as stack:
        procs["visenc"] = stack.enter_context(
            c.server(
                c.visenc_cmd(str(model), ports["visenc"], "--max-wait-ms", "1"),
                urls["visenc"] + "/readyz",
                c.service_env(),
                logs / "visenc.log",
            )
        )
        config = connector_config(urls["visenc"])
        for name, extra in (("alone", ()), ("twin", ()), ("behind", ("--ec-transfer-config", config))):
            cmd = vllm_cmd(model, ports[name], *extra)
            procs[name] = stack.enter_context(c.server(cmd, urls[name] + "/health", VLLM_ENV, logs / f"{name}.log"))
        proxy = [sys.executable, "-m", "visenc", "proxy", "--port", str(ports["proxy"])]
        proxy += ["--visenc", urls["visenc"], "--upstream", urls["behind"]]
        procs["proxy"] = stack.enter_context(
            c.server(proxy, urls["proxy"] + "/health", c.service_env(), logs / "proxy.log")
        )
        yield urls, procs


@contextlib.contextmanager
def only(procs: dict, mode: str) -> Iterator[None]:
    """Pause the processes of the other systems while ``mode``'s runs."""
    mine = SYSTEMS.get(mode, SYSTEMS["cold"])
    others = [name for system in SYSTEMS.values() for name in system if name not in mine]
    for name in others:
        c.pause(procs[name])
    try:
        yield
    finally:
        for name in others:
            c.resume(procs[name])
