"""``visenc serve``'s app on the simulated device (``models/sim.py``), with a loop hog beside it."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def sim_module() -> ModuleType:
    try:
        from visenc.models import sim

        return sim
    except ImportError:  # a tree from before it: this tree's, by path
        path = Path(__file__).resolve().parents[1] / "service" / "visenc" / "models" / "sim.py"
        spec = importlib.util.spec_from_file_location("visenc_sim", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module


def outputs_wait_for_the_stream() -> None:
    """In a tree whose CPU outputs are read as the forward returns them: wait for the stream first."""
    from visenc.engine.outputs import Outputs

    if "event.synchronize" in inspect.getsource(Outputs._to_host):
        return
    read = Outputs._to_host

    def to_host(self: Any, outputs: list[Any], event: Any) -> Any:
        for out in outputs:
            out.sim_event.synchronize()
        return read(self, outputs, event)

    Outputs._to_host = to_host  # type: ignore[method-assign]


async def hog(busy_ms: float, period_ms: float) -> None:
    while True:
        until = time.perf_counter() + busy_ms / 1000
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(max(0.0, period_ms - busy_ms) / 1000)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from visenc.bootstrap import create_app
    from visenc.config import Settings

    tower = sim_module().load(args.spec)
    outputs_wait_for_the_stream()
    settings = Settings(
        port=args.port, log_level="warning", max_wait_ms=args.max_wait_ms, prefetch_tokens=args.prefetch_tokens
    )
    app = create_app(settings, tower=tower)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    hogging = asyncio.create_task(hog(args.hog_ms, args.period_ms)) if args.hog_ms > 0 else None
    await server.serve()
    if hogging is not None:
        hogging.cancel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("spec")
    p.add_argument("port", type=int)
    p.add_argument("--hog-ms", type=float, default=0.0)
    p.add_argument("--period-ms", type=float, default=40.0)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    # staged input as a GPU host plans it (two batches ready, one a preprocessing worker: ``engine/budget.py``),
    # not a CPU tower's quarter batch, which a decoding image alone can fill
    p.add_argument("--prefetch-tokens", type=int, default=4 * 4096)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
